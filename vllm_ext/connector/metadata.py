"""The messages between the connector's halves inside one instance (vLLM carries them):
scheduler -> worker each step (VllmExtMetadata), worker -> scheduler once at start-up
(VllmExtHandshake)."""

import dataclasses
from typing import Any, Dict, List, Optional

from . import check_vllm_version

check_vllm_version()  # before importing what another release may lack: one clear message

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # releases without worker -> scheduler metadata: leases count as served at once
    KVConnectorWorkerMetadata = None


@dataclasses.dataclass
class RecvJob:
    """Consumer: pull `src_block_ids` of the producer's lease into local `dst_block_ids`, then
    report `req_id` received. `error` set: fail the receive at once (bad kv_transfer_params)."""

    req_id: str
    lease: str = ""
    lease_host: str = ""
    lease_port: int = 0
    endpoint_id: str = ""
    fingerprint: str = ""
    first_block: int = 0  # index into the lease's blocks of src_block_ids[0]
    # the lease's blocks src_block_ids are, by index, where they are not first_block on (a
    # sliding-window group's blocks this instance does not hold are left out: groups.pairs)
    lease_index: Optional[List[int]] = None
    # what the lease must hold, its acquire's reply says: this request's own first num_tokens
    # tokens, by their prompt_hash (computed from the request's token ids, never from the params)
    num_tokens: int = 0
    prompt_hash: str = ""
    src_block_ids: List[int] = dataclasses.field(default_factory=list)
    dst_block_ids: List[int] = dataclasses.field(default_factory=list)
    error: Optional[str] = None
    # load before this step's forward (the request's tokens count as computed already): a
    # failure is reported as invalid blocks, which vLLM recomputes or fails by its policy
    sync: bool = False


@dataclasses.dataclass
class ReleaseJob:
    """Consumer: tell the producer to free a lease this instance will not pull (a full local
    hit, nothing left to load, a request refused or finished before it was scheduled)."""

    req_id: str
    lease: str
    lease_host: str
    lease_port: int


@dataclasses.dataclass
class VllmExtMetadata(KVConnectorMetadata):
    recvs: List[RecvJob] = dataclasses.field(default_factory=list)
    releases: List[ReleaseJob] = dataclasses.field(default_factory=list)
    # producer: leases made since the last step (lease id -> blocks: the worker grants them),
    # leases ended since (their grants are revoked), and requests whose blocks go back to vLLM
    # (their last lease ended): the worker reports them in finished_sending
    new_leases: Dict[str, List[int]] = dataclasses.field(default_factory=dict)
    # lease id -> how many of its first blocks the scheduler knows the digests of already (a
    # running request's earlier lease): the worker digests only the blocks after them
    digest_from: Dict[str, int] = dataclasses.field(default_factory=dict)
    ended_leases: List[str] = dataclasses.field(default_factory=list)
    finished_sending: List[str] = dataclasses.field(default_factory=list)
    # consumer: request id -> tokens it sampled before it moved here (a seeded request's first
    # step here: its random stream skips their draws; connector/sampling.py)
    skip_draws: Dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class VllmExtHandshake(KVConnectorHandshakeMetadata):
    descriptor: Dict[str, Any]  # the worker's MigrationEndpoint descriptor, as JSON-able fields
    fingerprint: str
    fingerprint_fields: Dict[str, Any]
    sampler: str = ""  # how seeded requests draw here (SeededStreams.kind; "": unknown)


if KVConnectorWorkerMetadata is not None:
    @dataclasses.dataclass
    class VllmExtWorkerMetadata(KVConnectorWorkerMetadata):
        """Worker -> scheduler, per step: the leases (ids) whose blocks the worker's endpoint
        now serves (granted), so that the lease channel hands a lease out only once its blocks
        can be pulled; and the requests whose loads before this step's forward (sync) ended,
        failed or not (a failure's blocks are in the same output's invalid_block_ids). Keyed by
        TP rank: vLLM aggregates every rank's worker metadata into the one the scheduler sees."""

        granted: Dict[int, List[str]] = dataclasses.field(default_factory=dict)  # TP rank -> lease ids
        # TP rank -> lease id -> one digest per block of its shard (verify_kv): what a consumer's
        # rank checks after its pull
        digests: Dict[int, Dict[str, List[int]]] = dataclasses.field(default_factory=dict)
        loaded: List[str] = dataclasses.field(default_factory=list)

        def aggregate(self, other):
            granted = {rank: list(ids) for rank, ids in self.granted.items()}
            for rank, ids in (getattr(other, "granted", None) or {}).items():
                granted.setdefault(rank, []).extend(ids)
            digests = {rank: dict(d) for rank, d in self.digests.items()}
            for rank, d in (getattr(other, "digests", None) or {}).items():
                digests.setdefault(rank, {}).update(d)
            return VllmExtWorkerMetadata(granted=granted, digests=digests,
                                         loaded=list(self.loaded) + list(getattr(other, "loaded", [])))
else:
    VllmExtWorkerMetadata = None
