"""The exceptions vllm-ext raises beside ValueError and TypeError (bad arguments, found before
any work): one root, `vllm_ext.Error`, so a caller can catch everything of ours at once."""

from typing import List, Optional, Sequence

__all__ = ["Error", "VllmExtError", "MigrationError", "ClosedError"]


class Error(Exception):
    """The root of vllm-ext's own exceptions."""


class VllmExtError(Error, RuntimeError):
    """A call into libvllm_ext failed; `status` is the vllm_ext_status code."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ClosedError(Error, RuntimeError):
    """The object was closed (a MigrationEndpoint after close()): nothing was done."""


class MigrationError(Error, RuntimeError):
    """A pull (or connect) failed: the peer died, stalled past the deadline, refused the
    request, failed authentication, or the data path broke. The source's cache was only read.

    `dst_block_ids`: the destination blocks whose contents are now undefined (any of them may
    have been written, in part or whole); None for connect and disconnect. `remote_type`: the
    name of the exception the source raised when it refused ("ValueError", ...), else None.
    The endpoint stays usable: the failed pair is dropped and rebuilt by the next pull.
    """

    def __init__(self, message: str, *, peer: Optional[str] = None,
                 dst_block_ids: Optional[Sequence[int]] = None,
                 remote_type: Optional[str] = None):
        if dst_block_ids is not None:
            message = (f"{message} [destination blocks left undefined (any may have been "
                       f"written): {_short_list(list(dst_block_ids))}]")
        super().__init__(message)
        self.peer = peer
        self.dst_block_ids = None if dst_block_ids is None else list(dst_block_ids)
        self.remote_type = remote_type


def _short_list(values: List[int], limit: int = 16) -> str:
    if len(values) <= limit:
        return str(values)
    return f"[{', '.join(map(str, values[:limit]))}, ... ({len(values)} ids)]"
