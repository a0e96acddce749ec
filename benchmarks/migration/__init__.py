"""Migration benchmark: pull KV blocks between two instance processes with each backend, next to
the hardware ceilings measured in the same run, a Llumnix-style baseline and Llumnix's
published CI figures.

Geometry (Qwen-7B under vLLM, as in Llumnix's CI): 32 layers, 32 KV heads, head size 128,
block size 16, bf16, flash layout: one block over all layers and K/V = 8 MiB. Sizes: 1..68
blocks (Llumnix's 8..544 MB columns) and 204 blocks (1.59 GiB).

Method (Llumnix's): speed = bytes / wall time of the destination's pull (control messages,
staging copies and syncs included); per size, `--samples` pulls of random block-id sets,
min and max dropped, mean of the rest. Units follow Llumnix's tables: "GB/s" there means GiB/s,
and so do ours (GiB = 2^30 bytes).

Rows:
  ours      MigrationEndpoint.pull with ipc / nccl / gloo (/ rayrpc on a host with Ray)
  baseline  Llumnix's data path rebuilt here: per-(layer, block, K/V) staging copies, one
            send/recv per layer (nccl: GPU staging; gloo: pinned host staging), one request
            message per pull
  ceiling   same bytes, one contiguous buffer, same run: peer copy GPU1 -> GPU0 (torch copy_),
            NCCL send/recv, gloo send/recv (one stream), pinned host <-> device copies; the
            sender is already posted when the receiver's clock starts (an NCCL sender then
            streams into NCCL's buffers ahead of the receiver: a head start no pull can have,
            since its source learns of the transfer from the request). Hence a second NCCL
            ceiling: both sides post at one agreed time, where the clock starts. rayrpc's:
            one Ray call returning one contiguous array, copied into the destination actor's
            memory
  Llumnix   the published CI figures (reference table, run 1) at the same sizes
Every pull is checked: after the samples of a size, the destination's blocks are compared
with the source's (row checksums); `wrong` counts mismatching blocks.
Fixed cost per pull: median and p99 of `--fixed-samples` 1-block pulls; and the control cost:
the same for a cache of 4 KiB blocks (one layer, one head of 64, block size 16), where moving
the bytes is free and what remains is the pull's own machinery (requests, launches, waits).
First pull from a new peer: the wall time of the first 1-block pull, which opens the control
connection and builds the pair (nccl: its communicators and staging; ipc: the mapped handles).
For nccl it is also the process's first NCCL communicator, so NCCL's one-time initialisation
is in it. connect() to another peer: the time `MigrationEndpoint.connect` takes to build the
pair with a second peer ahead of any pull (the 4 KiB cache's endpoint), and that peer's first
1-block pull after it.

    python -m benchmarks.migration [--out DIR] [--quick] [--samples N] [--time-limit S]
Nothing can hang: every wait has a deadline (pulls, NCCL and gloo set-up and transfers, the
pipe between the two processes), and the parent stops both processes at --time-limit (default
170 s with --quick), keeping the results of the stages that finished and naming the one that
did not.
With two GPUs: process 0 (destination) on cuda:0, process 1 (source) on cuda:1. Without two
GPUs: host caches, the CPU backends (gloo, and rayrpc when ray is importable), fewer sizes.
Outputs: migration[-cpu].md, .json, .png (when matplotlib is installed).

Modules: source.py and destination.py are the two processes (destination.py measures),
baseline.py the Llumnix-style data path, rayrpc.py the Ray part, llumnix.py the published
figures and statistic, report.py the tables and the plot, __main__.py the plan.
"""
