#!/usr/bin/env python3
"""Writes a tiny random Llama with a tokenizer and a chat template, for serving tests without a model hub.

Usage: tiny_model.py OUTDIR [--seed N]

The model is vllm_ext.fleet.models.write_chat_model's: 4 layers, hidden 256, 4 attention heads
and 2 KV heads of head_dim 64, bfloat16 safetensors, every weight but the norms drawn from
N(0, 0.05) with a fixed seed (greedy outputs change with the prompt and are the same in every
process that loads the checkpoint); a byte-level tokenizer (one token per byte, plus <s> and
</s>) whose chat template tags each message with its role. Run it with the vllm-openai-cpu
image's Python: it needs the installed vllm_ext, torch, transformers and tokenizers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from vllm_ext.fleet.models import write_chat_model


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    summary = write_chat_model(args.outdir, args.seed)
    # The checker's prompt ids must lie in the vocabulary; say what it is.
    print(f"tiny_model: {args.outdir}: {json.dumps(summary)}, files {sorted(os.listdir(args.outdir))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
