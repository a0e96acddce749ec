"""The load's requests: a ShareGPT-format JSON file that `vllm bench serve --dataset-name sharegpt`
reads as it reads ShareGPT itself (first turn = prompt; the answer's token count = the request's
max_tokens, sent with ignore_eos), generated here because no dataset can be downloaded.

Lengths are drawn from log-normal distributions (long-tailed, like ShareGPT-GPT4's first-turn
prompts and GPT-4 answers that Llumnix's CI replays) with a stated median and sigma, clipped to
vLLM's ShareGPT filter (at least 4 tokens each, prompt <= max_prompt, prompt + output <=
max_total) so that vLLM drops none of them. Texts are words that are one token each
(vllm_ext.fleet.tokenizers.single_token_words) with a period every 8-20 words, so every length
is exact; the file records the lengths it meant, and `check_lengths` verifies them with the
tokenizer.
"""

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Tuple

from vllm_ext.fleet.tokenizers import load as load_tokenizer
from vllm_ext.fleet.tokenizers import single_token_words


@dataclass(frozen=True)
class Lengths:
    """Log-normal token lengths: exp(N(ln median, sigma)), rounded and clipped."""
    prompt_median: float
    prompt_sigma: float
    output_median: float
    output_sigma: float
    max_prompt: int = 1024  # vLLM's ShareGPT filter
    max_total: int = 2048
    min_len: int = 4

    def draw(self, rng: random.Random) -> Tuple[int, int]:
        prompt = int(round(math.exp(rng.gauss(math.log(self.prompt_median), self.prompt_sigma))))
        prompt = min(max(prompt, self.min_len), self.max_prompt)
        output = int(round(math.exp(rng.gauss(math.log(self.output_median), self.output_sigma))))
        return prompt, min(max(output, self.min_len), self.max_total - prompt)


def text(rng: random.Random, words: List[str], n: int) -> str:
    """`n` tokens of text: words of one token, a "." (one token) ending each sentence."""
    out, sentence = [], rng.randint(8, 20)
    while len(out) < n:
        if sentence == 0 and len(out) < n - 1:
            out.append(".")
            sentence = rng.randint(8, 20)
        else:
            out.append(" " + rng.choice(words))
            sentence -= 1
    return "".join(out)


def write_dataset(path: Path, model_dir: Path, num_prompts: int, lengths: Lengths, seed: int) -> dict:
    """Writes `num_prompts` ShareGPT conversations to `path`; returns what the load record keeps."""
    rng = random.Random(seed)
    words = single_token_words(load_tokenizer(model_dir))
    conversations, pairs = [], []
    for i in range(num_prompts):
        prompt_len, output_len = lengths.draw(rng)
        pairs.append((prompt_len, output_len))
        conversations.append({"id": f"serving-{seed}-{i}", "prompt_tokens": prompt_len, "output_tokens": output_len,
                              "conversations": [{"from": "human", "value": text(rng, words, prompt_len)},
                                                {"from": "gpt", "value": text(rng, words, output_len)}]})
    path.write_text(json.dumps(conversations) + "\n")
    return {"path": path.name, "format": "sharegpt", "seed": seed, "num_prompts": num_prompts,
            "lengths": asdict(lengths), "prompt_lens": summary([p for p, _ in pairs]),
            "output_lens": summary([o for _, o in pairs])}


def check_lengths(path: Path, model_dir: Path) -> None:
    """Raises when a conversation's texts do not encode to the lengths it records."""
    tok = load_tokenizer(model_dir)
    for c in json.loads(path.read_text()):
        got = [len(tok.encode(turn["value"]).ids) for turn in c["conversations"]]
        if got != [c["prompt_tokens"], c["output_tokens"]]:
            raise RuntimeError(f"{c['id']}: texts encode to {got} tokens, not "
                               f"{[c['prompt_tokens'], c['output_tokens']]}")


def summary(values: List[int]) -> dict:
    """min, p50, p95, p99, max and mean of token lengths (nearest-rank percentiles)."""
    s = sorted(values)

    def rank(p):
        return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]

    return {"min": s[0], "p50": rank(50), "p95": rank(95), "p99": rank(99), "max": s[-1],
            "mean": round(sum(s) / len(s), 1)}
