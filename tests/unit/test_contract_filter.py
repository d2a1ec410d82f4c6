"""The Schemathesis filter that keeps positive cases clear of the runtime-only rules."""

from __future__ import annotations

from gyrfalcon.contract import breaks_runtime_rule

LIMITS = {"max_model_len": 64, "chat": {"fixed": 5, "per_message": 8}, "max_request_seqs": 1024,
          "kv_cache": {"blocks": 32, "block_size": 16}}  # fmt: skip
MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_reads_max_completion_tokens_not_the_completions_default():
    assert breaks_runtime_rule("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 55}, LIMITS)
    assert not breaks_runtime_rule("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 20}, LIMITS)
    assert not breaks_runtime_rule("/v1/chat/completions", {"messages": MESSAGES}, LIMITS)  # up to the context


def test_completions_default_max_tokens_is_16():
    assert not breaks_runtime_rule("/v1/completions", {"prompt": "x" * 40}, LIMITS)
    assert breaks_runtime_rule("/v1/completions", {"prompt": "x" * 50}, LIMITS)


def test_n_times_the_sequence_must_fit_the_kv_cache():
    body = {"prompt": [[1, 2], [3]], "max_tokens": 14}  # the longer prompt: 16 tokens, one block per choice
    assert not breaks_runtime_rule("/v1/completions", {**body, "n": 32}, LIMITS)
    assert breaks_runtime_rule("/v1/completions", {**body, "n": 33}, LIMITS)
    assert breaks_runtime_rule("/inference/v1/generate", {"token_ids": [1] * 10, "sampling_params": {"n": 20, "max_tokens": 30}}, LIMITS)


def test_a_requests_work_must_fit_max_request_tokens():
    """prompts x n x max_tokens, a token with logprobs counting 1 + entries/20, the same sum the
    server makes (engine_api.lengths.request_work); an omitted chat max_tokens counts the context.
    The default bound (twice max_num_seqs x the context) takes one choice of the whole context with
    all of OpenAI's top logprobs."""
    from gyrfalcon.engine_api.lengths import default_request_tokens

    limits = {**LIMITS, "kv_cache": None, "max_request_tokens": 1000}
    assert not breaks_runtime_rule("/v1/completions", {"prompt": [[1]] * 10, "n": 5, "max_tokens": 20}, limits)
    assert breaks_runtime_rule("/v1/completions", {"prompt": [[1]] * 10, "n": 5, "max_tokens": 21}, limits)
    assert breaks_runtime_rule("/v1/completions", {"prompt": [[1]] * 10, "n": 5, "max_tokens": 20, "logprobs": 1}, limits)
    assert breaks_runtime_rule("/v1/chat/completions", {"messages": MESSAGES, "n": 16}, limits)  # 16 x the context
    assert not breaks_runtime_rule("/v1/chat/completions", {"messages": MESSAGES, "n": 15}, limits)
    default = {**limits, "max_request_tokens": default_request_tokens(1, 64)}
    assert not breaks_runtime_rule("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 20}, default)


def test_a_prompt_without_a_printable_character_may_tokenize_to_nothing():
    """Found by the fuzz campaign on the default model: "\\u0006" is a valid string its tokenizer drops."""
    for prompt in ("\u0006", "", ["ok", "\u0007\u0008"]):
        assert breaks_runtime_rule("/v1/completions", {"prompt": prompt, "max_tokens": 2}, LIMITS), prompt
    for prompt in (" ", "a\u0006", ["ok", "fine"]):
        assert not breaks_runtime_rule("/v1/completions", {"prompt": prompt, "max_tokens": 2}, LIMITS), prompt


def test_a_grammar_with_allowed_token_ids_may_leave_no_token():
    """Found by the fuzz campaign: allowed_token_ids may exclude every token a JSON schema needs."""
    base = {"messages": MESSAGES, "max_completion_tokens": 5, "allowed_token_ids": [3]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    roomy = {**LIMITS, "max_model_len": 4096, "kv_cache": None}  # tools' instructions take room
    for constrained in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "a+"}},
                        {"tools": [tool], "tool_choice": "required"}):  # fmt: skip
        assert breaks_runtime_rule("/v1/chat/completions", {**base, **constrained}, roomy), constrained
    for free in ({}, {"response_format": {"type": "text"}}, {"tools": [tool], "tool_choice": "auto"}):
        assert not breaks_runtime_rule("/v1/chat/completions", {**base, **free}, roomy), free


def test_a_constraint_with_a_byte_no_token_holds_may_leave_no_token():
    """Found by `gyrfalcon check` on the default model: SmolLM2 has no token holding 0x06 or 0xf2, so
    the regex "H\\x06" cannot be met; the served spec says which bytes (x-limits unspellable_bytes)."""
    limits = {**LIMITS, "unspellable_bytes": [6, 0xF2]}
    generate = {"token_ids": [5], "sampling_params": {"max_tokens": 4, "structured_outputs": {"regex": "H\u0006"}}}
    assert breaks_runtime_rule("/inference/v1/generate", generate, limits)
    assert not breaks_runtime_rule("/inference/v1/generate", generate, LIMITS)  # a vocabulary that holds every byte
    chat = {"messages": MESSAGES, "max_completion_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"const": "\U00089e16"}}}}
    assert breaks_runtime_rule("/v1/chat/completions", chat, limits)  # U+89E16 is f2 89 b8 96
    plain = {"messages": [{"role": "user", "content": "H\u0006"}], "max_completion_tokens": 5}
    assert not breaks_runtime_rule("/v1/chat/completions", plain, limits)  # no constraint: a prompt may hold anything
