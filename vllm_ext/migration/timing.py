"""Deadlines and the waits that honour them: every blocking wait of the migration package takes
the remaining time of one Deadline."""

import time
from typing import Callable, Optional

from ..errors import MigrationError

MAX_TIMEOUT_S = 1e6  # 11.6 days: "no timeout" in practice, and within every wait's range


def check_timeout(timeout, zero_ok: bool = False) -> None:
    """ValueError unless `timeout` is a number of seconds in (0, MAX_TIMEOUT_S] (with
    `zero_ok`, [0, MAX_TIMEOUT_S]); NaN and inf are refused."""
    if (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
            and (0 <= timeout if zero_ok else 0 < timeout) and timeout <= MAX_TIMEOUT_S):
        return
    if zero_ok:
        raise ValueError(f"timeout: must be 0 to {MAX_TIMEOUT_S:g} seconds, got {timeout!r}")
    raise ValueError(f"timeout: must be a positive number of seconds up to {MAX_TIMEOUT_S:g}, "
                     f"got {timeout!r}")


class Deadline:
    """An absolute point in time.monotonic(); every blocking wait takes its remaining time."""

    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float):
        check_timeout(timeout, zero_ok=True)
        self.timeout = float(timeout)
        self.at = time.monotonic() + self.timeout

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def expired(self) -> bool:
        return time.monotonic() >= self.at


def poll_until(done: Callable[[], bool], deadline: Deadline, what: str,
               check: Optional[Callable[[], None]] = None, spin_s: float = 2e-3,
               max_sleep_s: float = 1e-3) -> None:
    """Polls done() until true; MigrationError at the deadline. `check` runs on every poll and
    may raise (a peer's error report or exit). Spins for `spin_s`, then sleeps 2% of the time
    waited so far (at most max_sleep_s): a small pull pays no scheduler latency, a long one
    costs little CPU, and completion is noticed ~2% late."""
    start = time.monotonic()
    while True:
        if check is not None:
            check()
        if done():
            return
        now = time.monotonic()
        if now >= deadline.at:
            raise MigrationError(f"{what}: not complete at the deadline of {deadline.timeout:g} s")
        waited = now - start
        if waited > spin_s:
            time.sleep(min(max(0.02 * waited, 20e-6), max_sleep_s, max(deadline.at - now, 0)))
