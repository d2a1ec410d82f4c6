"""A tiny random Llama with a real byte-level BPE tokenizer, built offline for tests and benchmarks.

The weights are random (fixed seed, fp32) and the tokenizer is trained in well under a second on
the text below, so the folder is reproducible bit for bit and needs no network.
"""

from __future__ import annotations

import os
from pathlib import Path

#: ChatML, like SmolLM2's template (no default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN_ID = 2

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of
foolishness. Call me Ishmael. Some years ago, never mind how long precisely, having little or no money
in my purse, and nothing particular to interest me on shore, I thought I would sail about a little and
see the watery part of the world. In the beginning the server answered every request with exactly the
choices that were asked for, and the clients were glad. Hello, world! How are you today? I am fine,
thank you. What is the capital of France? The capital of France is Paris. One, two, three, four, five,
six, seven, eight, nine, ten. The weather is nice and the sky is blue. Once upon a time there was a
falcon that flew high above the mountains, looking for the river that runs to the sea. Numbers such as
42, 1999 and 3.14 appear in text too, as do symbols like @, #, $, %, &, * and (brackets).
User: please write a short poem about the moon. Assistant: The moon is bright, the night is long.
"""


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    return tokenizer


def build_tiny_model(path: str | os.PathLike[str], *, vocab_size: int = 512, seed: int = 0, positions: int = 256) -> Path:
    """Write a random tiny ``LlamaForCausalLM`` and its tokenizer to ``path`` and return the path.

    Config: vocab 512, hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads, ``positions`` (256) positions;
    fp32 safetensors. Tokenizer: byte-level BPE with ``<|endoftext|>`` (0), ``<|im_start|>`` (1),
    ``<|im_end|>`` (2, eos and pad), no BOS added, and a ChatML chat template.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    raw = _train_tokenizer(vocab_size)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert raw.token_to_id(token) == token_id, (token, raw.token_to_id(token))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=positions,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out
