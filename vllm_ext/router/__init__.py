"""The router in front of vLLM instances: holds the client streams, moves running requests
between instances (live migration), drains and balances. `python -m vllm_ext.router --help`."""

from .app import Router, Settings, build_app, main

__all__ = ["Router", "Settings", "build_app", "main"]
