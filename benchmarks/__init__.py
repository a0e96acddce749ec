"""vllm-ext's benchmarks. Run each from the repository root as a module:

    python -m benchmarks.kernels        # gather, scatter, peer copy against the copy ceilings
    python -m benchmarks.migration      # pulls between two processes with each backend
    python -m benchmarks.busy_source    # pulls whose source process is busy in Python

Each writes `<bench>[-cpu].{md,json,png}` to `--out` (default benchmarks/out/, which git
ignores); docs/benchmarks.md says how every figure is computed.
"""
