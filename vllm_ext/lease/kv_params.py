"""What prefill and decode instances exchange through `kv_transfer_params`, and the layout
fingerprint they must agree on. Imports neither vllm nor torch.

Version history (PROTOCOL, carried as `kv_transfer_params["vllm_ext"]`):
  1: first version: lease id, block ids, token count, prompt hash, fingerprint, lease address.
  2: `migration_id` (a router's id of a request it may migrate; see router/live.py) and
     `sync_load` (load before this step's forward instead of asynchronously: a migration's
     resume, whose few blocks cost less than the steps an asynchronous load waits).
  3: the prompt hash is sha256 of the ids as little-endian int64 (15x faster than of their JSON:
     both schedulers hash a migrated request's whole sequence in their steps).
  4: `sampled_tokens` (a resumed request's output so far, now the end of its prompt: a seeded
     request's random stream skips their draws; vllm_ext/connector/sampling.py).

A producer answers a finished `do_remote_decode` request with:

    {"do_remote_prefill": true, "do_remote_decode": false, "vllm_ext": 4,
     "remote_lease": "<32 hex>",            # external id of the lease (never vLLM's request id)
     "remote_block_ids": [int, ...],         # the producer's blocks, in token order
     "remote_num_tokens": int,               # tokens whose KV those blocks hold
     "remote_prompt_hash": "<64 hex>",       # sha256 of those tokens' ids (int64, little endian)
     "remote_fingerprint": "<32 hex>",       # layout_fingerprint() of the producer's cache
     "remote_endpoint": {"lease_host": str, "lease_port": int, "endpoint_id": str,
                         "backend": str},
     "remote_lease_s": float}                # how long the producer holds the blocks

None of it is a credential: pulling needs the deployment secret as well. RemoteKV is the one
codec: RemoteKV.parse refuses a missing, mistyped or unexpected field, naming it, and
RemoteKV.to_params writes what the producer answers (and what a router sends a migration's
destination: `migration_id` and `sync_load` then too). The messages between instances (describe,
acquire, release) are typed messages of messages.py.
"""

import array
import dataclasses
import hashlib
import json
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..migration.protocol import geometry_mismatch

PROTOCOL = 4
MAX_REMOTE_BLOCKS = 1 << 20
# The vllm_xargs (SamplingParams.extra_args) keys of a live migration's resumed leg, written by the
# router (router/legs.py) and read in the destination's engine (connector/detokenize.py): the
# client's text before the leg (for stop strings that straddle the hand-off), and how many of the
# leg's prompt's last tokens were generated (its logprobs complete a character begun before it).
XARG_STOP_PREFIX = "vllm_ext_stop_prefix"
XARG_GENERATED = "vllm_ext_generated"
_HEX = re.compile(r"^[0-9a-f]+$")


class ParamsError(ValueError):
    """One field of a request's kv_transfer_params is missing or wrong (the message names it)."""


_FIELDS = ("do_remote_prefill", "do_remote_decode", "vllm_ext", "remote_lease", "remote_block_ids",
           "remote_num_tokens", "remote_prompt_hash", "remote_fingerprint", "remote_endpoint", "remote_lease_s",
           "migration_id", "sync_load", "sampled_tokens")
_ENDPOINT_FIELDS = ("lease_host", "lease_port", "endpoint_id", "backend")
# What vLLM itself adds to kv_transfer_params on their way (its scheduler: the producer's cached
# prompt tokens; its chat endpoint: pre-tokenized prompts); any other key is refused.
_VLLM_FIELDS = ("remote_prefill_cached_tokens", "prompt_token_ids")


def _no_extra(params: Dict[str, Any], allowed, where: str) -> None:
    extra = sorted(str(k)[:40] for k in params if k not in allowed)
    if extra:
        raise ParamsError(f"{where}: unexpected field(s) {', '.join(extra)}")


@dataclasses.dataclass(frozen=True)
class RemoteKV:
    """A decode request's parsed kv_transfer_params (RemoteKV.parse)."""

    lease: str
    block_ids: List[int]
    num_tokens: int
    prompt_hash: str
    fingerprint: str
    lease_host: str
    lease_port: int
    endpoint_id: str
    backend: str
    lease_s: float
    sync: bool = False  # load before the step's forward (`sync_load`)
    migration_id: Optional[str] = None  # a router's id of the request (it may move again)

    @classmethod
    def parse(cls, params: Any, block_size: int, groups: int = 1) -> "RemoteKV":
        return parse_remote_params(params, block_size, groups)

    def to_params(self) -> Dict[str, Any]:
        """The kv_transfer_params that name this lease (parse's inverse)."""
        params = {
            "do_remote_prefill": True, "do_remote_decode": False, "vllm_ext": PROTOCOL,
            "remote_lease": self.lease, "remote_block_ids": list(self.block_ids), "remote_num_tokens": self.num_tokens,
            "remote_prompt_hash": self.prompt_hash, "remote_fingerprint": self.fingerprint,
            "remote_endpoint": {"lease_host": self.lease_host, "lease_port": self.lease_port,
                                "endpoint_id": self.endpoint_id, "backend": self.backend},
            "remote_lease_s": self.lease_s,
        }
        if self.migration_id is not None:
            params["migration_id"] = self.migration_id
        if self.sync:
            params["sync_load"] = True
        return params


