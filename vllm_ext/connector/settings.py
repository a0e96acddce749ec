"""VllmExtConnector's settings: every key of `kv_connector_extra_config` the connector reads,
parsed and checked in one place when the connector is built (docs/connector.md lists them).

An unknown key is refused with the closest known one ("lease_prot": did you mean "lease_port"?),
and every value's type and range is checked with the key and what it should be, so a typo fails
the start-up at once instead of leaving a healthy server on other settings. Every problem of a
config is named in one error.
"""

import dataclasses
import difflib
import inspect
from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

WHERE = "kv_connector_extra_config"
DEFAULT_HOST = "127.0.0.1"
LOAD_MODES = ("auto", "sync", "async")
# A sync load holds the decode instance's whole step (every running request waits): on a GPU its
# deadline is this, or pull_timeout_s if shorter. An ipc pull takes milliseconds and the
# producer's answer one of its steps; past this a busy producer costs less recomputed.
SYNC_LOAD_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """The connector's settings, defaults resolved (see the module docstring).

    backend            migration backend; None: ipc on GPU, gloo on CPU (chosen by the worker)
    backend_options    that backend's options (and the endpoint's `port`), read-only
    endpoint_host      address the MigrationEndpoint binds
    lease_host         address the producer's lease channel binds and advertises
    lease_port         its port (0: any free port)
    lease_s            how long a producer holds a finished request's blocks
    max_leased_fraction  the share of a producer's cache that P/D leases may hold together
    pull_timeout_s     deadline of one pull on the consumer
    connect_to         "host:port" of the producers' lease channels to connect to at start-up
    allowed_producers  the only lease channels a consumer dials (default: connect_to)
    verify_kv          producers digest leased blocks, consumers check their pulls
    load_whole_blocks  load only whole blocks before the last token (default: on CPU)
    load               when a consumer loads a P/D request's KV: "auto" (inside the step that
                       schedules it when the producer is on this host's device memory (ipc) and a
                       failed load is safe to recompute in place; else asynchronously), "sync",
                       "async" (scheduler/consumer.py applies it)
    sync_load_timeout_s  deadline of a sync load (it holds the whole step); default
                       min(SYNC_LOAD_TIMEOUT_S, pull_timeout_s) on GPU, pull_timeout_s on CPU
    """

    backend: Optional[str] = None
    backend_options: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    endpoint_host: str = DEFAULT_HOST
    lease_host: str = DEFAULT_HOST
    lease_port: int = 0
    lease_s: float = 30.0
    max_leased_fraction: float = 0.5
    pull_timeout_s: float = 10.0
    connect_to: Tuple[str, ...] = ()
    allowed_producers: Tuple[str, ...] = ()
    verify_kv: bool = True
    load_whole_blocks: bool = True
    load: str = "auto"
    sync_load_timeout_s: float = SYNC_LOAD_TIMEOUT_S

    @classmethod
    def parse(cls, extra: Optional[Mapping[str, Any]], *, device_type: str = "cpu") -> "ConnectorSettings":
        """The settings of `extra` (a kv_connector_extra_config; None: all defaults) on an
        instance of `device_type` ("cpu", "cuda", ...). ValueError naming every unknown key (with
        the closest known one) and every value of the wrong type or out of range."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ValueError(f"{WHERE}: expected a JSON object of settings, got {extra!r}")
        problems: List[str] = []
        for key in extra:
            if key not in _KEYS:
                problems.append(_unknown(f"{WHERE}", "key", key, _KEYS))
        values: Dict[str, Any] = {}
        for key, (check, expected) in _KEYS.items():
            if key not in extra:
                continue
            try:
                values[key] = check(extra[key])
            except _Refused as e:
                problems.append(f"{WHERE}.{key}: expected {e.expected or expected}, got {extra[key]!r}")
        if "backend_options" in values:
            backend = values.get("backend") or ("ipc" if device_type == "cuda" else "gloo")
            problems += _check_backend_options(backend, values["backend_options"])
            values["backend_options"] = MappingProxyType(dict(values["backend_options"]))
        if problems:
            if len(problems) == 1:
                raise ValueError(f"VllmExtConnector: {problems[0]}")
            raise ValueError(f"VllmExtConnector: {len(problems)} problems in {WHERE}:\n  " + "\n  ".join(problems))
        values.setdefault("allowed_producers", values.get("connect_to", ()))
        values.setdefault("load_whole_blocks", device_type == "cpu")
        # on CPU the engine's own steps take seconds on a busy host and a gloo pull is as fast as
        # the host: a sync load (a live migration's resume) keeps the pull's deadline there
        pull_timeout_s = values.get("pull_timeout_s", cls.pull_timeout_s)
        values.setdefault("sync_load_timeout_s", pull_timeout_s if device_type == "cpu"
                          else min(SYNC_LOAD_TIMEOUT_S, pull_timeout_s))
        return cls(**values)


class _Refused(Exception):
    def __init__(self, expected: str = ""):
        super().__init__(expected)
        self.expected = expected


def _unknown(where: str, what: str, name, known) -> str:
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    hint = f'did you mean "{close[0]}"?' if close else "known: " + ", ".join(known)
    return f'{where}: unknown {what} "{name}" ({hint})'


def _integer(low: int, high: int) -> Callable[[Any], int]:
    def check(value):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise _Refused()
        return value
    return check


def _number(low: float, high: float) -> Callable[[Any], float]:
    """A number in (low, high]."""
    def check(value):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not low < value <= high:
            raise _Refused()
        return float(value)
    return check


def _flag(value) -> bool:
    if not isinstance(value, bool):  # "false" or 0 would read as a choice the user did not make
        raise _Refused()
    return value


def _host(value) -> str:
    if not isinstance(value, str) or not value or any(c in value for c in "/ \t@"):
        raise _Refused()
    return value


def _address(value) -> str:
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not host or any(c in host for c in "/ \t@") or not port.isdigit() or not 0 < int(port) < 65536:
        raise _Refused()
    return f"{host}:{int(port)}"


def _addresses(value) -> Tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise _Refused()
    return tuple(_address(a) for a in value)


def _backend(value) -> str:
    from ..migration.registry import BACKEND_NAMES

    if value not in BACKEND_NAMES:
        raise _Refused("one of " + ", ".join(f'"{n}"' for n in BACKEND_NAMES))
    return value


def _load_mode(value) -> str:
    if value not in LOAD_MODES:
        raise _Refused("one of " + ", ".join(f'"{m}"' for m in LOAD_MODES))
    return value


def _options(value) -> dict:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _Refused()
    return dict(value)


# key -> (check, what a value should be)
_KEYS: Dict[str, Tuple[Callable[[Any], Any], str]] = {
    "backend": (_backend, "a migration backend"),
    "backend_options": (_options, "an object of the backend's options"),
    "endpoint_host": (_host, "a host name or IP address"),
    "lease_host": (_host, "a host name or IP address"),
    "lease_port": (_integer(0, 65535), "an integer port 0-65535 (0: any free port)"),
    "lease_s": (_number(0, 3600), "seconds in (0, 3600]"),
    "max_leased_fraction": (_number(0, 1), "a fraction of the KV cache in (0, 1]"),
    "pull_timeout_s": (_number(0, 600), "seconds in (0, 600]"),
    "connect_to": (_addresses, "a list of 'host:port' (port 1-65535)"),
    "allowed_producers": (_addresses, "a list of 'host:port' (port 1-65535)"),
    "verify_kv": (_flag, "true or false"),
    "load_whole_blocks": (_flag, "true or false"),
    "load": (_load_mode, "a load mode"),
    "sync_load_timeout_s": (_number(0, 600), "seconds in (0, 600]"),
}
KNOWN_KEYS = tuple(_KEYS)

# what the MigrationEndpoint takes besides the backend's own options (the rest it sets itself)
_ENDPOINT_OPTIONS = ("port", "tls")


def _check_backend_options(backend: str, options: Mapping[str, Any]) -> List[str]:
    """Unknown option names of `backend` (its constructor's keywords, and the endpoint's)."""
    from ..migration.registry import get_backend_class

    try:
        init = get_backend_class(backend).__init__
    except ImportError:  # the backend's own start-up names what is missing
        return []
    params = inspect.signature(init).parameters
    known = [n for n, p in params.items() if n not in ("self", "context")
             and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)] + list(_ENDPOINT_OPTIONS)
    return [_unknown(f"{WHERE}.backend_options", f"{backend} backend option", name, known)
            for name in options if name not in known]
