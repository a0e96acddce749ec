"""The model folder the servers load: a Llama config.json of a stated shape (weights come from
`--load-format dummy`) and a real tokenizer beside it, so that text prompts, vLLM's datasets
and chat templates work offline.

The tokenizer is a byte-level BPE (the GPT-2 / Llama-3 kind) trained with `tokenizers` on a
corpus generated here from a seeded lexicon of pseudo-words, so the same folder comes out on
every machine without a download. `single_token_words` lists the words that encode to exactly
one token after a space: text made of them has a known token count (dataset.py uses that).
"""

import itertools
import json
import random
from pathlib import Path
from typing import Dict, List

from ..common import models
from .servers import harness

# "tiny": the connector tests' model, sized for a 2-core CPU. "7b": LLaMA-7B's geometry
# (32 layers, 32 KV heads of 128, 0.5 MiB of bf16 KV per token), Llumnix's CI geometry.
GEOMETRY = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim")
SHAPES: Dict[str, dict] = {
    "tiny": {k: harness.CPU.model_config[k] for k in GEOMETRY},
    "7b": {k: models.LLAMA_7B[k] for k in GEOMETRY},
}
SPECIAL_TOKENS = ["<s>", "</s>"]  # ids 0 and 1: bos and eos
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CORPUS_SEED = 20240605
CORPUS_LINES_PER_TOKEN = 3  # 96k sentences for a 32k vocabulary; fewer for a small one
_CONSONANTS = "b c d f g h j k l m n p r s t v w z ch sh th st tr pl".split()
_VOWELS = "a e i o u ai ea ou io".split()


def corpus(lines: int, seed: int = CORPUS_SEED) -> List[str]:
    """Sentences of pseudo-words drawn with Zipf-like frequencies (rank^-0.9) from a seeded
    lexicon of about 45k words: enough distinct words for a 32k-token BPE."""
    rng = random.Random(seed)

    def word():
        syllables = rng.choice([1, 1, 2, 2, 2, 3, 3, 4])
        return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables)) + \
            rng.choice(["", "", "n", "s", "r", "t"])

    lexicon = list(dict.fromkeys(word() for _ in range(60_000)))
    weights = list(itertools.accumulate(1.0 / (rank + 1) ** 0.9 for rank in range(len(lexicon))))
    ends = [".", ".", ".", "?", "!", ","]
    return [" ".join(rng.choices(lexicon, cum_weights=weights, k=rng.randint(5, 25))) + rng.choice(ends)
            for _ in range(lines)]


def train_tokenizer(vocab_size: int):
    """A byte-level BPE of exactly `vocab_size` tokens (a `tokenizers.Tokenizer`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(max(10_000, CORPUS_LINES_PER_TOKEN * vocab_size)), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the BPE reached {tok.get_vocab_size()} tokens, not {vocab_size}: the corpus is too small")
    return tok


def single_token_words(tok) -> List[str]:
    """Lower-case words w such that " w" encodes to exactly one token, in id order."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    candidates = [(s[1:], i) for s, i in vocab if s.startswith("\u0120") and s[1:].isalpha() and s[1:].islower()]
    encoded = tok.encode_batch([" " + w for w, _ in candidates])
    return [w for (w, i), e in zip(candidates, encoded) if e.ids == [i]]


def config(shape: str, max_model_len: int) -> dict:
    """A Llama config.json of `shape` (one of SHAPES), bf16, for up to `max_model_len` tokens."""
    return dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama",
                max_position_embeddings=max_model_len, rms_norm_eps=1e-5, rope_theta=10000.0,
                hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16",
                bos_token_id=0, eos_token_id=1)


def write_model(path: Path, shape: str, max_model_len: int) -> Path:
    """The model folder: config.json, the tokenizer files and a chat template."""
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    cfg = config(shape, max_model_len)
    (path / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    fast = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(cfg["vocab_size"]), bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>", model_max_length=max_model_len)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))
