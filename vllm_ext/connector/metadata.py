"""The messages between the connector's halves inside one instance (vLLM carries them):
scheduler -> worker each step (VllmExtMetadata), worker -> scheduler once at start-up
(VllmExtHandshake)."""

import dataclasses
from typing import Any, Dict, List, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)


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
    src_block_ids: List[int] = dataclasses.field(default_factory=list)
    dst_block_ids: List[int] = dataclasses.field(default_factory=list)
    error: Optional[str] = None


@dataclasses.dataclass
class VllmExtMetadata(KVConnectorMetadata):
    recvs: List[RecvJob] = dataclasses.field(default_factory=list)
    # producer: leases made since the last step (request id -> blocks), and requests whose
    # lease ended (released or expired): the worker reports them in finished_sending
    new_leases: Dict[str, List[int]] = dataclasses.field(default_factory=dict)
    finished_sending: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class VllmExtHandshake(KVConnectorHandshakeMetadata):
    descriptor: Dict[str, Any]  # the worker's MigrationEndpoint descriptor, as JSON-able fields
    fingerprint: str
    fingerprint_fields: Dict[str, Any]
