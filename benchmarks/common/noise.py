"""Whether a run's host was quiet enough to read its figures as results, measured in the run: the
load average before and after it (other work on the cores), and the spread of each row's repeats.
Every report prints what was measured and says NOISY where the host was, and a ratio above its
ceiling (a copy cannot beat one contiguous copy of the same bytes by more than timing noise) is
marked unreliable instead of printed as a result.

    host = noise.Host()                       # before any work: the load others put on the host
    ...                                        # the run, keeping each row's repeats
    verdict = host.verdict(spreads)           # {"noisy", "reasons", "load_before", ...}
    lines = noise.markdown(verdict)
"""

import os
import statistics
from typing import Dict, List, Optional, Sequence

BUSY_LOAD_PER_CORE = 0.5  # a 1-minute load average above this per core before the run: others were busy
CROWDED_LOAD_PER_CORE = 1.5  # ... after it: more runnable threads than the run's own and its cores
NOISY_SPREAD = 0.25  # a row whose repeats spread (max - min) / median more than this is noisy
ABOVE_CEILING = 1.05  # a ratio to a ceiling above this is noise in the ceiling's timing, not a result


def load_average() -> Optional[List[float]]:
    """The 1, 5 and 15-minute load averages (None where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def spread(samples: Sequence[float]) -> Optional[float]:
    """(max - min) / median of a row's repeats; None with fewer than two."""
    values = [float(s) for s in samples if s is not None]
    if len(values) < 2 or statistics.median(values) <= 0:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def above_ceiling(ratio: Optional[float]) -> bool:
    """A ratio to a ceiling measured in the same run that is too high to be a result."""
    return ratio is not None and ratio > ABOVE_CEILING


def ratio_cell(ratio: Optional[float], fmt: str = "{:.0%}") -> str:
    """A table cell for `ratio` (ours / ceiling): the ratio, or "unreliable" above the ceiling."""
    if ratio is None:
        return "-"
    return f"unreliable ({fmt.format(ratio)})" if above_ceiling(ratio) else fmt.format(ratio)


class Host:
    """The host around one run: built before the run starts (its load is then others')."""

    def __init__(self):
        self.cores = os.cpu_count() or 1
        self.load_before = load_average()

    def verdict(self, spreads: Dict[str, Optional[float]], above: Sequence[str] = ()) -> dict:
        """Whether the run was noisy and why. `spreads`: row name -> spread of its repeats;
        `above`: rows whose ratio to their ceiling was above it (ABOVE_CEILING)."""
        load_after = load_average()
        reasons = []
        if self.load_before and self.load_before[0] > BUSY_LOAD_PER_CORE * self.cores:
            reasons.append(f"the host was busy before the run: load average {self.load_before[0]:g} on "
                           f"{self.cores} cores")
        if load_after and load_after[0] > CROWDED_LOAD_PER_CORE * self.cores:
            reasons.append(f"the host was crowded during the run: load average {load_after[0]:g} on "
                           f"{self.cores} cores at its end")
        measured = {k: v for k, v in spreads.items() if v is not None}
        wide = sorted((k for k, v in measured.items() if v > NOISY_SPREAD), key=lambda k: -measured[k])
        if wide:
            reasons.append(f"{len(wide)} of {len(measured)} timings' repeats spread more than {NOISY_SPREAD:.0%} "
                           f"((max - min) / median; widest: {wide[0]}, {measured[wide[0]]:.0%})")
        if above:
            reasons.append(f"{len(above)} ratios above their ceiling (marked unreliable): " + ", ".join(above[:5])
                           + (", ..." if len(above) > 5 else ""))
        return {"noisy": bool(reasons), "reasons": reasons, "cores": self.cores, "load_before": self.load_before,
                "load_after": load_after,
                "median_spread": round(statistics.median(measured.values()), 3) if measured else None,
                "max_spread": round(max(measured.values()), 3) if measured else None,
                "unreliable": list(above)}


def markdown(verdict: dict) -> List[str]:
    """The report's lines on the host: what was measured, and NOISY with why."""
    def load(values):
        return "/".join(f"{v:g}" for v in values) if values else "unknown"

    measured = (f"Host: {verdict['cores']} cores, load average (1/5/15 min) {load(verdict['load_before'])} before "
                f"the run, {load(verdict['load_after'])} after")
    if verdict["median_spread"] is not None:
        measured += (f"; repeats spread (max - min) / median: {verdict['median_spread']:.0%} median, "
                     f"{verdict['max_spread']:.0%} widest")
    if not verdict["noisy"]:
        return [measured + ". Quiet: the figures are results.", ""]
    return [measured + ".", "",
            "**NOISY HOST: these figures are not results.** " + "; ".join(verdict["reasons"]) + ". Run again on "
            "a quiet host (nothing else running) to publish them.", ""]
