"""What the end-to-end connector tests share: a seeded random Llama checkpoint, vLLM servers
and the proxy as child processes on 127.0.0.1 (free ports), each stopped by its owner."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

# Small enough for a 2-core CPU, large enough that greedy outputs depend on every KV entry.
MODEL_CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16")
BLOCK_SIZE = 32  # CPU_ATTN needs a multiple of 32
# float32, not bfloat16: with bf16 on a CPU with AMX, vLLM 0.32's CPU attention takes its "amx" kernels,
# which die of SIGILL on the first step after an asynchronous external load (seen on this host).
DTYPE = "float32"
SECRET = "connector-tests-deployment-secret"
STARTUP_TIMEOUT_S = 420.0  # a vLLM CPU server starts in ~60 s on 2 idle cores; shared hosts are slower
REQUEST_TIMEOUT_S = 120.0


def write_checkpoint(path: Path, seed: int = 0) -> Path:
    """A seeded random Llama (non-norm weights N(0, 0.05)) as safetensors, with no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**MODEL_CONFIG)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.05)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def write_tokenizer(path: Path) -> Path:
    """A word-level tokenizer ("w<id>" is token <id>) with a plain chat template, so that the
    servers also answer /v1/chat/completions."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(MODEL_CONFIG["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2",
                                   pad_token="w0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
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


def vllm_env(core: str, extra_pythonpath: str = "") -> dict:
    env = dict(os.environ)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": core,
                "VLLM_EXT_AUTH_SECRET": SECRET, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
    if extra_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_pythonpath, env.get("PYTHONPATH", "")) if p)
    return env


def start_vllm(name, model: Path, log_dir: Path, *, core: str, kv_config=None, extra_args=(),
               extra_pythonpath: str = "", extra_env=None, tokenizer: bool = False) -> Process:
    """A vLLM OpenAI server of `model` (token-id prompts only, unless `tokenizer`: the model
    folder then holds one, see write_tokenizer)."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "tiny", *([] if tokenizer else ["--skip-tokenizer-init"]), "--dtype", DTYPE,
            "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE), "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "16", *extra_args]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    env = vllm_env(core, extra_pythonpath)
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
