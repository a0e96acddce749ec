"""The migration report: the speed table with ratios to ceilings and to Llumnix, the fixed
costs, whether the host was noisy (common/noise.py), and the plot. Llumnix's published figures
are a GPU machine's: a run on host caches prints them but no ratio to them."""

from ..common import noise
from ..common.geometry import BLOCK_NBYTES, GIB
from ..common.report import pyplot, save_figure
from .llumnix import LLUMNIX

BIG_BLOCKS = 204  # 1.59 GiB
NCCL_TOGETHER = "NCCL send/recv, both sides start together (ceiling)"
RAY_CEILING = "Ray object store, actor to actor (ceiling)"
# (row, its ceiling, Llumnix's published row); a row may also have a second ceiling (EXTRA_RATIOS)
ROW_ORDER = [
    ("ipc (ours)", "peer copy GPU1->GPU0 (ceiling)", None),
    ("nccl (ours)", "NCCL send/recv (ceiling)", "nccl"),
    ("nccl (Llumnix-style baseline)", "NCCL send/recv (ceiling)", None),
    ("gloo (ours)", "gloo send/recv, one stream (ceiling)", "gloo"),
    ("gloo (Llumnix-style baseline)", "gloo send/recv, one stream (ceiling)", None),
    ("rayrpc (ours)", "Ray object store, actor to actor (ceiling)", "rayrpc"),
]
SAME_GPU_COPY = "same-GPU copy (ceiling)"  # ipc's ceiling when both processes share one GPU
EXTRA_RATIOS = {"nccl (ours)": (NCCL_TOGETHER, "nccl (ours) / start-together ceiling"),
                "ipc (ours)": (SAME_GPU_COPY, "ipc (ours) / same-GPU copy")}
CEILING_ROWS = ["peer copy GPU1->GPU0 (ceiling)", SAME_GPU_COPY, "NCCL send/recv (ceiling)", NCCL_TOGETHER,
                "gloo send/recv, one stream (ceiling)", "pinned H2D copy (ceiling)",
                "pinned D2H copy (ceiling)", "host memcpy (ceiling)", RAY_CEILING]


def size_label(n):
    return f"{n * 8} MiB" if n < 128 else f"{n * BLOCK_NBYTES / GIB:.2f} GiB"


def ratios_above_ceiling(report):
    """Rows and sizes whose ratio to their ceiling is above it (noise.ABOVE_CEILING)."""
    results, out = report["results"], []
    for ours, ceiling, _ in ROW_ORDER:
        for ceil in (ceiling, EXTRA_RATIOS.get(ours, (None,))[0]):
            for n, e in results.get(ours, {}).items():
                c = results.get(ceil, {}).get(n) if ceil else None
                if c and noise.above_ceiling(e["gibps"] / c["gibps"]):
                    out.append(f"{ours} at {size_label(int(n))} vs {ceil}")
    return out


def spreads(report):
    """Each row and size's spread of its samples (noise.spread)."""
    return {f"{row} at {size_label(int(n))}": noise.spread(e.get("samples_gibps", ()))
            for row, entries in report["results"].items() for n, e in entries.items()}


def markdown(report):
    results = report["results"]
    on_gpu = report["meta"].get("gpus", 1) > 0
    columns = [n for n in report["table_sizes"]
               if any(n in results.get(r, {}) for r in results)]
    head = "| migration_size | " + " | ".join(size_label(n) for n in columns) + " |"
    lines = [head, "|" + " --- |" * (len(columns) + 1)]

    def cell(row, n):
        e = results.get(row, {}).get(n)
        if e is None:
            return "-"
        return f"{e['gibps']:.2f}" + (f" ({e['wrong']} wrong)" if e.get("wrong") else "")

    for ours, ceiling, published in ROW_ORDER:
        if ours not in results:
            continue
        lines.append(f"| {ours} | " + " | ".join(cell(ours, n) for n in columns) + " |")
        for ceil, label in ((ceiling, f"{ours} / ceiling"), EXTRA_RATIOS.get(ours, (None, None))):
            if ceil and ceil in results:
                ratios = []
                for n in columns:
                    a, c = results[ours].get(n), results[ceil].get(n)
                    ratios.append(noise.ratio_cell(a["gibps"] / c["gibps"]) if a and c else "-")
                lines.append(f"| {label} | " + " | ".join(ratios) + " |")
        if published:
            pub = LLUMNIX[published]
            row = [f"{pub[n * 8]:.2f}" if n * 8 in pub else
                   (f"{pub[1628]:.2f}" if n == BIG_BLOCKS and 1628 in pub else "-")
                   for n in columns]
            lines.append(f"| Llumnix {published} (published, GPU) | " + " | ".join(row) + " |")
            if ours in results and on_gpu:  # a run on host caches is not comparable with Llumnix's GPUs
                ratio = [f"{results[ours][n]['gibps'] / pub[n * 8]:.1f}x"
                         if n in results[ours] and n * 8 in pub else "-" for n in columns]
                lines.append(f"| {published} ours / Llumnix | " + " | ".join(ratio) + " |")
    for ceiling in CEILING_ROWS:
        if ceiling in results:
            lines.append(f"| {ceiling} | " + " | ".join(cell(ceiling, n) for n in columns) + " |")
    lines.append("")
    lines.append("| backend | 1-block pull, 8 MiB: median (ms) | p99 (ms) "
                 "| control cost (1-block pull, 4 KiB): median (ms) | p99 (ms) "
                 "| first pull from a new peer (connect + 1 block, ms) "
                 "| connect() to another peer (ms) | first pull after connect() (ms) |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    keys = ("median_ms", "p99_ms", "tiny_median_ms", "tiny_p99_ms", "first_pull_ms", "connect_ms",
            "after_connect_ms")
    for backend, f in report["fixed"].items():
        cells = [(f"{f[k]:.1f}" if k in ("first_pull_ms", "connect_ms") else f"{f[k]:.3f}")
                 if k in f else "-" for k in keys]
        lines.append(f"| {backend} | " + " | ".join(cells) + " |")
    text = [f"# KV migration benchmark ({report['meta']['mode']})", "",
            "Speeds in GiB/s (Llumnix's \"GB/s\"): bytes / wall time of the destination's pull, "
            "min and max of the samples dropped, mean of the rest. Ceilings move the same bytes "
            "as one contiguous buffer in the same run; a ratio to one above "
            f"{noise.ABOVE_CEILING:.0%} is that ceiling's timing slowed, printed as unreliable.", ""]
    if not on_gpu:
        text += ["**Not comparable with GPU figures**: host caches on this machine's CPU. Llumnix's published rows "
                 "and the README's table (two H200s) are GPU machines'; no ratio "
                 "to them is printed here.", ""]
    if "host" in report:
        text += noise.markdown(report["host"])
    text += lines
    if report["notes"]:
        text += ["", "Notes:"] + [f"- {n}" for n in report["notes"]]
    return "\n".join(text) + "\n"



def plot(report, path):
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(10, 6))
    for row, entries in report["results"].items():
        sizes = sorted(entries)
        style = "--" if "ceiling" in row else ("-." if "baseline" in row else "-")
        ax.plot([n * 8 for n in sizes], [entries[n]["gibps"] for n in sizes], style,
                marker=".", label=row)
    for name, pub in LLUMNIX.items():
        xs = sorted(k for k in pub if k <= 600)
        ax.plot(xs, [pub[k] for k in xs], ":", label=f"Llumnix {name} (published)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("migration size (MiB)")
    ax.set_ylabel("GiB/s")
    ax.set_title(f"KV migration, {report['meta']['mode']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    save_figure(plt, fig, path)
    return True
