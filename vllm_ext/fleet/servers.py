"""vLLM OpenAI servers (and the fronts before them) as child processes on 127.0.0.1, the same
way on each kind of device: the checkpoint's geometry and dtype, the migration backend the
connector picks there by default, the servers' extra arguments and environment (DEVICES).

The tests' servers share a 2-core host with each other (each computes on the core it is given)
and with the test itself, and all of them set one deployment secret (SECRET) that the
connector's migration endpoints and lease channels authenticate with.
"""

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

from . import models
from .process import Process, free_port

# vLLM CPU binds a worker process, every thread it starts included, to the cores its
# VLLM_CPU_OMP_THREADS_BIND names. Servers that share a core starve each other's ranks there
# (tests/e2e/test_tp.py says how); NO_BIND leaves every thread to the OS, one compute thread each.
NO_BIND = "nobind"
BLOCK_SIZE = 32  # CPU_ATTN needs a multiple of 32; FlashAttention takes it too (a multiple of 16)
SECRET = "connector-tests-deployment-secret"
MAX_MODEL_LEN = 2048


@dataclasses.dataclass(frozen=True)
class Device:
    """How the servers run on one kind of device: the checkpoint's geometry, the dtype they
    serve, the migration backend the connector picks there by default, their extra arguments and
    environment, and whether they must start one after the other."""

    name: str
    model_config: Dict[str, Any]
    dtype: str
    backend: str
    server_args: Tuple[str, ...] = ()
    sequential_start: bool = False

    def env(self, core: str) -> Dict[str, str]:
        """The environment of a server; `core` is the CPU core a CPU server computes on (its
        VLLM_CPU_OMP_THREADS_BIND: "0", "0|1" for TP = 2), or NO_BIND."""
        if self.name == "cpu":
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": core}
            if core == NO_BIND:  # vLLM sets OMP_NUM_THREADS only where it binds
                env["OMP_NUM_THREADS"] = "1"
            return env
        # greedy decoding needs no FlashInfer sampler, and FlashInfer may not be installed
        return {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


DEVICES = {
    # float32, not bfloat16: with bf16 on a CPU with AMX, vLLM 0.32's CPU attention takes its "amx"
    # kernels, which die of SIGILL on the first step after an asynchronous external load.
    "cpu": Device(name="cpu", dtype="float32", backend="gloo", model_config=models.TINY),
    # One GPU, three servers: each gets a quarter of its memory, and they start one after the
    # other (vLLM sizes its cache from the memory free when it starts). float16, not bfloat16:
    # its 8x finer rounding keeps the decode side's first step (one token over the pulled KV) and
    # the single instance's prefill from parting at a near-tie of a random model's logits.
    # FLEET_GPU_MEMORY lowers the share where several test runs share the GPU.
    "cuda": Device(name="cuda", dtype="float16", backend="ipc", sequential_start=True,
                   server_args=("--gpu-memory-utilization", os.environ.get("FLEET_GPU_MEMORY", "0.25")),
                   model_config=models.TINY_GPU),
}
CPU = DEVICES["cpu"]  # the default of the functions below


def write_checkpoint(path: Path, seed: int = 0, *, device: Device = CPU) -> Path:
    """A seeded random Llama of `device`'s geometry as safetensors, with no tokenizer (see
    models.write_word_tokenizer); bfloat16 weights for float32 servers, else the served dtype."""
    dtype = "bfloat16" if device.dtype == "float32" else device.dtype
    config = dict(device.model_config, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, torch_dtype=dtype)
    return models.write_random_llama(path, config, seed, dtype)


def vllm_env(core: str = "0", extra_pythonpath: str = "", *, device: Device = CPU) -> Dict[str, str]:
    """The environment of a vLLM server (or a front) on `device`: offline, the deployment
    secret, unbuffered output; `extra_pythonpath` goes first on its PYTHONPATH."""
    env = dict(os.environ)
    env.update(device.env(core))
    env.update({"VLLM_EXT_AUTH_SECRET": SECRET, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
    if extra_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_pythonpath, env.get("PYTHONPATH", "")) if p)
    return env


def start_vllm(name, model: Path, log_dir: Path, *, core: str, kv_config=None, extra_args=(),
               extra_pythonpath: str = "", extra_env=None, tokenizer: bool = False, device: Device = CPU) -> Process:
    """A vLLM OpenAI server of `model` on `device`, served as "tiny", its log in
    `log_dir`/`name`.log (token-id prompts only, unless `tokenizer`: the model folder then holds
    one). Returns at once: wait_healthy() waits for it."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "tiny", *([] if tokenizer else ["--skip-tokenizer-init"]), "--dtype", device.dtype,
            "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE), "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "16", *device.server_args, *extra_args]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    env = vllm_env(core, extra_pythonpath, device=device)
    env.update(extra_env or {})
    return Process(name, argv, env, log_dir / f"{name}.log", port)


def start_front(name: str, module: str, args, log_dir: Path, *, env: Dict[str, str] = None,
                device: Device = CPU) -> Process:
    """A front (`module`: vllm_ext.router or vllm_ext.proxy) on a free port of 127.0.0.1 with
    `args`, its log in `log_dir`/`name`.log; `env` defaults to vllm_env's. Returns at once."""
    port = free_port()
    argv = [sys.executable, "-m", module, *args, "--port", str(port)]
    return Process(name, argv, vllm_env(device=device) if env is None else env, log_dir / f"{name}.log", port)


def start_proxy(name: str, prefill, decode, log_dir: Path, *, extra_args=(), **kw) -> Process:
    """The P/D proxy before the prefill and decode servers' URLs (lists)."""
    return start_front(name, "vllm_ext.proxy", ["--prefill", *prefill, "--decode", *decode, *extra_args], log_dir,
                       **kw)


def start_router(name: str, instances, leases, log_dir: Path, *, extra_args=(), **kw) -> Process:
    """The router before the instances' URLs, with their lease channels' host:port (lists)."""
    return start_front(name, "vllm_ext.router", ["--instance", *instances, "--lease", *leases, *extra_args], log_dir,
                       **kw)

