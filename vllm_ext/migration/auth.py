"""Where an endpoint's secret comes from, and the rule for which secret a pair uses.

A deployment sets one secret for all its instances: `VLLM_EXT_AUTH_SECRET` (the secret itself)
or `VLLM_EXT_AUTH_SECRET_FILE` (a file holding it), or the endpoint's `secret=` argument. Every
endpoint with it authenticates every peer with it, and its descriptor carries no secret.

Without one, each endpoint makes a random secret of its own, and its descriptor carries it: the
descriptor is then a capability (whoever holds it may pull from that endpoint; nobody else
can). A destination authenticates to a peer with the secret in the peer's descriptor when it
has one, else with its own deployment secret.
"""

import os
import secrets
from typing import Optional, Tuple, Union

from .protocol import MIN_SECRET_BYTES

ENV_SECRET = "VLLM_EXT_AUTH_SECRET"
ENV_SECRET_FILE = "VLLM_EXT_AUTH_SECRET_FILE"
_MAX_SECRET_BYTES = 4096


def _check(secret: bytes, where: str) -> bytes:
    if not MIN_SECRET_BYTES <= len(secret) <= _MAX_SECRET_BYTES:
        raise ValueError(f"{where}: a secret of {len(secret)} bytes; use {MIN_SECRET_BYTES} to "
                         f"{_MAX_SECRET_BYTES} bytes (e.g. 32 random bytes as hex)")
    return secret


def deployment_secret() -> Optional[bytes]:
    """The deployment's secret from the environment, or None; ValueError for a bad one (the
    message names the variable, never the value)."""
    value = os.environ.get(ENV_SECRET)
    if value:
        return _check(value.encode(), ENV_SECRET)
    path = os.environ.get(ENV_SECRET_FILE)
    if path:
        try:
            with open(path, "rb") as f:
                data = f.read(_MAX_SECRET_BYTES + 1)
        except OSError as e:
            raise ValueError(f"{ENV_SECRET_FILE}: cannot read {path!r}: {e.strerror}") from None
        return _check(data.rstrip(b"\r\n"), f"{ENV_SECRET_FILE} ({path!r})")
    return None


def endpoint_secret(secret: Union[None, str, bytes]) -> Tuple[bytes, bool]:
    """(the endpoint's secret, whether it is its own random one that its descriptor carries)."""
    if secret is not None:
        if isinstance(secret, str):
            secret = secret.encode()
        if not isinstance(secret, (bytes, bytearray)):
            raise TypeError(f"secret: expected bytes or str, got {type(secret).__name__}")
        return _check(bytes(secret), "secret"), False
    shared = deployment_secret()
    if shared is not None:
        return shared, False
    return secrets.token_bytes(32), True
