"""A model's KV cache groups, as the connector moves them (vLLM's hybrid KV cache manager).

vLLM gives a connector that implements SupportsHMA one group of layers per attention kind
(Gemma 3, gpt-oss: sliding-window layers beside full-attention ones), each with a block table of
its own over one pool of blocks: the layers of different groups share their tensors (one
tensor per layer slot, each group's layer there indexes it with that group's block ids). So a
block id names the same slot in every tensor, and moving block b of any group over all tensors
moves that group's KV (the worker's cache is the distinct tensors: worker.wrap_kv_caches).

The scheduler half keeps one flat list per request, the groups interleaved by position: the
i-th block of group g at [i * count + g]; every token-to-block count is multiplied by `count`.
A sliding-window (or chunked-local) group's table holds vLLM's null block (id 0) where a block
fell out of the window: a consumer pulls only the blocks its own table holds (not null), and a
producer's null where the consumer holds a block fails the load (`pairs`).

Live migration leases a running request's blocks, and vLLM frees a windowed group's blocks as
the window slides, without telling the connector: an instance of several groups (or a windowed
one) leases no running request's blocks, and says why; the router then moves such a request by
recomputing it on its destination. With `--disable-hybrid-kv-cache-manager` vLLM gives one
full-attention group, and live migration moves the KV as for any model."""

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

# vLLM's null block: the placeholder of a block a windowed group no longer holds (block id 0 of
# the pool on every supported release)
NULL_BLOCK = 0
# the kv_cache_spec classes the connector moves, by name (the classes' modules differ by release)
FULL = ("FullAttentionSpec", "MLAAttentionSpec")
WINDOWED = ("SlidingWindowSpec", "ChunkedLocalAttentionSpec")


@dataclasses.dataclass(frozen=True)
class Groups:
    """`kinds`: one (spec class name, window or attention chunk in tokens (0: none)) per group."""

    kinds: Tuple[Tuple[str, int], ...] = (("FullAttentionSpec", 0),)

    @property
    def count(self) -> int:
        return len(self.kinds)

    @property
    def windowed(self) -> bool:
        """Whether a group's table may hold null blocks (a sliding window or a chunked local one)."""
        return any(name in WINDOWED for name, _ in self.kinds)

    @property
    def plain(self) -> bool:
        """One full-attention group: what every release gives a connector without SupportsHMA."""
        return self.count == 1 and not self.windowed

    def fingerprint_fields(self) -> Dict[str, Any]:
        """What the layout check compares (nothing for one plain group: its fingerprint stays)."""
        return {} if self.plain else {"kv_cache_groups": [list(k) for k in self.kinds]}

    def live_migration_refusal(self) -> Optional[str]:
        """Why a request of this instance cannot move (None: it can)."""
        if self.plain:
            return None
        kinds = ", ".join(f"{name} ({n} tokens)" if n else name for name, n in self.kinds)
        return (f"this instance's KV cache groups ({kinds}): a running request's KV is leased only with one "
                "full-attention group (vLLM frees a sliding window's blocks while the request runs); start the "
                "instances with --disable-hybrid-kv-cache-manager to move such a model's KV")


ONE = Groups()  # one full-attention group: every release without SupportsHMA, every dense model


def of_config(kv_cache_config, block_size: int) -> Groups:
    """The groups of vLLM's kv_cache_config (None, on releases that give the connector none:
    one full-attention group). ValueError naming what the connector cannot move: a state cache
    (Mamba) or another kind of group, or groups of another block size than the engine's."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if not groups:
        return ONE
    kinds, sizes = [], set()
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        if name not in FULL + WINDOWED:
            raise ValueError(f"VllmExtConnector: KV cache group {i} is a {name} ({len(group.layer_names)} layers): "
                             f"the connector moves attention KV ({', '.join(FULL + WINDOWED)}); Mamba and other "
                             "state caches are not supported")
        window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None) or 0
        kinds.append((name, int(window) if name in WINDOWED else 0))
        sizes.add(spec.block_size)
    if sizes != {block_size}:
        raise ValueError(f"VllmExtConnector: the KV cache groups' block sizes {sorted(sizes)} differ from the "
                         f"engine's {block_size}: groups of several block sizes are not supported")
    return Groups(tuple(kinds))


def interleave(block_ids: Sequence[Sequence[int]]) -> List[int]:
    """One flat list of a request's per-group block tables (module docstring); a shorter table
    is padded with null blocks."""
    if len(block_ids) == 1:
        return list(block_ids[0])
    n = max((len(ids) for ids in block_ids), default=0)
    return [ids[i] if i < len(ids) else NULL_BLOCK for i in range(n) for ids in block_ids]


def pairs(src: Sequence[int], dst: Sequence[int], first: int, windowed: bool
          ) -> Tuple[List[int], List[int], Optional[List[int]]]:
    """The blocks a load moves, from the producer's `src` and this instance's `dst` (equal
    lengths, flat; src[0] is the lease's block `first`): (src ids, dst ids, their indices in the
    lease, or None when they are the lease's blocks from `first` on). Windowed: the blocks dst
    holds (not null); ValueError where src has a null there (the producer freed a block that
    this instance's window still needs)."""
    if not windowed:
        return list(src), list(dst), None
    keep = [i for i, d in enumerate(dst) if d != NULL_BLOCK]
    missing = [first + i for i in keep if src[i] == NULL_BLOCK]
    if missing:
        raise ValueError(f"the producer's lease no longer holds {len(missing)} block(s) this instance's sliding window "
                         f"needs (lease blocks {missing[:8]}): its prompt is computed here")
    return [src[i] for i in keep], [dst[i] for i in keep], [first + i for i in keep]
