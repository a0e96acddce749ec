#!/usr/bin/env python3
"""Checks, inside a server image, that vllm-ext's KV connector plugs into the image's vLLM.

Usage: check_connector.py [--name VllmExtConnector]

1. vLLM's general plugins load (what every vLLM process does at start) and the name is then in
   KVConnectorFactory's registry: the wheel's `vllm.general_plugins` entry point registered it.
2. The server's own argument parser takes `--kv-transfer-config` naming it, for each role, and
   the factory resolves that config to the connector class (imported, not constructed: that
   needs an engine).
No GPU needed. Exit status 1, with the reason, when a check fails.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import List, Optional

ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Where vLLM keeps the server's argument parser. It moves between releases; `vllm serve`'s own
# module imports it in 0.32 and 0.33.
ARG_PARSER_MODULES = (
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.common.cli_args",  # 0.33
    "vllm.entrypoints.launchers.cli_args",  # 0.32
    "vllm.entrypoints.openai.cli_args",  # up to 0.2x
)


def server_arg_parser():
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for name in ARG_PARSER_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "make_arg_parser"):
            return module.make_arg_parser(FlexibleArgumentParser())
    raise SystemExit(f"check_connector: no make_arg_parser in any of {ARG_PARSER_MODULES}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="VllmExtConnector")
    args = parser.parse_args(argv)

    import vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if args.name not in KVConnectorFactory._registry:
        print(f"check_connector: FAIL: {args.name} is not in vLLM {vllm.__version__}'s connector registry after "
              f"load_general_plugins() (is the wheel's vllm.general_plugins entry point installed?)", file=sys.stderr)
        return 1
    print(f"check_connector: {args.name} registered in vLLM {vllm.__version__}'s KVConnectorFactory")

    server = server_arg_parser()
    for role in ROLES:
        config_json = json.dumps({"kv_connector": args.name, "kv_role": role})
        cli = server.parse_args(["--model", "unused", "--kv-transfer-config", config_json])
        config = EngineArgs.from_cli_args(cli).kv_transfer_config
        cls = KVConnectorFactory.get_connector_class(config)
        print(f"check_connector: --kv-transfer-config '{config_json}' -> {cls.__module__}.{cls.__name__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
