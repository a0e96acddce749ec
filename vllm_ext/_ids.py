"""The value checks of block ids given as Python ints, shared by the ops and the migration
endpoints (no torch: the migration package imports it before torch is needed)."""


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
