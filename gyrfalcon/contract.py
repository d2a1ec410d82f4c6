"""Schemathesis set-up for fuzzing a gyrfalcon server: the tests use it, and so can anyone.

A few rules cannot be written in JSON Schema (the served spec lists them under
``x-runtime-rules``): above all, prompt tokens + ``max_tokens`` must fit the context. A schema-valid
request may therefore still be refused with 400. The ``filter_case`` hook below drops, from
*positive* generation only, the cases that break such a rule, using the token bounds the served spec
publishes under ``x-limits`` — so "valid data is accepted" stays a strict check. Use it from the CLI
with ``SCHEMATHESIS_HOOKS=gyrfalcon.contract schemathesis run …``.

With ``GYRFALCON_SCHEMA_MAX_TOKENS=N`` set, the ``before_call`` hook also caps the work a positive
case asks for (``N`` new tokens, :data:`MAX_CHOICES` choices), so a run takes minutes on a real model
on a CPU rather than hours
(`gyrfalcon check` and the fuzz campaign set it; long generations are what the semantic checks
cover, the schema phase covers the request space).
"""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis

from gyrfalcon.engine_api.lengths import request_work
from gyrfalcon.protocol.wire import without_nulls

#: slack added to every estimated prompt length (special tokens a tokenizer may add)
_SLACK = 2


def configure_schema(schema: Any, max_examples: int = 50) -> Any:
    """Positive and negative generation, every check on, no example database."""
    schema.config.generation.update(
        modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
        max_examples=max_examples,
        database="none",
    )
    return schema


def _text_tokens_bound(text: str) -> int:
    """Byte-level tokenizers give at most one token per UTF-8 byte."""
    return len(text.encode("utf-8", "surrogatepass")) + _SLACK


def _message_bound(message: dict[str, Any], chat: dict[str, int]) -> int:
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    extra = "".join(str(message.get(key) or "") for key in ("name", "tool_call_id", "reasoning_content"))
    calls = json.dumps(message.get("tool_calls") or "")  # templates render calls as JSON: twice, for their markup
    return (chat["per_message"] + _text_tokens_bound(str(message.get("role", ""))) + _text_tokens_bound(str(content))
            + _text_tokens_bound(extra) + 2 * _text_tokens_bound(calls))  # fmt: skip


#: message fields only one role may carry (the runtime rule message_fields_match_role)
_ROLE_ONLY = {"tool_calls": "assistant", "reasoning_content": "assistant", "tool_call_id": "tool"}


def _message_breaks_rule(message: Any) -> bool:
    """A schema-valid message the runtime rules refuse (fields of another role, arguments not JSON)."""
    if not isinstance(message, dict):
        return False
    role = message.get("role")
    if any(message.get(key) is not None and role != owner for key, owner in _ROLE_ONLY.items()):
        return True
    if (role == "tool" and message.get("tool_call_id") is None) or (role != "assistant" and message.get("content") is None):
        return True
    for call in message.get("tool_calls") or []:
        try:
            json.loads(call["function"]["arguments"])
        except (ValueError, TypeError, KeyError):
            return True
    return False


def _is_completions(path: str) -> bool:
    """The (text) completions route, not chat's, whose path also ends in ``/completions``."""
    return path.endswith("/completions") and "/chat/" not in path


def prompt_token_bounds(path: str, body: dict[str, Any], chat: dict[str, int]) -> list[int]:
    """An upper bound of the token count of every prompt (or conversation) in a request body."""
    if path.endswith("/generate"):
        return [len(body.get("token_ids", []))]
    if _is_completions(path):
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [_text_tokens_bound(prompt)]
        if prompt and isinstance(prompt[0], (int, float)):  # fuzzers send whole floats for integers
            return [len(prompt)]
        return [_text_tokens_bound(p) if isinstance(p, str) else len(p) for p in prompt or []]
    conversations = body.get("messages", [])
    if not path.endswith("/batch"):
        conversations = [conversations]
    return [chat["fixed"] + _tools_bound(body) + sum(_message_bound(m, chat) for m in conv if isinstance(m, dict))
            for conv in conversations]  # fmt: skip


def _may_tokenize_to_nothing(text: Any) -> bool:
    """A text prompt with no printable character: a tokenizer may drop all of it (SmolLM2's drops
    control characters), which the rule prompt_not_empty_after_tokenization refuses."""
    return isinstance(text, str) and not any(ch.isprintable() for ch in text)


def _constraint_breaks_rule(params: dict[str, Any]) -> bool:
    """A schema-valid constraint the server refuses (rule constraint_compiles)."""
    from gyrfalcon.errors import RequestError
    from gyrfalcon.structured.grammar import check

    constraint = params.get("structured_outputs")
    response_format = params.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") != "text":
        if constraint is not None:
            return True
        if response_format.get("type") == "json_schema":
            constraint = {"json": (response_format.get("json_schema") or {}).get("schema") or {}}
    if not isinstance(constraint, dict):
        return False
    try:
        check(constraint)
    except RequestError:
        return True
    return False


