"""`python -m vllm_ext.info`: the build record, and each GPU with whether this build covers it.

Needs neither torch nor a GPU driver."""

import json
import sys

from . import _lib


def gpu_report():
    """One dict per GPU the driver shows: index, compute capability, covered by this build."""
    if not _lib.built_with_cuda():
        return []
    report = []
    for device in range(_lib.device_count()):
        entry = {"device": device}
        try:
            _lib.ensure_device(device)
            major, minor = _lib._checked_devices[device]
            entry.update(capability=f"{major}.{minor}", covered=True)
        except _lib.VllmExtError as e:
            entry.update(covered=False, error=str(e))
        report.append(entry)
    return report


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    info = _lib.build_info()
    gpus = gpu_report()
    if "--json" in argv:
        print(json.dumps({"build": info, "library": str(_lib.LIBRARY_PATH), "gpus": gpus}, indent=2))
        return 0
    print("vllm-ext build")
    for key, value in info.items():
        print(f"  {key:14s} {' '.join(value) if isinstance(value, list) else value}")
    print(f"  {'library':14s} {_lib.LIBRARY_PATH}")
    if not _lib.built_with_cuda():
        print("GPUs: not checked (CPU-only build)")
    elif not gpus:
        print("GPUs: none visible (no GPU or no driver)")
    for gpu in gpus:
        if gpu["covered"]:
            print(f"GPU {gpu['device']}: compute capability {gpu['capability']}, covered by this build")
        else:
            print(f"GPU {gpu['device']}: NOT covered: {gpu['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
