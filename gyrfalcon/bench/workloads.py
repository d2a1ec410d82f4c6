"""The bench's prompts: random token ids (``random``, the default), or requests that copy (``edit``).

``edit`` asks the served model, through its chat template, to write a passage out again with one
word replaced — the common work that copies from the prompt (editing code or text, extracting,
quoting), where prompt-lookup speculation pays. Each passage is drawn from a fixed list of words
with the prompt seed, so runs compare like with like and nothing is fetched.
"""

from __future__ import annotations

import random

from gyrfalcon.bench.client import fresh_prompts

#: the two workloads of ``gyrfalcon bench --workload``
WORKLOADS = ("random", "edit")

_WORDS = (
    "the river runs past the old mill where the miller keeps his grain and counts the sacks each evening before "
    "the light fails while children walk home along the stone wall that follows the water to the bridge near "
    "the market square where traders sell bread cheese apples and wool from the hills beyond the forest"
).split()


def passage(rng: random.Random, words: int) -> str:
    """``words`` words in sentences of 8 to 14, drawn from a fixed list."""
    out: list[str] = []
    while len(out) < words:
        sentence = [rng.choice(_WORDS) for _ in range(rng.randint(8, 14))]
        out.extend([sentence[0].capitalize(), *sentence[1:-1], sentence[-1] + "."])
    return " ".join(out[:words]).rstrip(".") + "."


def edit_prompts(count: int, tokenizer_path: str, seed: int, words: int = 80) -> list[str]:
    """``count`` chat prompts, rendered by the model's template, each asking for a passage of
    ``words`` words written out again with one word replaced."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        text = passage(rng, words)
        old, new = rng.choice(_WORDS), rng.choice(("lantern", "harbour", "garden", "candle", "meadow"))
        ask = f"Write the following text out again exactly, but replace every '{old}' with '{new}'.\n\n{text}"
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                                     add_generation_prompt=True))  # fmt: skip
    return prompts


def level_prompts(workload: str, counts: list[int], warm: int, length: int, vocab: int, seed: int,
                  tokenizer_path: str) -> tuple[list[list[int]], list[list]]:  # fmt: skip
    """``warm`` prompts of ``length`` random ids for the warm-up, then each concurrency level's own
    ``counts`` prompts of ``workload``: ``random`` ids, or ``edit`` prompts (after the warm-up's
    share, so that no level finds another's prompts cached)."""
    warm_prompts, levels = fresh_prompts(counts, warm, length, vocab, seed)
    if workload == "edit":
        every = edit_prompts(warm + sum(counts), tokenizer_path, seed)
        ends = [warm + sum(counts[: i + 1]) for i in range(len(counts))]
        levels = [every[end - count : end] for end, count in zip(ends, counts)]
    return warm_prompts, levels
