"""Tokenizers for the fleet's model folders, built offline (no model hub):

  word_level     "w<id>" is token <id>: prompts of token ids read back as text, a plain chat
                 template (the tests' model);
  byte_level     one token per byte plus <s> and </s>, nothing to train, a role-tagged chat
                 template (the Docker images' serve checks);
  trained_bpe    a byte-level BPE (the GPT-2 / Llama-3 kind) of an exact size, trained on a
                 corpus of seeded pseudo-words (the serving benchmark's text prompts).

Each comes out the same on every machine. They need `tokenizers` and `transformers`, imported
when called.
"""

import itertools
import random
from pathlib import Path
from typing import List

WORD_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
BPE_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
BPE_SPECIAL_TOKENS = ["<s>", "</s>"]  # ids 0 and 1: bos and eos
CORPUS_SEED = 20240605
CORPUS_LINES_PER_TOKEN = 3  # 96k sentences for a 32k vocabulary; fewer for a small one
_CONSONANTS = "b c d f g h j k l m n p r s t v w z ch sh th st tr pl".split()
_VOWELS = "a e i o u ai ea ou io".split()


def word_level(vocab_size: int):
    """A word-level tokenizer ("w<id>" is token <id>; w0 unknown and padding, w1 bos, w2 eos)
    with a plain chat template, so that servers also answer /v1/chat/completions."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2",
                                   pad_token="w0")
    fast.chat_template = WORD_CHAT_TEMPLATE
    return fast


def byte_level():
    """A byte-level tokenizer, one token per byte (no merges), plus <s> and </s> (258 tokens);
    its chat template tags each message with its role."""
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
    fast.chat_template = BYTE_CHAT_TEMPLATE
    return fast


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


def train_bpe(vocab_size: int):
    """A byte-level BPE of exactly `vocab_size` tokens (a `tokenizers.Tokenizer`), <s> and </s>
    first, trained on `corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=BPE_SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(max(10_000, CORPUS_LINES_PER_TOKEN * vocab_size)), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the BPE reached {tok.get_vocab_size()} tokens, not {vocab_size}: the corpus is too small")
    return tok


def trained_bpe(vocab_size: int, model_max_length: int):
    """`train_bpe(vocab_size)` as a transformers tokenizer (</s> pads) with a role-tagged chat
    template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=train_bpe(vocab_size), bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>", model_max_length=model_max_length)
    fast.chat_template = BPE_CHAT_TEMPLATE
    return fast


def single_token_words(tok) -> List[str]:
    """Lower-case words w such that " w" encodes to exactly one token of `tok` (a
    `tokenizers.Tokenizer`), in id order: text made of them has a known token count."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    candidates = [(s[1:], i) for s, i in vocab if s.startswith("\u0120") and s[1:].isalpha() and s[1:].islower()]
    encoded = tok.encode_batch([" " + w for w, _ in candidates])
    return [w for (w, i), e in zip(candidates, encoded) if e.ids == [i]]


def load(path: Path):
    """The `tokenizers.Tokenizer` of a model folder."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))
