"""What each topology runs: vLLM OpenAI servers, the router and the P/D proxy, on 127.0.0.1.

The child processes come from vllm_ext.fleet, as the end-to-end tests' do: a free port each, a
process group each (stopped as a group, so nothing outlives the benchmark), /health waits with
the log's tail on failure, and the environment that shares a CPU between servers
(VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE=1) and sets the deployment secret the
connector needs.

Topologies, in the order they run (instances of one phase serve all its topologies):
  single   one instance                                        phase "plain"
  router   two instances behind `python -m vllm_ext.router`   phase "plain"
  balance  the same with `--balance` (live migration)          phase "balance"
  pd       prefill + decode via VllmExtConnector and `python -m vllm_ext.proxy`   phase "pd"
"""

import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from vllm_ext import fleet

TITLES = {"single": "one instance", "router": "two instances, router",
          "balance": "two instances, router + migration", "pd": "prefill + decode (connector)"}
PHASES = {"single": "plain", "router": "plain", "balance": "balance", "pd": "pd"}
TOPOLOGIES = tuple(TITLES)
# Where servers spin on every core (a CPU host), the load generator runs ahead of them, as on a
# core of its own: a starved client would stamp tokens late. The router and proxy are part of
# what is measured and compete like the servers.
AHEAD_OF_SERVERS = ["nice", "-n", "-10"]


@dataclass
class ServerConfig:
    """How every instance of a run is started."""
    model_dir: Path
    served_model_name: str
    args: List[str]  # vLLM flags after fleet.start_vllm's own (a repeated flag: the last one wins)
    env: Dict[str, str] = field(default_factory=dict)
    sequential: bool = False  # one GPU: vLLM sizes its cache from the memory free at start-up
    log_dir: Path = Path(".")
    client_prefix: List[str] = field(default_factory=list)  # before the load generator's command


def unavailable(topology: str) -> Optional[str]:
    """Why `topology` cannot run at this revision, or None."""
    if topology in ("router", "balance") and importlib.util.find_spec("vllm_ext.router") is None:
        return "router not landed (no vllm_ext.router at this revision)"
    if topology == "balance" and "--balance" not in _router_help():
        return "live migration not landed (vllm_ext.router has no --balance)"
    return None


def _router_help() -> str:
    out = subprocess.run([sys.executable, "-m", "vllm_ext.router", "--help"], capture_output=True, text=True,
                         timeout=120)
    return out.stdout


def start_instances(cfg: ServerConfig, specs: List[dict]) -> List["fleet.Process"]:
    """Starts one vLLM server per spec ({"name", "core", "kv_config"}) and waits for each /health;
    on failure stops those started and raises."""
    started = []
    try:
        for spec in specs:
            started.append(fleet.start_vllm(
                spec["name"], cfg.model_dir, cfg.log_dir, core=spec["core"], kv_config=spec.get("kv_config"),
                extra_args=["--served-model-name", cfg.served_model_name, "--load-format", "dummy",
                            "--no-enable-prefix-caching", *cfg.args],
                extra_env=cfg.env, tokenizer=True))
            if cfg.sequential:
                started[-1].wait_healthy()
        for server in started:
            server.wait_healthy()
        return started
    except BaseException:
        fleet.stop_all(started)
        raise


def phase_instances(phase: str, topologies: List[str]) -> List[dict]:
    """The instances a phase needs for the topologies it will run."""
    if phase == "plain":
        return [{"name": "instance-a", "core": "0"}] + \
            ([{"name": "instance-b", "core": "1"}] if "router" in topologies else [])
    # Migration between the two (each produces and consumes KV, each knows the other's lease
    # channel; a failed load recomputes), as docs/live-migration.md runs them
    if phase == "balance":
        ports = [fleet.free_port(), fleet.free_port()]
        return [{"name": f"instance-{n}", "core": str(i), "lease": f"127.0.0.1:{ports[i]}",
                 "kv_config": {"kv_connector": "VllmExtConnector", "kv_role": "kv_both",
                               "kv_load_failure_policy": "recompute",
                               "kv_connector_extra_config": {"lease_port": ports[i],
                                                             "connect_to": [f"127.0.0.1:{ports[1 - i]}"]}}}
                for i, n in enumerate("ab")]
    lease_port = fleet.free_port()
    return [{"name": "prefill", "core": "0", "kv_config": {
                "kv_connector": "VllmExtConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"lease_port": lease_port}}},
            {"name": "decode", "core": "1", "kv_config": {
                "kv_connector": "VllmExtConnector", "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"connect_to": [f"127.0.0.1:{lease_port}"]}}}]


def front_argv(topology: str, specs: List[dict], urls: List[str], port: int) -> Optional[List[str]]:
    """The router or proxy command in front of the instances (None: clients talk to the instance)."""
    where = ["--host", "127.0.0.1", "--port", str(port)]
    if topology == "single":
        return None
    if topology == "pd":
        return [sys.executable, "-m", "vllm_ext.proxy", "--prefill", urls[0], "--decode", urls[1], *where]
    argv = [sys.executable, "-m", "vllm_ext.router", "--instance", *urls, *where]
    if topology == "balance":
        argv.append("--balance")
        lease_flag = re.search(r"(--[a-z-]*lease[a-z-]*)", _router_help())
        if lease_flag:  # the instances' lease channels, in --instance order
            argv += [lease_flag.group(1), *[s["lease"] for s in specs]]
    return argv


def start_front(cfg: ServerConfig, argv: List[str], name: str, port: int) -> "fleet.Process":
    front = fleet.Process(name, argv, fleet.vllm_env("0"), cfg.log_dir / f"{name}.log", port)
    try:
        front.wait_healthy(timeout=120)
    except BaseException:
        front.stop()
        raise
    return front

