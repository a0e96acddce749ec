"""What the end-to-end connector tests share: a seeded random Llama checkpoint, vLLM servers
and the proxy as child processes on 127.0.0.1 (free ports), each stopped by its owner, and how
the servers run on each kind of device (DEVICES)."""

import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Tuple

import torch

VOCAB_SIZE = 1024  # the word-level tokenizer's too: prompts are token ids below it
BLOCK_SIZE = 32  # CPU_ATTN needs a multiple of 32; FlashAttention takes it too (a multiple of 16)
SECRET = "connector-tests-deployment-secret"
STARTUP_TIMEOUT_S = 420.0  # a vLLM CPU server starts in ~60 s on 2 idle cores; shared hosts are slower
REQUEST_TIMEOUT_S = 120.0


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
        """The environment of a server; `core` is the CPU core a CPU server computes on."""
        if self.name == "cpu":
            return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": core}
        # greedy decoding needs no FlashInfer sampler, and FlashInfer may not be installed
        return {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


DEVICES = {
    # Small enough for a 2-core CPU, large enough that greedy outputs depend on every KV entry.
    # float32, not bfloat16: with bf16 on a CPU with AMX, vLLM 0.32's CPU attention takes its "amx"
    # kernels, which die of SIGILL on the first step after an asynchronous external load.
    "cpu": Device(
        name="cpu", dtype="float32", backend="gloo",
        model_config=dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
    # One GPU, three servers: each gets a quarter of its memory, and they start one after the
    # other (vLLM sizes its cache from the memory free when it starts). FlashAttention's head
    # size 128 and 4 KV heads. float16, not bfloat16: its 8x finer rounding keeps the decode
    # side's first step (one token over the pulled KV) and the single instance's prefill from
    # parting at a near-tie of a random model's logits.
    "cuda": Device(
        name="cuda", dtype="float16", backend="ipc", sequential_start=True,
        server_args=("--gpu-memory-utilization", "0.25"),
        model_config=dict(vocab_size=VOCAB_SIZE, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=128)),
}
CPU = DEVICES["cpu"]  # the default of the functions below


def write_checkpoint(path: Path, seed: int = 0, *, device: Device = CPU) -> Path:
    """A seeded random Llama of `device`'s geometry (non-norm weights N(0, 0.05)) as
    safetensors, with no tokenizer; bfloat16 weights for float32 servers, else the served dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if device.dtype == "float32" else getattr(torch, device.dtype)
    torch.manual_seed(seed)
    config = LlamaConfig(**device.model_config, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, torch_dtype=str(dtype).replace("torch.", ""))
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.05)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    return path


def write_tokenizer(path: Path) -> Path:
    """A word-level tokenizer ("w<id>" is token <id>) with a plain chat template, so that the
    servers also answer /v1/chat/completions."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB_SIZE)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2",
                                   pad_token="w0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    return path


_HANDED_OUT: set = set()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free now, for a server started later: below the kernel's ephemeral range, so that
    no socket bound to port 0 meanwhile (a lease channel, an endpoint, a client's connect) can
    take it first, and never the same twice in one process."""
    top = _ephemeral_start()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, top - 12000), top)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # a crowded range: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A child process with its log file; stop() kills its whole process group."""

    def __init__(self, name, argv, env, log_path: Path, port: int):
        self.name, self.port, self.log_path = name, port, log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n=60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not healthy after {timeout:g} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=20)
        self._log.close()

    def kill(self) -> None:
        """SIGKILL, as a crash would (no clean shutdown)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)


def vllm_env(core: str = "0", extra_pythonpath: str = "", *, device: Device = CPU) -> dict:
    """The environment of a vLLM server (or the proxy) on `device`."""
    env = dict(os.environ)
    env.update(device.env(core))
    env.update({"VLLM_EXT_AUTH_SECRET": SECRET, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
    if extra_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_pythonpath, env.get("PYTHONPATH", "")) if p)
    return env


def start_vllm(name, model: Path, log_dir: Path, *, core: str, kv_config=None, extra_args=(),
               extra_pythonpath: str = "", extra_env=None, tokenizer: bool = False, device: Device = CPU) -> Process:
    """A vLLM OpenAI server of `model` on `device` (token-id prompts only, unless `tokenizer`:
    the model folder then holds one, see write_tokenizer)."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "tiny", *([] if tokenizer else ["--skip-tokenizer-init"]), "--dtype", device.dtype,
            "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE), "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "16", *device.server_args, *extra_args]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    env = vllm_env(core, extra_pythonpath, device=device)
    env.update(extra_env or {})
    return Process(name, argv, env, log_dir / f"{name}.log", port)


def post(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S):
    """(status, parsed JSON body) of a POST."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


def metrics(url: str) -> dict:
    """Prometheus samples of /metrics, name{labels} -> value, summed over labels by name too."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        name = key.split("{")[0]
        out[key] = v
        out[name] = out.get(name, 0.0) + v if name != key else v
    return out