def _strings(value: Any):
    """Every string inside a JSON value (keys included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _needs_unspellable(params: dict[str, Any], unspellable: list[int]) -> bool:
    """A constraint whose text holds a character the vocabulary cannot spell (a byte no token holds,
    ``x-limits.unspellable_bytes``): it may leave no token (rule constraints_leave_a_token)."""
    if not unspellable or not _is_constrained(params):
        return False
    missing = set(unspellable)
    texts = _strings([params.get("structured_outputs"), params.get("response_format"), params.get("tools")])
    return any(not missing.isdisjoint(ch.encode("utf-8", "surrogatepass")) for text in texts for ch in set(text))


def _tools_break_rule(params: dict[str, Any]) -> bool:
    """Schema-valid tool fields the server refuses (rule tools_consistent)."""
    from gyrfalcon.errors import RequestError
    from gyrfalcon.structured.grammar import check
    from gyrfalcon.tools.parsers import BUILTIN_PARSERS

    tools = params.get("tools") or []
    choice = params.get("tool_choice")
    names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)]
    if choice not in (None, "none") and not tools:
        return True
    if len(set(names)) != len(names):
        return True
    if isinstance(choice, dict):
        if (choice.get("function") or {}).get("name") not in names:
            return True
        tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    elif choice != "required":
        return False
    if params.get("structured_outputs") is not None or _is_constrained({"response_format": params.get("response_format")}):
        return True
    try:
        for parser in BUILTIN_PARSERS.values():
            check({"grammar": parser.grammar(tools, True)})
    except RequestError:
        return True
    return False


def _is_constrained(params: dict[str, Any]) -> bool:
    """The request carries a grammar: structured_outputs, a response_format other than text, or a
    tool call it requires."""
    response_format = params.get("response_format")
    choice = params.get("tool_choice")
    return (
        params.get("structured_outputs") is not None
        or (isinstance(response_format, dict) and response_format.get("type") != "text")
        or (bool(params.get("tools")) and (choice == "required" or isinstance(choice, dict)))
    )


def _tools_bound(body: dict[str, Any]) -> int:
    """Tokens the tools may add to each conversation: rendered by the template, or described by a
    parser's instructions, with calls and results in its convention."""
    from gyrfalcon.tools.parsers import BUILTIN_PARSERS

    tools = body.get("tools")
    if not tools or body.get("tool_choice") == "none":
        return 0
    described = max(len(parser.instructions(tools)) for parser in BUILTIN_PARSERS.values())
    return 2 * _text_tokens_bound(json.dumps(tools)) + described + 64 * len(body.get("messages") or [])


def _responses_break_rule(body: dict[str, Any], limits: dict[str, Any]) -> bool:
    """A Responses request breaks a rule as the chat request it becomes does, or asks for what this
    server refuses by name (background, reasoning, hosted tools, …), or continues a response that
    is not stored (a 404)."""
    from gyrfalcon.errors import RequestError
    from gyrfalcon.protocol.responses import as_chat, refuse_unsupported

    values = without_nulls(body)
    if "input" not in values or values.get("previous_response_id") is not None:
        return True
    try:
        refuse_unsupported(values)
    except RequestError:
        return True
    chat, _ = as_chat(values, [])
    return breaks_runtime_rule("/v1/chat/completions", chat, limits)


