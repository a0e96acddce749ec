"""The router: an OpenAI-compatible front for N vLLM instances running VllmExtConnector, which
holds every client stream and can move a running request to another instance while the
client's stream goes on (live.py), by hand, to drain an instance, or to
balance load.

    python -m vllm_ext.router --instance http://A:8100 http://B:8200 --lease A:8101 B:8201 --balance

Each instance runs `kv_role: kv_both` with a lease channel (`lease_port`) the router and the
other instances can reach, `kv_load_failure_policy: recompute`, and the deployment secret
(VLLM_EXT_AUTH_SECRET, also the router's). The admin API (/instances, /requests, /migrate,
/drain, /undrain) needs `Authorization: Bearer $VLLM_EXT_ROUTER_TOKEN`; without that variable
it is off. See docs/live-migration.md for every knob.
"""

import argparse
import logging

from aiohttp import web

from . import settings as settings_
from .app import build_app

logger = logging.getLogger("vllm_ext.router")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_ext.router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--instance", nargs="+", required=True, metavar="URL", help="vLLM servers")
    parser.add_argument("--lease", nargs="+", metavar="HOST:PORT",
                        help="each instance's lease channel, in --instance order ('-': none; its requests stay)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    settings_.add_flags(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    leases = None if args.lease is None else [None if a == "-" else a for a in args.lease]
    try:
        app = build_app(args.instance, leases, settings_.from_flags(args))
    except ValueError as e:
        parser.error(str(e))
    logger.info("router on http://%s:%d: %s%s", args.host, args.port, ", ".join(args.instance),
                " (balancing)" if args.balance else "")
    web.run_app(app, host=args.host, port=args.port, print=None)
