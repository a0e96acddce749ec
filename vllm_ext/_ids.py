"""The one normaliser of block ids, shared by the ops and the migration endpoints: which inputs
are ids, and the range and distinctness checks (no torch import: the migration package uses it
before torch is needed)."""

import operator
from typing import List


def _is_tensor(value) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "dim")


def check_id_tensor(ids, name: str) -> None:
    """A tensor of ids: 1-D, of an integer dtype."""
    if ids.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor of ids, got shape {list(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or str(ids.dtype) == "torch.bool":
        raise TypeError(f"{name}: dtype {ids.dtype}, expected an integer dtype")


def index_of(value, name: str) -> int:
    """An id as a Python int: ints and integer scalars (numpy, 0-d integer tensors) only."""
    if isinstance(value, bool) or _is_tensor(value) and (
            value.dim() != 0 or value.dtype.is_floating_point or value.dtype.is_complex
            or str(value.dtype) == "torch.bool"):
        raise TypeError(f"{name}: {value!r} is not an int")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: {value!r} is not an int") from None


def id_values(block_ids, name: str) -> List[int]:
    """Python ints of ids given as a list (or other sequence) of ints and integer scalars, or a
    1-D integer tensor (any device). TypeError/ValueError naming `name` otherwise."""
    if type(block_ids) is list and all(type(v) is int for v in block_ids):  # the common case
        return block_ids
    if _is_tensor(block_ids):
        check_id_tensor(block_ids, name)
        return block_ids.tolist()
    if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__len__"):
        raise TypeError(f"{name}: expected a list or 1-D tensor of ints, got {type(block_ids).__name__}")
    return [index_of(v, name) for v in block_ids]


def check_id_values(values, name, num_blocks, unique):
    """Range (and, for destinations, distinctness) of ids given as Python ints: min, max and a
    set at C speed; the offending id is looked up only on failure."""
    if values and (min(values) < 0 or max(values) >= num_blocks):
        bad = next(v for v in values if not 0 <= v < num_blocks)
        raise ValueError(f"{name}: id {bad} out of range for a cache of {num_blocks} blocks")
    if unique and len(set(values)) != len(values):
        seen = set()
        dup = next(v for v in values if v in seen or seen.add(v))
        raise ValueError(f"{name}: duplicate id {dup}; destination ids must be distinct")


def block_id_list(block_ids, name: str, num_blocks: int, *, unique: bool) -> List[int]:
    """Checked ids as a new list of Python ints."""
    values = id_values(block_ids, name)
    check_id_values(values, name, num_blocks, unique)
    return list(values)
