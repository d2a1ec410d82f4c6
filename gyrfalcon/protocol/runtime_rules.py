"""The rules only the running server can check, by id: what ``x-runtime-rules`` in the served spec says.

JSON Schema states a field's type, range and the cross-field rules written as ``x-rule`` if/then
blocks, evaluated from the documents (:mod:`gyrfalcon.protocol.rules`); the rules here need what only a running server
knows — the resolved ``max_tokens``, the tokenizer and the chat template, the vocabulary, the KV
cache, the stored responses. Each :class:`RuntimeRule` holds its id, the ``param`` its 400 names,
the text clients read, its home (the function that decides it) and when it is checked. A test
imports every home, and ``tests/api/test_every_rule.py`` breaks every rule over HTTP. The served
spec's table is made from this registry (:func:`served_table`): a rule's text is written once,
beside its id and its home.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeRule:
    """One runtime rule (see the module docstring)."""

    id: str
    #: the request field its 400 names (``<field>``: the offending one, whichever it is)
    param: str
    description: str
    #: ``module:qualified name`` of what decides it
    home: str
    #: when it is checked: ``translation`` (the API side, before submitting), ``engine`` (at submit),
    #: ``generation`` (while generating: an in-band error after the first token) or ``store`` (the
    #: stored responses)
    stage: str = "translation"

    def served(self) -> dict[str, str]:
        """The rule as ``x-runtime-rules`` lists it."""
        return {"id": self.id, "param": self.param, "description": self.description}


#: Every runtime rule, in the order a request meets them (the served spec lists them so): the
#: stored turns it continues, then the API side's translation and validation, the engine's submit,
#: generation. The deployment's bounds (``FIELD_LIMITS``) are met in the order of the endpoint's
#: fields.
RUNTIME_RULES: tuple[RuntimeRule, ...] = (
    RuntimeRule(
        "previous_response_stored",
        "previous_response_id",
        "previous_response_id names a response this server stores (stored with store true, not deleted, "
        "within x-limits responses_store: size and ttl_s); else a 404 naming it, which says when the "
        "response was evicted.",
        "gyrfalcon.api.response_store:ResponseStore._row",
        stage="store",
    ),
    RuntimeRule(
        "extensions_valid",
        "extensions",
        "Each extensions property is validated by the plugin that declared it.",
        "gyrfalcon.protocol.translate:Translator._check_extensions",
    ),
    RuntimeRule(
        "background_stored_not_streamed",
        "background",
        "background true needs store true (param background) and stream false (param stream).",
        "gyrfalcon.protocol.responses:refuse_unsupported",
    ),
    RuntimeRule(
        "responses_supported",
        "<field>",
        "On /v1/responses, reasoning (no reasoning template), truncation auto, hosted tools (param "
        "tools.<i>.type) and every include but message.output_text.logprobs (param include.<i>) are "
        "refused.",
        "gyrfalcon.protocol.responses:refuse_unsupported",
    ),
    RuntimeRule(
        "field_supported",
        "<field>",
        "A field the engine cannot honour is rejected unless it holds its wire default (const/not in the "
        "served spec); checked after schema and cross-field rules.",
        "gyrfalcon.validation:RequestValidator.check_supported",
    ),
    RuntimeRule(
        "model_served",
        "model",
        "model, when given, is a served model name, or with --enable-lora a loaded LoRA adapter's (which the "
        "engine decides at submit; for tokenize, detokenize and an echo of the prompt alone, the engine's "
        "adapters are asked); 404 otherwise. The served spec's enum lists the names without --enable-lora.",
        "gyrfalcon.protocol.translate:Translator._model_name",
    ),
    RuntimeRule(
        "logprobs_le_max_logprobs",
        "logprobs",
        "logprobs, top_logprobs and prompt_logprobs <= the server's max_logprobs (stated in the served "
        "spec as maximum); param names the field.",
        "gyrfalcon.engine_api.limits:FIELD_LIMITS",
    ),
    RuntimeRule(
        "logit_bias_ids_in_vocab",
        "logit_bias",
        "Every logit_bias key is a token id below the vocabulary size (the served spec also narrows its "
        "propertyNames pattern).",
        "gyrfalcon.engine_api.limits:FIELD_LIMITS",
    ),
    RuntimeRule(
        "token_ids_in_vocab",
        "token_ids",
        "Every token id (token_ids, prompt ids, stop_token_ids, allowed_token_ids, logprob_token_ids) is "
        "below the vocabulary size; param names the field. Stated in the served spec as maximum, enforced"
        " in code because the generated models carry no deployment limits.",
        "gyrfalcon.engine_api.limits:FIELD_LIMITS",
    ),
    RuntimeRule(
        "logprob_token_ids_unique",
        "logprob_token_ids",
        "No duplicate ids (uniqueItems in the spec; the generated models do not check it).",
        "gyrfalcon.protocol.translate:Translator._check_limits",
    ),
    RuntimeRule(
        "generate_logprobs_count_ids",
        "logprob_token_ids",
        "generate: when sampling_params sets both logprobs and logprob_token_ids, logprobs equals the number of "
        "ids (vLLM's engine rule; on the other endpoints the ids replace the count).",
        "gyrfalcon.protocol.translate:_check_logprob_ids",
    ),
    RuntimeRule(
        "tools_consistent",
        "tool_choice",
        "tool_choice other than none needs tools; a named function must be among them; tool names are "
        "distinct (param tools); required or a named function cannot join response_format or "
        "structured_outputs, and the called tools' parameters schemas must compile (param tools); every "
        "tool's parameters is a valid JSON Schema (its draft's meta-schema, 2020-12 by default), whatever"
        " tool_choice is (param tools.<i>.function.parameters).",
        "gyrfalcon.protocol.tools:tool_use",
    ),
    RuntimeRule(
        "continue_final_message_alone",
        "continue_final_message",
        "continue_final_message: true needs add_generation_prompt: false (vLLM's rule).",
        "gyrfalcon.protocol.chat:ChatRendering.of",
    ),
    RuntimeRule(
        "message_fields_match_role",
        "messages",
        "content is required except on assistant turns; tool_calls and reasoning_content belong to "
        "assistant turns; tool_call_id is required on tool turns and only there. param names the message "
        "field (messages.<i>.<field>).",
        "gyrfalcon.protocol.chat:template_message",
    ),
    RuntimeRule(
        "tool_call_arguments_json",
        "messages",
        "A tool call's function.arguments is a JSON text (the template receives it parsed).",
        "gyrfalcon.protocol.chat:_template_tool_call",
    ),
    RuntimeRule(
        "chat_template_renders",
        "messages",
        "The model's chat template renders the conversation (e.g. role order it accepts).",
        "gyrfalcon.protocol.chat:ChatRenderer.render",
    ),
    RuntimeRule(
        "message_name_rendered",
        "messages",
        "A message name is refused when the model's chat template does not render it (it would be "
        "accepted and ignored).",
        "gyrfalcon.protocol.chat:ChatRenderer.render",
    ),
    RuntimeRule(
        "message_tool_calls_rendered",
        "messages",
        "Assistant tool_calls are refused when the model's chat template does not render them (they would"
        " be ignored); the served spec then states tool_calls as null.",
        "gyrfalcon.protocol.chat:ChatRenderer.render",
    ),
    RuntimeRule(
        "prompt_not_empty_after_tokenization",
        "prompt",
        "A non-empty prompt string must tokenize to at least one token (byte-level tokenizers always do; "
        "others may drop some text).",
        "gyrfalcon.protocol.translate:Translator._completion_prompts",
    ),
    RuntimeRule(
        "request_seqs_le_limit",
        "n",
        "prompts (or conversations) x n <= the server's max_request_seqs (x-limits), so that one request "
        "cannot hold the server for long.",
        "gyrfalcon.protocol.translate:Translator._translate",
    ),
    RuntimeRule(
        "prompt_fits_context",
        "prompt",
        "prompt tokens + max_tokens <= max_model_len. param is the prompt field of the endpoint: "
        "token_ids (generate), prompt (completions), messages (chat, batch chat). An omitted max_tokens "
        "on chat, batch chat and generate means up to the context, so there the prompt alone must leave "
        "room for one token.",
        "gyrfalcon.engine_api.lengths:context_overflow",
    ),
    RuntimeRule(
        "min_tokens_le_max_tokens",
        "min_tokens",
        "min_tokens must not exceed the effective max_tokens (max_completion_tokens on chat wins over "
        "max_tokens; completions default 16).",
        "gyrfalcon.engine_api.lengths:min_tokens_problem",
    ),
    RuntimeRule(
        "constraint_compiles",
        "structured_outputs",
        "A structured_outputs constraint sets exactly one kind, not together with a response_format other"
        " than text, and its JSON schema, regex or grammar compiles; param names the field "
        "(structured_outputs.<kind>, or response_format.json_schema.schema).",
        "gyrfalcon.structured.grammar:check",
    ),
    RuntimeRule(
        "request_tokens_le_limit",
        "max_tokens",
        "The sum over prompts of n x max_tokens (the resolved one), each token with logprobs counting "
        "1 + (top logprobs + logprob_token_ids)/20, is at most the server's max_request_tokens (x-limits; "
        "default twice max_num_seqs x max_model_len), so that one request cannot hold the server for "
        "long; param is the token limit the client set, else n (when above 1), else the prompt field.",
        "gyrfalcon.protocol.translate:Translator._check_work",
    ),
    RuntimeRule(
        "model_path_fits",
        "model_path",
        "POST /update_weights_from_disk: model_path is a model folder (or .gguf file) on the server whose weights "
        "have the served model's tensors, each of the same name, shape and dtype (404 for a path that does not "
        "exist).",
        "gyrfalcon.engine.weights:stage",
        "engine",
    ),
    RuntimeRule(
        "lora_adapter_serves",
        "lora_path",
        "POST /v1/load_lora_adapter: lora_path is a PEFT LoRA folder on the server (404 when it does not exist) "
        "whose factors fit the served model's attention and MLP projections, at one rank up to --max-lora-rank, "
        "with no bias, DoRA, modules_to_save or per-module rank or alpha.",
        "gyrfalcon.engine.lora.peft:read_adapter",
        "engine",
    ),
    RuntimeRule(
        "lora_name_free",
        "lora_name",
        "POST /v1/load_lora_adapter: no adapter of that name is loaded (unless load_inplace); POST "
        "/v1/unload_lora_adapter names one that is (404 otherwise).",
        "gyrfalcon.engine.lora.registry:LoraRegistry._check_name",
        "engine",
    ),
    RuntimeRule(
        "request_fits_kv_cache",
        "max_tokens",
        "n x (prompt + max_tokens), in whole blocks, fits the server's KV cache (x-limits kv_cache), so "
        "that the request can run even alone; param is the prompt field when the prompt alone does not "
        "fit.",
        "gyrfalcon.engine.scheduler:Scheduler.check_fits",
        stage="engine",
    ),
    RuntimeRule(
        "constraints_leave_a_token",
        "structured_outputs",
        "The request's token-excluding constraints together (structured_outputs, response_format or a "
        "required tool call; allowed_token_ids; bad_words; min_tokens) leave at least one token at every "
        "step. Whether they do is known only while generating: a row left with no token ends with a 400 "
        "naming the most specific of them (in band when it is not the first token). A constraint holding "
        "a character with a byte no token holds (x-limits unspellable_bytes) may meet this rule.",
        "gyrfalcon.engine.sample.sampler:excluded_error",
        stage="generation",
    ),
)

def served_table() -> list[dict[str, str]]:
    """``x-runtime-rules``: every rule's id, param and description."""
    return [rule.served() for rule in RUNTIME_RULES]


def translation_rule_ids() -> tuple[str, ...]:
    """The ids of the rules checked while a request is translated."""
    return tuple(rule.id for rule in RUNTIME_RULES if rule.stage == "translation")
