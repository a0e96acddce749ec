#!/usr/bin/env python3
"""Writes a tiny random Llama with a tokenizer and a chat template, for serving tests without a model hub.

Usage: tiny_model.py OUTDIR [--seed N]

The model: 4 layers, hidden 256, 4 attention heads and 2 KV heads of head_dim 64, bfloat16
safetensors. Every weight but the norms is drawn from N(0, 0.05) with a fixed seed, so greedy
outputs change with the prompt (vLLM's dummy weights repeat one cycle whatever the prompt) and are
the same in every process that loads the checkpoint.

The tokenizer: byte-level, one token per byte (no merges, nothing to train), plus <s> and </s>;
the chat template tags each message with its role. It needs torch, transformers and tokenizers:
run it with the vllm-openai-cpu image's Python.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

NUM_LAYERS = 4
HIDDEN = 256
HEAD_DIM = 64
NUM_HEADS = HIDDEN // HEAD_DIM
NUM_KV_HEADS = 2
INTERMEDIATE = 512
MAX_POSITIONS = 1024
WEIGHT_STD = 0.05
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    vocab["<s>"] = len(vocab)
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(vocab_size: int, bos_id: int, eos_id: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, WEIGHT_STD)
    return model.to(torch.bfloat16)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, args.seed)
    os.makedirs(args.outdir, exist_ok=True)
    model.save_pretrained(args.outdir, safe_serialization=True)
    tokenizer.save_pretrained(args.outdir)
    # The checker's prompt ids must lie in the vocabulary; say what it is.
    summary = {"vocab_size": len(tokenizer), "parameters": sum(p.numel() for p in model.parameters())}
    print(f"tiny_model: {args.outdir}: {json.dumps(summary)}, files {sorted(os.listdir(args.outdir))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
