"""Model folders that vLLM servers load without a model hub, written the same on every machine:

  write_random_llama   a seeded random Llama as safetensors: every weight but the norms drawn
                       from N(0, WEIGHT_STD), so greedy outputs change with the prompt (vLLM's
                       dummy weights repeat one cycle whatever the prompt) and every process
                       that loads the folder computes the same;
  write_random_mla     a seeded random DeepSeek-V2 (MLA), and write_random_sliding a seeded
                       random Gemma 3 (sliding-window beside full attention), the same way;
  write_config         a config.json alone, served with `--load-format dummy` (a large geometry
                       costs no disk and no time to write);
  write_chat_model     a random Llama with a byte-level tokenizer and a chat template, the
                       Docker images' serve checks (tools/docker/tiny_model.py);
  write_text_model     a config.json with a trained BPE tokenizer, the serving benchmark's.

Geometries are LlamaConfig fields: TINY (a 2-core CPU), TINY_GPU (FlashAttention's head size on
one GPU) and LLAMA_7B (Llumnix's geometry); TINY_MLA and TINY_SLIDING are a CPU's MLA and
sliding-window models, DEEPSEEK_V2_LITE and GEMMA3_1B config.json files for dummy weights on a
GPU. torch and transformers are imported when a writer runs, not with this module.
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
    return random_model("Llama", config, seed, dtype)


def random_model(family: str, config: Dict[str, Any], seed: int = 0, dtype: Optional[str] = None):
    """transformers' `<family>ForCausalLM` of `<family>Config(**config)` (family: "Llama",
    "DeepseekV2", "Gemma3"), its weights drawn as random_llama's."""
    import torch
    import transformers

    config_class = getattr(transformers, "Gemma3TextConfig" if family == "Gemma3" else f"{family}Config")
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config_class(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, WEIGHT_STD)
    return model if dtype is None else model.to(getattr(torch, dtype))


def write_random_llama(path: Path, config: Dict[str, Any], seed: int = 0, dtype: Optional[str] = None) -> Path:
    """`random_llama(config, seed, dtype)` saved to `path` as safetensors, with no tokenizer."""
    random_llama(config, seed, dtype).save_pretrained(path, safe_serialization=True)
    return path


# An MLA model (DeepSeek-V2's attention) small enough for a 2-core CPU: vLLM's CPU MLA kernel takes
# only DeepSeek's latent (kv_lora_rank 512 + rope 64 = 576) and blocks of 16; dense MLPs only
# (first_k_dense_replace = every layer), no MoE.
TINY_MLA = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2, kv_lora_rank=512,
                q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
# Sliding-window layers beside full-attention ones (Gemma 3's pattern), windows shorter than the
# tests' prompts so that both kinds of layer matter.
TINY_SLIDING = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=48,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
# For --load-format dummy on a GPU: DeepSeek-V2-Lite's geometry (27 layers, MLA latent 512 + 64,
# 64 experts) and a Gemma-3-1B-shaped model (5 sliding-window layers of 512 tokens per full one).
DEEPSEEK_V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
                    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
                    "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6,
                    "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "topk_method": "greedy",
                    "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "scoring_func": "softmax",
                    "routed_scaling_factor": 1.0, "aux_loss_alpha": 0.001, "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-6, "rope_theta": 10000, "hidden_act": "silu", "tie_word_embeddings": False,
                    "torch_dtype": "bfloat16", "bos_token_id": 100000, "eos_token_id": 100001}
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
             "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512, "sliding_window_pattern": 6,
             "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
             "rope_local_base_freq": 10000, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
             "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True,
             "torch_dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": 1}


def write_random_mla(path: Path, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """A seeded random DeepSeek-V2 of TINY_MLA geometry (MLA attention) as safetensors, no tokenizer."""
    random_model("DeepseekV2", dict(TINY_MLA, torch_dtype=dtype), seed, dtype).save_pretrained(
        path, safe_serialization=True)
    return path


def write_random_sliding(path: Path, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """A seeded random Gemma 3 of TINY_SLIDING geometry (sliding-window and full attention layers)
    as safetensors, no tokenizer."""
    random_model("Gemma3", dict(TINY_SLIDING, torch_dtype=dtype), seed, dtype).save_pretrained(
        path, safe_serialization=True)
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
CHAT_MODEL_MAX_POSITIONS = 2048


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