def breaks_runtime_rule(path: str, body: Any, limits: dict[str, Any]) -> bool:
    """True when a schema-valid body may still break a runtime-only rule (context, min_tokens, sequences)."""
    if not isinstance(body, dict):
        return False
    if path == "/update_weights_from_disk":  # a path that exists here must also hold fitting weights
        return isinstance(body.get("model_path"), str) and os.path.exists(body["model_path"])
    if path.endswith("/responses"):
        return _responses_break_rule(body, limits)
    context = limits["max_model_len"]
    params = (body.get("sampling_params") or {}) if path.endswith("/generate") else body
    if not isinstance(params, dict):
        return False
    params = without_nulls(params)  # null is "not set"
    if params.get("continue_final_message") is True and params.get("add_generation_prompt") is not False:
        return True
    messages = body.get("messages") or []
    if path.endswith("/batch"):
        messages = [m for conversation in messages if isinstance(conversation, list) for m in conversation]
    if any(_message_breaks_rule(m) for m in messages):
        return True
    if _constraint_breaks_rule(params) or _tools_break_rule(params):
        return True
    if params.get("allowed_token_ids") and _is_constrained(params):
        return True  # constraints_leave_a_token: a grammar may need a token allowed_token_ids excludes
    if _needs_unspellable(params, limits.get("unspellable_bytes") or []):
        return True
    if _is_completions(path):
        prompt = body.get("prompt")
        texts = prompt if isinstance(prompt, list) else [prompt]
        if any(_may_tokenize_to_nothing(text) for text in texts):
            return True
    chat = limits["chat"] or {"fixed": 0, "per_message": 0}  # None: the server serves no chat
    prompts = prompt_token_bounds(path, body, chat)
    n = params.get("n", 1)
    max_seqs = limits.get("max_request_seqs")
    if max_seqs is not None and isinstance(n, (int, float)) and len(prompts) * n > max_seqs:
        return True
    kv = limits.get("kv_cache")
    work = 0.0
    for prompt in prompts:
        if _is_completions(path):
            max_tokens = params.get("max_tokens", 16)
        else:
            max_tokens = params.get("max_completion_tokens", params.get("max_tokens", context - prompt))
        if prompt + max(max_tokens, 1) > context or params.get("min_tokens", 0) > max_tokens:
            return True
        if kv and isinstance(n, (int, float)) and n * -(-(prompt + max_tokens) // kv["block_size"]) > kv["blocks"]:
            return True
        if isinstance(n, (int, float)):
            # an omitted max_tokens that means "up to the context" counts as the whole context (the
            # prompt's bound above may be below its real length)
            up_to_context = not _is_completions(path) and "max_tokens" not in params and "max_completion_tokens" not in params
            work += request_work(n, context if up_to_context else max_tokens, _logprob_entries(params))
    return bool(limits.get("max_request_tokens")) and work > limits["max_request_tokens"]


def _logprob_entries(params: dict[str, Any]) -> int:
    """The most logprob entries a position of this request may report (top ones and asked ids)."""
    top = params.get("top_logprobs", 0)
    asked = params.get("logprobs", 0)
    ids = params.get("logprob_token_ids") or []
    return sum(int(v) for v in (top, asked) if _number(v)) + (len(ids) if isinstance(ids, list) else 0)


@schemathesis.hook
def filter_case(context: Any, case: Any) -> bool:
    """Keep every negative case; drop positive cases that a runtime-only rule refuses."""
    meta = getattr(case, "meta", None)
    if meta is None or meta.generation.mode != schemathesis.GenerationMode.POSITIVE:
        return True
    limits = case.operation.schema.raw_schema.get("x-limits")
    if not limits or case.operation.method.upper() != "POST":
        return True
    return not breaks_runtime_rule(case.operation.path, case.body, limits)


MAX_TOKENS_ENV = "GYRFALCON_SCHEMA_MAX_TOKENS"
#: choices per valid case while capped (the semantic checks cover large n)
MAX_CHOICES = 2
_FIELDS = ("max_tokens", "max_completion_tokens")


def _number(value: Any) -> bool:
    """An integer or a float (fuzzers send whole floats for integers), not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def cap_tokens(params: dict[str, Any], cap: int, absent_means_context: bool, fields: tuple[str, ...] = _FIELDS) -> None:
    """At most ``cap`` new tokens (never below ``min_tokens``; set where leaving it out means up to
    the context: chat, batch chat, generate, responses) and :data:`MAX_CHOICES` choices."""
    least = params.get("min_tokens")
    limit = max(cap, int(least) if _number(least) else 0)
    present = [name for name in fields if params.get(name) is not None]
    if not present and absent_means_context:
        params[fields[0]] = limit
    for name in present:
        if _number(params[name]) and params[name] > limit:
            params[name] = limit
    if _number(params.get("n")) and params["n"] > MAX_CHOICES:
        params["n"] = MAX_CHOICES


@schemathesis.hook
def before_call(context: Any, case: Any, **kwargs: Any) -> None:
    """Cap a positive case's tokens (negative cases go out as generated)."""
    meta = getattr(case, "meta", None)
    cap = int(os.environ.get(MAX_TOKENS_ENV, "0") or 0)
    if cap <= 0 or meta is None or meta.generation.mode != schemathesis.GenerationMode.POSITIVE:
        return
    path, body = case.operation.path, case.body
    if not isinstance(body, dict):
        return
    if path.endswith("/generate"):
        if body.get("sampling_params") is None:
            body["sampling_params"] = {}  # null is "not set": the same request
        cap_tokens(body["sampling_params"], cap, absent_means_context=True)
    elif path.endswith(("/completions", "/batch")):
        cap_tokens(body, cap, absent_means_context="/chat/" in path)
    elif path.endswith("/responses"):
        cap_tokens(body, cap, absent_means_context=True, fields=("max_output_tokens",))
