"""Every rule the protocol registers — the spec's ``x-rule`` ids and the served ``x-runtime-rules``
table — has a request here that breaks it and is refused with the rule's status (400, or 404 for
an unknown model or response) and an error naming the rule's field: a new rule without a case
fails :func:`test_every_registered_rule_has_a_case`."""

from __future__ import annotations

import pytest

from gyrfalcon.protocol.rules import TRANSLATION_RULES, stated_rule_ids
from gyrfalcon.protocol.runtime_rules import RUNTIME_RULES

CHAT, BATCH = "/v1/chat/completions", "/v1/chat/completions/batch"
COMPLETIONS, GENERATE, RESPONSES = "/v1/completions", "/inference/v1/generate", "/v1/responses"
MSG = [{"role": "user", "content": "hi"}]
LOGPROBS = {"logprobs": 1, "logprob_token_ids": [5]}

#: rule id -> (path, body, status, the error's param)
CASES: dict[str, tuple[str, dict, int, str]] = {
    # stated in the spec (x-rule if/then) and checked in code
    "stream_options_requires_stream": (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    "prompt_logprobs_not_streaming": (COMPLETIONS, {"prompt": "hi", "stream": True, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    "n_greedy": (COMPLETIONS, {"prompt": "hi", "n": 2, "temperature": 0}, 400, "n"),
    "top_logprobs_requires_logprobs": (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    "logprob_token_ids_requires_logprobs": (CHAT, {"messages": MSG, "logprob_token_ids": [5]}, 400, "logprob_token_ids"),
    "return_tokens_as_token_ids_requires_logprobs": (COMPLETIONS, {"prompt": "hi", "return_tokens_as_token_ids": True}, 400,
                                                     "return_tokens_as_token_ids"),
    "logprob_token_ids_not_beam_search": (COMPLETIONS, {"prompt": "hi", **LOGPROBS, "use_beam_search": True}, 400, "logprob_token_ids"),
    "logprob_token_ids_not_echo_without_tokens": (COMPLETIONS, {"prompt": "hi", **LOGPROBS, "echo": True, "max_tokens": 0}, 400,
                                                  "logprob_token_ids"),
    "max_tokens_zero_requires_echo": (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    "batch_chat_not_streaming": (BATCH, {"messages": [MSG], "stream": True}, 400, "stream"),
    "stop_requires_detokenize": (GENERATE, {"token_ids": [5], "sampling_params": {"detokenize": False, "stop": ["x"]}}, 400,
                                 "sampling_params.stop"),
    # the served runtime-only table
    "min_tokens_le_max_tokens": (COMPLETIONS, {"prompt": "hi", "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens"),
    "prompt_fits_context": (GENERATE, {"token_ids": [5] * 200, "sampling_params": {"max_tokens": 8}}, 400, "token_ids"),
    "request_fits_kv_cache": (COMPLETIONS, {"prompt": "hi", "n": 64, "max_tokens": 120, "temperature": 1}, 400, "max_tokens"),
    "continue_final_message_alone": (CHAT, {"messages": MSG + [{"role": "assistant", "content": "a"}], "continue_final_message": True,
                                            "add_generation_prompt": True}, 400, "continue_final_message"),
    "request_tokens_le_limit": (COMPLETIONS, {"prompt": ["hi"] * 16, "n": 2, "temperature": 1, "max_tokens": 200}, 400, "max_tokens"),
    "request_seqs_le_limit": (COMPLETIONS, {"prompt": ["hi"] * 600, "n": 2, "temperature": 1, "max_tokens": 1}, 400, "n"),
    "constraint_compiles": (CHAT, {"messages": MSG, "structured_outputs": {"regex": "("}}, 400, "structured_outputs.regex"),
    "tools_consistent": (CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    "constraints_leave_a_token": (COMPLETIONS, {"prompt": "Code:", "max_tokens": 5, "allowed_token_ids": [0],
                                                "structured_outputs": {"regex": "[0-9]+"}}, 400, "structured_outputs"),
    "message_fields_match_role": (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.tool_call_id"),
    "tool_call_arguments_json": (CHAT, {"messages": MSG + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]}, 400, "messages.1.tool_calls.0.function.arguments"),
    "message_name_rendered": (CHAT, {"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, 400, "messages.0.name"),
    "message_tool_calls_rendered": (CHAT, {"messages": MSG + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "messages.1.tool_calls"),
    "logit_bias_ids_in_vocab": (COMPLETIONS, {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    "token_ids_in_vocab": (GENERATE, {"token_ids": [10**6]}, 400, "token_ids"),
    "logprob_token_ids_unique": (COMPLETIONS, {"prompt": "hi", "logprobs": 1, "logprob_token_ids": [5, 5]}, 400, "logprob_token_ids"),
    "logprobs_le_max_logprobs": (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    "generate_logprobs_count_ids": (GENERATE, {"token_ids": [5], "sampling_params": {"logprobs": 2, "logprob_token_ids": [5]}},
                                    400, "sampling_params.logprob_token_ids"),
    "model_served": (COMPLETIONS, {"prompt": "hi", "model": "nobody"}, 404, "model"),
    "field_supported": (COMPLETIONS, {"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    "extensions_valid": (COMPLETIONS, {"prompt": "hi", "extensions": {"nobody": 1}}, 400, "extensions"),
    "previous_response_stored": (RESPONSES, {"input": "hi", "previous_response_id": "resp_nobody"}, 404, "previous_response_id"),
    "background_stored_not_streamed": (RESPONSES, {"input": "hi", "background": True, "store": False}, 400, "background"),
    "responses_supported": (RESPONSES, {"input": "hi", "truncation": "auto"}, 400, "truncation"),
}

#: rules this deployment cannot be made to break, and why (each is tested where it can be)
UNREACHABLE = {
    "prompt_not_empty_after_tokenization": "the tiny model's byte-level tokenizer gives every non-empty text a token",
    "chat_template_renders": "the tiny model's ChatML template renders any conversation without raising",
    "model_path_fits": "its route is served only with --enable-rl-endpoints: tests/api/test_weight_updates.py breaks it",
    "lora_adapter_serves": "its route is served only with --enable-lora: tests/api/test_lora.py breaks it",
    "lora_name_free": "its route is served only with --enable-lora: tests/api/test_lora.py breaks it",
}


def _registered() -> set[str]:
    return set(stated_rule_ids()) | set(TRANSLATION_RULES) | {rule.id for rule in RUNTIME_RULES}


def test_every_registered_rule_has_a_case():
    assert _registered() == set(CASES) | set(UNREACHABLE)
    assert not set(CASES) & set(UNREACHABLE)


@pytest.mark.parametrize("rule", sorted(CASES))
def test_a_request_breaking_the_rule_is_refused_naming_its_field(client, rule):
    path, body, status, param = CASES[rule]
    answer = client.simulate_post(path, json=body)
    assert answer.status_code == status, (rule, answer.text)
    error = answer.json["error"]
    assert error["param"] == param, (rule, error)
    assert error["message"]


def _merged(first: str, second: str) -> tuple[str, dict] | None:
    """One body breaking both rules' cases, or None where their cases cannot share one (another
    endpoint, or a field both set differently)."""
    (path, body, _, _), (other_path, other_body, _, _) = CASES[first], CASES[second]
    if path != other_path or any(body[k] != other_body[k] for k in body.keys() & other_body.keys()):
        return None
    return path, {**body, **other_body}


def test_a_request_breaking_two_runtime_rules_is_refused_for_the_one_the_registry_lists_first(client):
    """The served table lists the runtime rules in the order a request meets them: wherever one body
    breaks two of them, the refusal is the first's (known by its text for that rule's case alone).
    Two rules of one home (the deployment's bounds) are met in the order of the endpoint's fields."""
    order = [rule.id for rule in RUNTIME_RULES if rule.id in CASES]
    home = {rule.id: rule.home for rule in RUNTIME_RULES}
    text = {rule: client.simulate_post(CASES[rule][0], json=CASES[rule][1]).json["error"]["message"] for rule in order}
    checked = []
    for i, first in enumerate(order):
        for second in order[i + 1:]:
            merged = _merged(first, second)
            if merged is None or text[first] == text[second] or home[first] == home[second]:
                continue
            error = client.simulate_post(merged[0], json=merged[1]).json.get("error") or {}
            if error.get("message") in (text[first], text[second]):
                assert error["message"] == text[first], (first, second, error)
                checked.append((first, second))
    assert len(checked) >= 20, checked
