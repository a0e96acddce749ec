"""Model folders that vLLM servers load without a model hub, written the same on every machine:

  write_random_llama   a seeded random Llama as safetensors: every weight but the norms drawn
                       from N(0, WEIGHT_STD), so greedy outputs change with the prompt (vLLM's
                       dummy weights repeat one cycle whatever the prompt) and every process
                       that loads the folder computes the same;
  write_config         a config.json alone, served with `--load-format dummy` (a large geometry
                       costs no disk and no time to write);
  write_chat_model     a random Llama with a byte-level tokenizer and a chat template, the
                       Docker images' serve checks (tools/docker/tiny_model.py);
  write_text_model     a config.json with a trained BPE tokenizer, the serving benchmark's.

Geometries are LlamaConfig fields: TINY (a 2-core CPU), TINY_GPU (FlashAttention's head size on
one GPU) and LLAMA_7B (Llumnix's geometry). torch and transformers are imported when a writer
runs, not with this module.
"""

import json
import os
from pathlib import Path
from typing import Any, Dict, Optional

from . import tokenizers

WEIGHT_STD = 0.05
VOCAB_SIZE = 1024  # the tiny geometries' and the word-level tokenizer's: prompts are token ids below it
GEOMETRY = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim")

# Small enough for a 2-core CPU, large enough that greedy outputs depend on every KV entry.
TINY = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64)
# Several servers on one GPU: FlashAttention's head size 128, 4 KV heads.
TINY_GPU = dict(vocab_size=VOCAB_SIZE, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, head_dim=128)
# LLaMA-7B's config.json (32 layers, 32 KV heads of 128: 0.5 MiB of bf16 KV per token).
LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
            "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
            "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
# The shapes a config-only folder is written in (write_text_model).
SHAPES: Dict[str, Dict[str, Any]] = {"tiny": {k: TINY[k] for k in GEOMETRY},
                                     "7b": {k: LLAMA_7B[k] for k in GEOMETRY}}


def random_llama(config: Dict[str, Any], seed: int = 0, dtype: Optional[str] = None):
    """A LlamaForCausalLM of `config` (LlamaConfig's fields) whose weights but the norms are drawn
    from N(0, WEIGHT_STD) after torch.manual_seed(seed), in float32, then cast to `dtype` (a
    torch dtype name; None: left in float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, WEIGHT_STD)
    return model if dtype is None else model.to(getattr(torch, dtype))


def write_random_llama(path: Path, config: Dict[str, Any], seed: int = 0, dtype: Optional[str] = None) -> Path:
    """`random_llama(config, seed, dtype)` saved to `path` as safetensors, with no tokenizer."""
    random_llama(config, seed, dtype).save_pretrained(path, safe_serialization=True)
    return path


def write_config(path: Path, config: Dict[str, Any], newline: bool = True) -> Path:
    """A folder with `config` as its config.json (indented by one, a final newline unless not
    `newline`)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1) + ("\n" if newline else ""))
    return path


def write_7b_config(path: Path, max_len: int = 16384) -> Path:
    """A folder with the config.json of a LLaMA-7B-shaped model for up to `max_len` tokens."""
    return write_config(path, dict(LLAMA_7B, max_position_embeddings=max_len), newline=False)


def write_word_tokenizer(path: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """`tokenizers.word_level(vocab_size)` saved into the model folder `path`."""
    tokenizers.word_level(vocab_size).save_pretrained(path)
    return path


# The Docker images' model: the TINY geometry over the byte-level tokenizer's vocabulary.
CHAT_MODEL_MAX_POSITIONS = 1024


def write_chat_model(path: Path, seed: int = 0) -> Dict[str, Any]:
    """A tiny random Llama in bfloat16 with a byte-level tokenizer and a role-tagged chat
    template; returns its vocabulary size and parameter count (prompt ids must lie in the
    vocabulary)."""
    tokenizer = tokenizers.byte_level()
    config = dict(TINY, vocab_size=len(tokenizer), max_position_embeddings=CHAT_MODEL_MAX_POSITIONS,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  tie_word_embeddings=False)
    model = random_llama(config, seed, "bfloat16")
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return {"vocab_size": len(tokenizer), "parameters": sum(p.numel() for p in model.parameters())}


def text_model_config(shape: str, max_model_len: int) -> Dict[str, Any]:
    """A Llama config.json of `shape` (one of SHAPES), bf16, for up to `max_model_len` tokens;
    bos and eos are the trained BPE's ids 0 and 1."""
    return dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama",
                max_position_embeddings=max_model_len, rms_norm_eps=1e-5, rope_theta=10000.0,
                hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16",
                bos_token_id=0, eos_token_id=1)


def write_text_model(path: Path, shape: str, max_model_len: int) -> Path:
    """A folder for `--load-format dummy`: config.json of `shape`, and a byte-level BPE trained
    offline to the shape's vocabulary (tokenizers.trained_bpe), so that text prompts, vLLM's
    datasets and chat templates work."""
    cfg = text_model_config(shape, max_model_len)
    write_config(path, cfg)
    tokenizers.trained_bpe(cfg["vocab_size"], max_model_len).save_pretrained(path)
    return path
