"""The raw transports of the ceilings and the Llumnix-style data path, both sides: NCCL and gloo
pairs set up under deadlines, and per-(layer, block, K/V) staging copies with one send/recv per
layer."""

import datetime

import torch

from ..common.runner import WAIT_S, sync


def nccl_join(cache, uid, rank):
    """A two-rank NCCL communicator, set up under a deadline (the backend's own helper)."""
    from vllm_ext.migration.base import Deadline
    from vllm_ext.migration.nccl import _join

    return _join(cache, [uid], rank, Deadline(WAIT_S))[0]


# ---- the Llumnix-style data path, both sides --------------------------------------------------
def baseline_send(kind, cache, ids, staging, send):
    """Per layer: one copy per (block, K/V) into staging, then one send of the layer."""
    for layer in cache.layers:
        for i, b in enumerate(ids):
            for k in range(2):
                staging[i, k].copy_(layer[k, b].view(-1), non_blocking=True)
        if kind == "gloo" and cache.device.type == "cuda":
            torch.cuda.current_stream(cache.device).synchronize()
        send(staging[:len(ids)])


def baseline_recv(kind, cache, ids, staging, recv):
    for layer in cache.layers:
        if kind == "gloo":
            sync(cache.device)  # the previous layer's copies out of the staging are done
        recv(staging[:len(ids)])
        for i, b in enumerate(ids):
            for k in range(2):
                layer[k, b].view(-1).copy_(staging[i, k], non_blocking=True)
    sync(cache.device)


def baseline_staging(kind, cache, max_blocks):
    chunk = cache.slice_nbytes // cache.dtype.itemsize
    pin = kind == "gloo" and cache.device.type == "cuda"
    device = cache.device if kind == "nccl" else "cpu"
    return torch.empty((max_blocks, 2, chunk), dtype=cache.dtype, device=device, pin_memory=pin)



def gloo_group(host, port, rank):
    from torch.distributed import ProcessGroupGloo, TCPStore

    store = TCPStore(host, port, 2, rank == 0, timeout=datetime.timedelta(seconds=WAIT_S),
                     wait_for_workers=False)
    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = datetime.timedelta(seconds=WAIT_S)  # every send/recv's deadline
    pg = ProcessGroupGloo(store, rank, 2, options)
    _KEEP_ALIVE.append(store)  # the group needs its store for its lifetime
    return pg


_KEEP_ALIVE = []
