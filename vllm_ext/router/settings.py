"""The fronts' settings, each with its default: the router's (Settings, docs/live-migration.md)
and the P/D proxy's (ProxySettings, docs/connector.md); what bounds both against clients and
backends is docs/security.md's. Each is read from a command-line flag (add_flags)."""

import argparse
import dataclasses

from . import live
from .placement import POLICIES, check_policy

MAX_STAGES_LIMIT = 16  # pre-copy stages of one migration (the setting and /migrate's "stages")
MAX_BODY_BYTES = 1 << 20  # a client's request body (a prompt of ~150k token ids or ~250k words): its parse and
# its legs' serialization hold the event loop in proportion to its size (docs/security.md)
MAX_EVENT_BYTES = 8 << 20  # one event, or one whole answer, of a backend (its prompt_token_ids included)


def _check_limits(settings) -> None:
    """The bounds both fronts share (docs/security.md)."""
    if settings.max_requests < 0:
        raise ValueError(f"max_requests: expected 0 (from the file-descriptor limit) or more, got "
                         f"{settings.max_requests!r}")
    for name in ("max_body_bytes", "max_event_bytes"):
        if getattr(settings, name) < 1024:
            raise ValueError(f"{name}: expected at least 1024 bytes, got {getattr(settings, name)!r}")


@dataclasses.dataclass
class Settings:
    """Every knob, with its default (docs/live-migration.md)."""

    policy: str = "least_loaded"  # where a new request goes
    timeout_s: float = 600.0  # a backend may stay silent this long
    balance: bool = False  # the load-balancing loop
    balance_interval_s: float = 0.5  # its period
    balance_threshold: int = 2  # migrate when the most and least loaded differ by this many requests
    max_migrations_per_request: int = 2
    min_remaining_tokens: int = 8  # a request this close to its max_tokens is left where it is
    max_stages: int = live.MAX_STAGES
    last_stage_max_blocks: int = live.LAST_STAGE_MAX_BLOCKS
    health_interval_s: float = 2.0  # /metrics of every instance (its health and load)
    health_timeout_s: float = 5.0  # one poll's; an instance is down after three failed polls in a row
    silent_s: float = 30.0  # an instance that answers no poll, and a stream of it that sends nothing, this
    # long (a partition that sends no FIN or RST): the stream is continued elsewhere
    max_destination_kv_usage: float = 0.9  # no migration to an instance whose KV cache is this full (or
    # that queues requests), as its last /metrics poll said: the resume would wait there
    max_requests: int = 0  # client requests at once, the rest get 503 + Retry-After (0: what the
    # file-descriptor limit leaves room for, http.default_max_requests)
    max_body_bytes: int = MAX_BODY_BYTES  # a larger request body gets 413
    max_event_bytes: int = MAX_EVENT_BYTES  # a backend's larger event or answer breaks its leg

    def __post_init__(self):
        check_policy(self.policy)
        _check_limits(self)
        for name in ("timeout_s", "balance_interval_s", "health_interval_s", "health_timeout_s", "silent_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
        if not 0 < self.max_destination_kv_usage <= 1:
            raise ValueError(f"max_destination_kv_usage: expected a fraction in (0, 1], got "
                             f"{self.max_destination_kv_usage!r}")
        if self.balance_threshold < 1:
            raise ValueError(f"balance_threshold: expected at least 1, got {self.balance_threshold!r}")
        if not 0 <= self.max_stages <= MAX_STAGES_LIMIT:
            raise ValueError(f"max_stages: expected an integer in [0, {MAX_STAGES_LIMIT}], got {self.max_stages!r}")
        for name in ("max_migrations_per_request", "min_remaining_tokens", "last_stage_max_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected 0 or more, got {getattr(self, name)!r}")


# The flag table: each setting's flag, its help and how it is given. A setting not named here
# has a flag of its own name (--balance-interval-s) that takes a value of its default's type.
FLAGS = {
    "policy": ("--policy", {"choices": POLICIES}),
    "timeout_s": ("--timeout", {"type": float, "metavar": "TIMEOUT", "help": "seconds a backend may stay silent"}),
    "balance": ("--balance", {"action": "store_true", "help": "migrate requests to balance load"}),
}


@dataclasses.dataclass
class ProxySettings:
    """The P/D proxy's knobs, with their defaults (docs/connector.md)."""

    policy: str = "round_robin"  # which prefill and decode server a request tries first
    timeout_s: float = 600.0  # a backend may stay silent this long
    first_byte_s: float = 30.0  # a backend that has not begun its answer after this long is asked
    # /health; one that does not answer that within health_timeout_s is given up (the next server, or 504)
    health_timeout_s: float = 5.0
    max_requests: int = 0  # as the router's
    max_body_bytes: int = MAX_BODY_BYTES
    max_event_bytes: int = MAX_EVENT_BYTES  # a backend's larger answer (not streamed) is not relayed: 502
    release_timeout_s: float = 5.0  # a release of the prefill server's lease after a failed decode leg
    # A served request's lease is released this long after its answer, in case its decode server did
    # not (it died before its own release went out): the lease serves no one else
    served_release_s: float = 10.0

    def __post_init__(self):
        check_policy(self.policy)
        _check_limits(self)
        for name in ("timeout_s", "first_byte_s", "health_timeout_s", "release_timeout_s", "served_release_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")


def add_flags(parser: argparse.ArgumentParser, kind=Settings) -> None:
    """One flag per setting of `kind` (Settings, ProxySettings), in the order of its fields,
    defaulting to its default."""
    defaults = kind()
    for field in dataclasses.fields(kind):
        flag, options = FLAGS.get(field.name, ("--" + field.name.replace("_", "-"), None))
        value = getattr(defaults, field.name)
        if options is None:
            options = {"type": type(value)}
        if options.get("action") != "store_true":
            options = dict(options, default=value)
        parser.add_argument(flag, dest=field.name, **options)


def from_flags(args: argparse.Namespace, kind=Settings):
    """The settings of `kind` the flags of add_flags gave (ValueError naming a bad one)."""
    return kind(**{field.name: getattr(args, field.name) for field in dataclasses.fields(kind)})
