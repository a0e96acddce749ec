"""The router's settings, each with its default (docs/live-migration.md), and the command-line
flag each is read from (cli.py)."""

import argparse
import dataclasses

from . import live
from .placement import POLICIES, check_policy

MAX_STAGES_LIMIT = 16  # pre-copy stages of one migration (the setting and /migrate's "stages")


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

    def __post_init__(self):
        check_policy(self.policy)
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


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, in the order of Settings' fields, defaulting to its default."""
    defaults = Settings()
    for field in dataclasses.fields(Settings):
        flag, options = FLAGS.get(field.name, ("--" + field.name.replace("_", "-"), None))
        value = getattr(defaults, field.name)
        if options is None:
            options = {"type": type(value)}
        if options.get("action") != "store_true":
            options = dict(options, default=value)
        parser.add_argument(flag, dest=field.name, **options)


def from_flags(args: argparse.Namespace) -> Settings:
    """The settings the flags of add_flags gave (ValueError naming a bad one)."""
    return Settings(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Settings)})