def prompt_hash(token_ids: Sequence[int]) -> str:
    """sha256 of the token ids as little-endian int64, in hex."""
    ids = array.array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return hashlib.sha256(ids.tobytes()).hexdigest()


def _field(params: Dict[str, Any], name: str, kind, where: str = "kv_transfer_params"):
    if name not in params:
        raise ParamsError(f"{where}.{name}: missing")
    value = params[name]
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ParamsError(f"{where}.{name}: expected {getattr(kind, '__name__', 'number')}, "
                          f"got {type(value).__name__} {str(value)[:60]!r}")
    return value


def _hex(params, name, length: Optional[int] = None, where="kv_transfer_params") -> str:
    value = _field(params, name, str, where)
    if not _HEX.match(value) or (length is not None and len(value) != length):
        want = f"{length} hex digits" if length else "hex digits"
        raise ParamsError(f"{where}.{name}: expected {want}, got {value[:80]!r}")
    return value


def parse_remote_params(params: Any, block_size: int, groups: int = 1) -> RemoteKV:
    """Checks every field a decode instance reads; ParamsError naming the first bad one.
    `groups`: the KV cache groups of the instance (its block ids interleave them: a block of each
    group per `block_size` tokens, connector/groups.py)."""
    if not isinstance(params, dict):
        raise ParamsError(f"kv_transfer_params: expected an object, got {type(params).__name__}")
    _no_extra(params, _FIELDS + _VLLM_FIELDS, "kv_transfer_params")
    version = _field(params, "vllm_ext", int)
    if version != PROTOCOL:
        raise ParamsError(f"kv_transfer_params.vllm_ext: protocol {version}, this instance speaks {PROTOCOL} "
                          "(mixed vllm-ext versions: upgrade both)")
    lease = _hex(params, "remote_lease", 32)
    block_ids = _field(params, "remote_block_ids", list)
    if not block_ids or len(block_ids) > MAX_REMOTE_BLOCKS:
        raise ParamsError(f"kv_transfer_params.remote_block_ids: expected 1 to {MAX_REMOTE_BLOCKS} ids, "
                          f"got {len(block_ids)}")
    for i, b in enumerate(block_ids):
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise ParamsError(f"kv_transfer_params.remote_block_ids[{i}]: expected a non-negative int, got {b!r}")
    num_tokens = _field(params, "remote_num_tokens", int)
    blocks_needed = (-(-num_tokens // block_size) if num_tokens > 0 else 0) * groups
    if num_tokens <= 0 or blocks_needed != len(block_ids):
        of = f"blocks of {block_size}" + (f" in each of {groups} KV cache groups" if groups > 1 else "")
        raise ParamsError(f"kv_transfer_params.remote_num_tokens: {num_tokens} tokens need "
                          f"{blocks_needed} {of}, remote_block_ids has {len(block_ids)}")
    hash_ = _hex(params, "remote_prompt_hash", 64)
    fingerprint = _hex(params, "remote_fingerprint", 32)
    endpoint = _field(params, "remote_endpoint", dict)
    where = "kv_transfer_params.remote_endpoint"
    _no_extra(endpoint, _ENDPOINT_FIELDS, where)
    host = _field(endpoint, "lease_host", str, where)
    if not host or len(host) > 255:
        raise ParamsError(f"{where}.lease_host: expected a host name, got {host[:80]!r}")
    port = _field(endpoint, "lease_port", int, where)
    if not 0 < port < 65536:
        raise ParamsError(f"{where}.lease_port: {port} is not a TCP port")
    endpoint_id = _hex(endpoint, "endpoint_id", None, where)
    backend = _field(endpoint, "backend", str, where)
    lease_s = _field(params, "remote_lease_s", (int, float))
    if isinstance(lease_s, bool) or not 0 < lease_s <= 1e6:
        raise ParamsError(f"kv_transfer_params.remote_lease_s: expected seconds > 0, got {lease_s!r}")
    sync = params.get("sync_load", False)
    if not isinstance(sync, bool):
        raise ParamsError(f"kv_transfer_params.sync_load: expected bool, got {type(sync).__name__}")
    return RemoteKV(lease=lease, block_ids=list(block_ids), num_tokens=num_tokens, prompt_hash=hash_,
                    fingerprint=fingerprint, lease_host=host, lease_port=port, endpoint_id=endpoint_id,
                    backend=backend, lease_s=lease_s, sync=sync, migration_id=migration_id_of(params))


def migration_id_of(params: Any) -> Optional[str]:
    """The well-formed `migration_id` (32 hex digits) of kv_transfer_params, else None."""
    if not isinstance(params, dict):
        return None
    value = params.get("migration_id")
    if isinstance(value, str) and len(value) == 32 and _HEX.match(value):
        return value
    return None


def sampled_tokens_of(params: Any, num_tokens: int) -> int:
    """kv_transfer_params' `sampled_tokens` (0 when absent) of a request of `num_tokens` tokens:
    at most num_tokens - 1 of them can have been sampled (ParamsError naming the field)."""
    if not isinstance(params, dict) or "sampled_tokens" not in params:
        return 0
    value = _field(params, "sampled_tokens", int)
    if not 0 <= value < num_tokens:
        raise ParamsError(f"kv_transfer_params.sampled_tokens: expected 0 to {num_tokens - 1} (the request has "
                          f"{num_tokens} tokens), got {value}")
    return value


def lease_ref(params: Any):
    """(lease, lease_host, lease_port) of kv_transfer_params whose lease fields are well formed
    (the rest may be refused), else None: what a consumer needs to release a lease it will not
    pull."""
    try:
        if not isinstance(params, dict):
            return None
        lease = _hex(params, "remote_lease", 32)
        endpoint = _field(params, "remote_endpoint", dict)
        host = _field(endpoint, "lease_host", str)
        port = _field(endpoint, "lease_port", int)
    except ParamsError:
        return None
    if not host or len(host) > 255 or not 0 < port < 65536:
        return None
    return lease, host, port


def layout_fingerprint(fields: Dict[str, Any]) -> str:
    """32 hex digits over what two instances must share to exchange blocks."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def fingerprint_mismatch(mine: Dict[str, Any], theirs: Dict[str, Any]) -> Optional[str]:
    """None when equal, else which fields differ, with both values."""
    return geometry_mismatch(mine, theirs, "at the producer")


# What a TP rank's fingerprint fields say of its own shard alone (the instance's fingerprint leaves
# them out, so that instances of different TP sizes over one model agree on it).
SHARD_FIELDS = ("tp_size", "layer_shape")


def instance_fields(fields: Dict[str, Any]) -> Dict[str, Any]:
    """A rank's fingerprint fields without what only its shard says: no TP size, and its layer
    shape less the heads (`head_shape`); the model's KV head count is a field of its own
    (`num_kv_heads`)."""
    common = {k: v for k, v in fields.items() if k not in SHARD_FIELDS}
    shape = fields.get("layer_shape")
    common["head_shape"] = list(shape)[1:] if isinstance(shape, list) else shape
    return common


def instance_fingerprint(fields: Dict[str, Any]) -> str:
    """The fingerprint kv_transfer_params carry (instance_fields'): instances of different TP
    sizes over one model and layout agree on it."""
    return layout_fingerprint(instance_fields(fields))


def source_ranks(rank: int, ranks: int, producer_ranks: int) -> range:
    """The producer's TP ranks (of `producer_ranks`) that hold KV heads of consumer rank `rank`
    of `ranks`, the heads split evenly over the ranks on both sides: one rank of the same number
    at equal sizes; several when the producer has more ranks; one holding more heads when fewer."""
    if not 0 <= rank < ranks or producer_ranks < 1:
        raise ValueError(f"rank {rank} of {ranks}, producer ranks {producer_ranks}: out of range")
    return range(rank * producer_ranks // ranks, -(-(rank + 1) * producer_ranks // ranks))


def shard_plan(num_kv_heads: int, rank: int, ranks: int, producer_ranks: int) -> List[Tuple[int, int, int, int]]:
    """How consumer rank `rank` of `ranks` gathers its KV heads from a producer of
    `producer_ranks` ranks: (producer rank, first head in that rank's shard, first head in this
    rank's shard, head count) per producer rank of source_ranks(). ValueError when the model's
    `num_kv_heads` do not split evenly over either side (vLLM then replicates heads across ranks)."""
    for name, n in (("this instance", ranks), ("the producer", producer_ranks)):
        if num_kv_heads % n:
            raise ValueError(f"{num_kv_heads} KV heads do not split evenly over {name}'s {n} tensor-parallel ranks "
                             "(vLLM replicates them): P and D at different TP sizes need an even split on both")
    mine, theirs = num_kv_heads // ranks, num_kv_heads // producer_ranks
    lo, hi = rank * mine, (rank + 1) * mine
    plan = []
    for q in source_ranks(rank, ranks, producer_ranks):
        a, b = max(lo, q * theirs), min(hi, (q + 1) * theirs)
        plan.append((q, a - q * theirs, a - lo, b - a))
    return plan
