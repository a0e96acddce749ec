"""Process 1, the source: serves pulls from its endpoints and runs its half of the ceilings and
baselines on the destination's orders."""

import time

import torch

from ..common.geometry import make_cache, make_tiny_cache, row_checksums
from ..common.runner import spin_until, sync
from .baseline import baseline_send, baseline_staging, gloo_group, nccl_join


def source_main(conn, device, num_blocks, backends, options):
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from vllm_ext import ops
    from vllm_ext.migration import MigrationEndpoint

    cache = make_cache(device, num_blocks, seed=1)
    endpoints = {b: MigrationEndpoint(cache, backend=b, **options.get(b, {})) for b in backends}
    tiny = make_tiny_cache(device, seed=3)
    endpoints.update({f"{b}:tiny": MigrationEndpoint(tiny, backend=b, **options.get(b, {}))
                      for b in backends})
    conn.send({b: ep.descriptor() for b, ep in endpoints.items()})
    raw = {}
    staging = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            break
        if cmd == "checksum":
            conn.send(row_checksums(ops.gather_blocks(cache, args[0])))
        elif cmd == "nccl_join":
            from vllm_ext.migration import _nccl_lib

            lib = _nccl_lib.library()
            raw["nccl"] = (lib, nccl_join(cache, args[0], 1))
            raw["nccl_buf"] = torch.empty(args[1], dtype=torch.uint8, device=device)
            staging["nccl"] = baseline_staging("nccl", cache, args[2])
            conn.send("done")
        elif cmd == "gloo_join":
            raw["gloo"] = gloo_group(args[0], args[1], rank=1)
            raw["gloo_buf"] = torch.empty(args[2], dtype=torch.uint8)
            staging["gloo"] = baseline_staging("gloo", cache, args[3])
            conn.send("done")
        elif cmd == "raw_nccl":  # post the send, say so, then wait for it
            lib, comm = raw["nccl"]
            stream = torch.cuda.current_stream(device)
            lib.send(raw["nccl_buf"].data_ptr(), args[0], 0, comm, stream.cuda_stream)
            conn.send("posted")
            sync(device, "NCCL send (ceiling)")
        elif cmd == "raw_nccl_at":  # post the send at the agreed time, then wait for it
            lib, comm = raw["nccl"]
            stream = torch.cuda.current_stream(device)
            spin_until(args[1])
            late = time.monotonic() - args[1]  # > 0 when the order came after the agreed time
            lib.send(raw["nccl_buf"].data_ptr(), args[0], 0, comm, stream.cuda_stream)
            sync(device, "NCCL send (start-together ceiling)")
            conn.send(late)
        elif cmd == "raw_gloo":
            work = raw["gloo"].send([raw["gloo_buf"][:args[0]]], 0, 0)
            conn.send("posted")
            work.wait()
        elif cmd == "base_nccl":
            lib, comm = raw["nccl"]
            stream = torch.cuda.current_stream(device)

            def send(t, lib=lib, comm=comm, stream=stream):
                lib.send(t.data_ptr(), t.numel() * t.element_size(), 0, comm, stream.cuda_stream)

            baseline_send("nccl", cache, args[0], staging["nccl"], send)
            sync(device, "baseline NCCL sends")
        elif cmd == "base_gloo":
            pg = raw["gloo"]
            baseline_send("gloo", cache, args[0], staging["gloo"],
                          lambda t, pg=pg: pg.send([t], 0, 1).wait())
    for ep in endpoints.values():
        ep.close()
    if "nccl" in raw:
        raw["nccl"][0].abort(raw["nccl"][1])
    conn.send("bye")
