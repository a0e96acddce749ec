"""Writing a benchmark's report: `<bench>[-cpu].md`, `.json` and `.png` in one folder, each
JSON with the provenance of its run (git revision, the library's build record, the machine and
the command line), so a published result says what produced it."""

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "benchmarks" / "out"  # git-ignored; benchmarks/results/ holds published runs


def git_revision():
    """HEAD of the checkout, with "-dirty" when tracked files have changes; "unknown" without git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine():
    """What the run ran on: host, CPU, cores, GPUs, Python and torch."""
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "gpus": gpus, "python": platform.python_version(),
            "torch": torch.__version__}


def provenance():
    from vllm_ext import build_info

    return {"git_revision": git_revision(), "build_info": build_info(), "machine": machine(),
            "command": " ".join([Path(sys.executable).name, "-m", _module()] + sys.argv[1:]),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def _module():
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name.removesuffix(".__main__") if spec is not None else sys.argv[0]


def stem(bench, cpu):
    """The result name: `<bench>` for a GPU run, `<bench>-cpu` for a run on host caches."""
    return f"{bench}-cpu" if cpu else bench


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt, fig, path):
    """Writes `fig` as a PNG at `path` and frees it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def provenance_line(prov):
    """The Markdown's last line: what produced the run."""
    build = prov["build_info"]
    return (f"\nRun: `{prov['command']}` at git {prov['git_revision'][:12]}, vllm-ext {build.get('version')} "
            f"({build.get('target_device')}), {prov['machine']['host']}, {prov['date']}.\n")


def write(out_dir, name, data, markdown, plot=None, indent=1):
    """Writes name.json (data plus "provenance"), name.md (markdown plus a provenance line) and,
    when `plot(path)` draws one, name.png; logs the paths and returns the provenance."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    (out / f"{name}.json").write_text(json.dumps(dict(data, provenance=prov), indent=indent,
                                                 default=str) + "\n")
    (out / f"{name}.md").write_text(markdown + provenance_line(prov))
    plotted = bool(plot and plot(out / f"{name}.png"))
    print(f"wrote {out / name}.md, .json" + (", .png" if plotted else " (no plot: no matplotlib, or no data)"),
          file=sys.stderr, flush=True)
    return prov
