"""Model folders the serving benchmarks write for themselves (no model hub here): a 7B-shaped
Llama as a config.json only (served with `--load-format dummy`), Llumnix's LLaMA-7B geometry."""

import json
from pathlib import Path

LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
            "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
            "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


def write_7b_config(path: Path, max_len: int = 16384) -> Path:
    """A folder with the config.json of a LLaMA-7B-shaped model (0.5 MiB of KV per token in bf16)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(LLAMA_7B, max_position_embeddings=max_len), indent=1))
    return path
