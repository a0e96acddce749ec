"""Which ids travel inside a kernel launch."""


import pytest
import torch


def test_public_ops_route_only_short_id_lists_to_inline_launches():
    """Python lists of up to 448 ids for a GPU copy travel in the launch; tensors, CPU copies
    and longer lists go through device memory. The ids' types are checked either way."""
    from vllm_ext import _lib, ops

    gpu = torch.device("cuda", 0)  # the routing is decided before anything touches a GPU
    assert ops._inline_ids(torch.tensor([1, 2]), "ids", 10, gpu, unique=False) is None
    assert ops._inline_ids([1, 2], "ids", 10, torch.device("cpu"), unique=False) is None
    long = list(range(_lib.MAX_INLINE_IDS + 1))
    assert ops._inline_ids(long, "ids", len(long), gpu, unique=True) is None
    with pytest.raises(TypeError, match="ids: True is not an int"):
        ops._inline_ids(long[:-1] + [True], "ids", len(long), gpu, unique=True)

