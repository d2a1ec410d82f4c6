"""The one boundary where generated wire models become internal requests.

``Translator.translate(endpoint, body, header_request_id)`` (an :class:`Endpoint` of
:mod:`gyrfalcon.protocol.endpoints`, or its name) runs, in order: strict schema validation (the
generated model; the plugins' extensions by their schemas), the documents' cross-field rules, the
"not supported" check, the model name, the deployment's limits, the tools, the prompts (rendered
by :mod:`gyrfalcon.protocol.chat` on the chat endpoints), the sampling parameters and constraint,
one engine request per prompt with its ``max_tokens`` resolved, then
:class:`gyrfalcon.validation.RequestValidator`, which decides whether each fits the context (and
``min_tokens``, the policies' own parameters, the plugins' ``gyrfalcon_validate_request``).
Every refusal is a :class:`RequestError` naming its ``param`` as the client wrote it
(:class:`~gyrfalcon.protocol.requests.WireNames`).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import jsonschema

from gyrfalcon.engine_api.interface import Engine
from gyrfalcon.engine_api.lengths import sampling_work, work_message
from gyrfalcon.engine_api.types import EngineInfo, EngineRequest, OutputKind, SamplingParams
from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.protocol.capabilities import wire_asks
from gyrfalcon.protocol.chat import ChatRenderer, ChatRendering
from gyrfalcon.protocol.endpoints import DETOKENIZE, GENERATE, TOKENIZE, Endpoint, Prompts, endpoint_of
from gyrfalcon.protocol.requests import ServingRequest, ToolUse, WireNames, max_tokens_field, wire_names
from gyrfalcon.protocol.responses import as_chat, input_items, refuse_unsupported
from gyrfalcon.protocol.rules import RequestFields, check_stated_rules
from gyrfalcon.protocol.tools import structured_constraint, tool_constraint, tool_use
from gyrfalcon.engine_api.limits import ServedLimits, largest_object, limits_of, longest_array
from gyrfalcon.openapi.served import fields_stating, spec_max
from gyrfalcon.protocol.wire import check_key_patterns, check_text_length, parse_json, sent_fields, validate
from gyrfalcon.validation import RequestValidator

#: wire fields copied as they are into SamplingParams
_COPIED = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "stop_token_ids", "ignore_eos",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "allowed_token_ids", "bad_words",
    "prompt_logprobs", "logprob_token_ids", "detokenize",
)


#: request fields (objects) and the most entries each may hold
MAX_PROPERTIES: dict[str, int] = fields_stating("maxProperties")
#: request fields (arrays) whose items must be distinct
UNIQUE_ITEMS = frozenset(name for name, unique in fields_stating("uniqueItems").items() if unique)


SPEC_MAX_ITEMS = spec_max("maxItems")
SPEC_MAX_PROPERTIES = spec_max("maxProperties")

#: OpenAI request fields that change nothing in the output: accepted and recorded (access log)
RECORDED_FIELDS = ("metadata", "service_tier", "safety_identifier", "prompt_cache_key")


class Translator:
    """Turns request bodies into :class:`ServingRequest` objects for one engine."""

    def __init__(
        self,
        engine: Engine,
        served_model_names: list[str],
        extension_schemas: dict[str, dict[str, Any]],
        validator: RequestValidator | None = None,
        max_prompts: int | None = None,
        max_seqs: int | None = None,
        tool_parser: Any = None,
        max_work: int | None = None,
        weight_versions: bool = False,
    ) -> None:
        self.engine = engine
        #: answers say which weights made which tokens (:attr:`ServingRequest.weight_versions`)
        self.weight_versions = weight_versions
        #: the convention tool calls are written in (gyrfalcon.tools.parsers), None: no tools
        self.tool_parser = tool_parser
        self.chat = ChatRenderer(engine)
        #: most sequences (prompts × n) in one request
        self.max_seqs = max_seqs
        #: most work (:func:`~gyrfalcon.engine_api.lengths.request_work`, summed) one request may ask for
        self.max_work = max_work
        self.info: EngineInfo = engine.info()
        self.served_model_names = served_model_names
        self._extensions = jsonschema.Draft202012Validator(
            {"type": "object", "properties": extension_schemas, "additionalProperties": False}
        )
        #: every rule of the engine requests made here (the one validation point)
        self.validator = validator or RequestValidator(self.info)
        #: the bounds the served spec states, enforced by the same table (gyrfalcon.openapi.limits)
        self.limits = ServedLimits(
            model_names=served_model_names, vocab_size=self.info.vocab_size, max_model_len=self.info.max_model_len,
            max_request_seqs=max_seqs or self.info.max_request_seqs, max_logprobs=self.info.max_logprobs,
            max_prompts=max_prompts,
        )  # fmt: skip
        #: the longest array any request may hold here: longer ones are refused before the body is walked
        self.max_array_items = longest_array(self.limits, SPEC_MAX_ITEMS)
        #: the most keys any request object may hold here: larger ones are refused before the body is walked
        self.max_object_keys = largest_object(self.limits, SPEC_MAX_PROPERTIES)

    # ------------------------------------------------------------------ steps
    def parse(self, raw: bytes) -> Any:
        """A body's bytes as JSON (a 400 when malformed, or with an array or object beyond any field's here)."""
        return parse_json(raw, self.max_array_items, self.max_object_keys)

    def translate(self, endpoint: Endpoint | str, body: Any, header_request_id: str | None = None,
                  history: list[dict[str, Any]] | None = None) -> ServingRequest:  # fmt: skip
        """The :class:`ServingRequest` of a request ``body`` sent to ``endpoint`` (or its name);
        ``history``: the stored turns a Responses request continues (``previous_response_id``)."""
        endpoint = endpoint_of(endpoint)
        if not isinstance(body, dict):
            raise RequestError("The request body must be a JSON object", None)
        body = dict(body)
        raw_extensions = body.pop("extensions", None)
        check_key_patterns(endpoint.nested_body(body), endpoint.key_patterns, endpoint.nested)
        wire = validate(endpoint.wire_model, body)  # schema errors first, extensions' included
        sent = sent_fields(wire)
        if raw_extensions is not None:
            sent["extensions"] = self._check_extensions(raw_extensions)
        if not endpoint.as_chat:
            return self._translate(endpoint, sent, body, header_request_id)
        check_stated_rules(endpoint, sent)  # its own, as written; chat's on the chat request it becomes
        refuse_unsupported(sent)
        chat, names = as_chat(sent, history or [])
        raw, _ = as_chat(body, history or [])
        try:
            serving = self._translate(endpoint, chat, raw, header_request_id)
        except RequestError as exc:
            exc.param = names(exc.param)
            raise
        serving.wire_names = dataclasses.replace(serving.wire_names, names=names)
        serving.history = list(history or [])
        serving.input_turns = [m for m, (origin, _) in zip(chat["messages"], names.messages) if origin == "input"]
        serving.response_fields = {k: v for k, v in sent.items() if k != "input"}
        serving.input_items = input_items(sent, lambda prefix: f"{prefix}_{uuid.uuid4().hex}")
        return serving

    def _translate(self, endpoint: Endpoint, sent: dict[str, Any], body: dict[str, Any],
                   header_request_id: str | None) -> ServingRequest:  # fmt: skip
        fields = RequestFields.from_body(endpoint, sent)
        check_stated_rules(endpoint, sent, as_sent=not endpoint.as_chat)
        self.validator.check_supported(wire_asks(fields, endpoint.defaults))
        model = self._model_name(fields.get("model"))
        self._check_limits(fields)
        if endpoint is GENERATE:
            _check_logprob_ids(fields)
        external_id = header_request_id or fields.get("request_id")
        # a stored response's id is always the server's: a client's id could name (and so replace)
        # another's stored response; the client's id is recorded (the access log) instead
        response_id = endpoint.response_id(uuid.uuid4().hex if endpoint.stored or not external_id else external_id)
        tools = tool_use(fields, body, self.tool_parser) if endpoint.chat else None
        prompts, prompt_texts, prompt_param = self._prompts(fields, tools)
        sampling = self._sampling(fields)
        sampling.structured_outputs = tool_constraint(tools, fields, structured_constraint(fields, body))
        if self.max_seqs is not None and len(prompts) * sampling.n > self.max_seqs:
            raise fields.error("n", f"{len(prompts)} prompts x n={sampling.n} asks for more than the {self.max_seqs} "
                                    "sequences one request may have")  # fmt: skip
        names, lora = wire_names(fields), None if model in self.served_model_names else model
        requests = self._engine_requests(fields, response_id, prompts, sampling, names, lora)
        self._check_work(fields, requests, prompt_param)
        serving = self._serving_request(fields, model, response_id, requests, prompt_texts, tools, names)
        if endpoint.stored and external_id:
            serving.recorded["request_id"] = external_id
        return serving

    def _engine_requests(self, fields: RequestFields, response_id: str, prompts: list[list[int]], sampling: SamplingParams,
                         names: WireNames, lora: str | None) -> list[EngineRequest]:  # fmt: skip
        """One engine request per prompt (its own ``max_tokens``; LoRA adapter ``lora``), checked by the validator."""
        kind = OutputKind.DELTA if fields.get("stream", False) else OutputKind.FINAL_ONLY
        requests = [
            EngineRequest(
                request_id=f"{response_id}-{i}-{uuid.uuid4().hex[:8]}",
                prompt_token_ids=prompt,
                sampling=self._with_max_tokens(fields, sampling, len(prompt)),
                output_kind=kind,
                extensions=dict(fields.get("extensions") or {}),
                cache_salt=fields.get("cache_salt"),
                priority=fields.get("priority", 0),
                group_id=response_id,
                lora_name=lora,
            )
            for i, prompt in enumerate(prompts)
        ]
        try:
            for request in requests:
                submitted = not _answered_without_the_engine(fields, request.sampling)
                self.validator.check(request, fields.endpoint.name, submitted=submitted, bounds_decided=True)
        except RequestError as exc:
            exc.param = names(exc.param)
            raise
        return requests

    def _check_work(self, f: RequestFields, requests: list[EngineRequest], prompt_param: str) -> None:
        """Refuse a request whose prompts × n × max_tokens (logprobs counted) exceed ``max_work``,
        naming the field the client can lower: the token limit it set, else ``n``, else the prompts."""
        if self.max_work is None:
            return
        work = sum(sampling_work(r.sampling) for r in requests)
        if work > self.max_work:
            param = max_tokens_field(f) or ("n" if requests[0].sampling.n > 1 else prompt_param)
            raise RequestError(work_message(work, self.max_work), f.param(param))

    def _serving_request(self, fields: RequestFields, model: str, response_id: str, requests: list[EngineRequest],
                         prompt_texts: list[str], tools: ToolUse | None, names: WireNames) -> ServingRequest:  # fmt: skip
        """How the engine requests' outputs are presented."""
        sampling = requests[0].sampling
        stream_options = fields.get("stream_options") or {}
        echo = bool(fields.get("echo", False))
        prompt_only = _answered_without_the_engine(fields, sampling)
        if prompt_only:
            self._model_name(model, answered_here=True)
        return ServingRequest(
            endpoint=fields.endpoint,
            model=model,
            response_id=response_id,
            requests=requests,
            n=sampling.n,
            stream=bool(fields.get("stream", False)),
            include_usage=bool(stream_options.get("include_usage", False)),
            # vLLM: usage on every chunk only when the usage chunk is asked for too
            continuous_usage=bool(stream_options.get("include_usage")) and bool(stream_options.get("continuous_usage_stats")),
            echo=echo,
            prompt_texts=prompt_texts,
            wire_names=names,
            return_token_ids=bool(fields.get("return_token_ids", False)),
            return_tokens_as_token_ids=bool(fields.get("return_tokens_as_token_ids", False)),
            logprobs=fields.get("logprobs"),
            user=fields.get("user"),
            recorded={name: fields.get(name) for name in RECORDED_FIELDS if fields.has(name)},
            prompt_only=prompt_only,
            prompt_logprobs=fields.get("prompt_logprobs"),
            tools=tools,
            weight_versions=self.weight_versions,
        )

    def _check_extensions(self, extensions: Any) -> dict[str, Any]:
        error = next(iter(self._extensions.iter_errors(extensions)), None)
        if error is not None:
            path = ".".join(str(p) for p in error.absolute_path)
            param = f"extensions.{path}" if path else "extensions"
            raise RequestError(f"Invalid value for '{param}': {error.message}", param)
        return extensions

    def _model_name(self, requested: str | None, answered_here: bool = False) -> str:
        """The model named (else the first served name); with LoRA, another name is an adapter's,
        which the engine decides at submit or, for what it never sees (``answered_here``), here."""
        if requested is None or requested in self.served_model_names or ("lora" in self.info.capabilities and (
                not answered_here or requested in dict(self.engine.lora_adapters()))):  # fmt: skip
            return self.served_model_names[0] if requested is None else requested
        raise RequestError(f"The model '{requested}' does not exist", "model", type=Kind.NOT_FOUND)

    def _check_limits(self, f: RequestFields) -> None:
        """The deployment limits laid over the served spec (one table), and the bounds the generated
        models do not enforce (maxProperties, uniqueItems)."""
        for name, value in f.values.items():
            self._check_field(name, value, f.param(name))
        for name, most in MAX_PROPERTIES.items():
            if len(f.get(name) or ()) > most:
                raise f.error(name, f"'{name}' holds at most {most} entries")
        for name in UNIQUE_ITEMS:
            items = f.get(name) or []
            if len(set(map(repr, items))) != len(items):
                raise f.error(name, f"'{name}' must not repeat an item")

    def _check_field(self, name: str, value: Any, param: str) -> None:
        for limit in limits_of(name):
            refused = limit.check(value, self.limits, param)
            if refused is not None:
                raise RequestError(refused[1], refused[0])

    # ------------------------------------------------------------------ prompts
    def _prompts(self, f: RequestFields, tools: ToolUse | None = None) -> tuple[list[list[int]], list[str], str]:
        """Token ids of every prompt, their texts (for echo), and the prompt's param name."""
        given, name = f.endpoint.prompts, f.endpoint.prompt_param
        if given is Prompts.TOKEN_IDS:
            return [f.get(name)], [], name
        if given is Prompts.TEXT_OR_IDS:
            return self._completion_prompts(f.get(name))
        batch = given is Prompts.CONVERSATIONS
        conversations = f.get(name) if batch else [f.get(name)]
        for i, messages in enumerate(conversations):
            self._check_text_length(messages, f"{name}.{i}" if batch else name)
        options = ChatRendering.of(f)
        prompts = [self.chat.render(messages, options, f"{name}.{i}" if batch else name, tools)
                   for i, messages in enumerate(conversations)]  # fmt: skip
        echoed = [options.echoed(messages) for messages in conversations] if f.get("echo") is True else []
        return prompts, echoed, name

    @property
    def max_text_chars(self) -> int | None:
        """The longest text a prompt may have here: the context times the most characters a token
        spells (None: unknown, no bound); the served spec states it (``x-limits.max_text_chars``)."""
        longest = self.engine.longest_token_chars()
        return self.info.max_model_len * longest if longest else None

    def _check_text_length(self, value: Any, param: str) -> None:
        """Refuse a text that cannot fit the context before tokenizing it (:func:`check_text_length`)."""
        bound = self.max_text_chars
        if bound:
            check_text_length(value, param, bound, self.info.max_model_len)

    # ------------------------------------------------------------------ tokenize / detokenize
    def tokenize(self, body: Any) -> tuple[list[int], list[str] | None]:
        """``POST /tokenize``: the token ids of a prompt (as completions tokenize it) or of messages
        (as chat renders them), and their strings when ``return_token_strs`` asks (else None)."""
        model = TOKENIZE.model_of(body)
        chat = model is TOKENIZE.chat_model
        sent = sent_fields(validate(model, body))
        self._model_name(sent.get("model"), answered_here=True)
        if chat:
            self._check_text_length(sent["messages"], "messages")
            ids = self.chat.render(sent["messages"], ChatRendering(sent.get("add_generation_prompt", True)), "messages")
        else:
            self._check_text_length(sent["prompt"], "prompt")
            ids = self.engine.tokenize(sent["prompt"], add_special_tokens=sent.get("add_special_tokens", True))
        return ids, self.engine.token_pieces(ids) if sent.get("return_token_strs") else None

    def detokenize(self, body: Any) -> str:
        """``POST /detokenize``: the text of token ids inside the vocabulary."""
        sent = sent_fields(validate(DETOKENIZE.model_of(body), body))
        self._model_name(sent.get("model"), answered_here=True)
        self._check_field("tokens", sent["tokens"], "tokens")
        return self.engine.detokenize(sent["tokens"])

    def _completion_prompts(self, prompt: Any) -> tuple[list[list[int]], list[str], str]:
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        ids, texts = [], []
        for i, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt.{i}"
            if isinstance(item, str):
                self._check_text_length(item, param)
                tokens = self.engine.tokenize(item, add_special_tokens=True)
                text = item
            else:  # ids inside the vocabulary: checked with the field's limits
                tokens, text = list(item), self.engine.detokenize(item)
            if not tokens:
                raise RequestError("The prompt is empty after tokenization", param)
            ids.append(tokens)
            texts.append(text)
        return ids, texts, "prompt"

    # ------------------------------------------------------------------ sampling
    def _sampling(self, f: RequestFields) -> SamplingParams:
        # the model's defaults (generation config) for the fields the client left unset
        defaults = {k: v for k, v in self.info.default_sampling.items() if k != "max_tokens"}
        params = SamplingParams(**{**defaults, **{name: f.get(name) for name in _COPIED if f.has(name)}})
        if params.top_k == 0:
            params.top_k = -1
        stop = f.get("stop")
        if stop is not None:
            params.stop = [stop] if isinstance(stop, str) else list(stop)
        if f.has("logit_bias"):
            params.logit_bias = {int(k): float(v) for k, v in f.get("logit_bias").items()}
        logprobs = f.get("logprobs")
        if f.endpoint.chat_logprobs:
            if logprobs is True:
                params.logprobs = f.get("top_logprobs", 0)
        elif logprobs is not None:
            params.logprobs = logprobs
            if f.get("echo") is True:
                # echo with logprobs reports the prompt positions too: gather them at the prefill
                # (the wider of the two counts; the formatter shows each its own)
                params.prompt_logprobs = max(logprobs, params.prompt_logprobs or 0)
        return params

    def _with_max_tokens(self, f: RequestFields, sampling: SamplingParams, prompt_len: int) -> SamplingParams:
        """``sampling`` with ``max_tokens`` resolved for one prompt: the client's (see
        :func:`~gyrfalcon.protocol.requests.max_tokens_field`), else the endpoint's default, else
        what the context leaves after the prompt, capped by the model's own ``max_new_tokens``.
        Whether it fits is the validator's."""
        name = max_tokens_field(f)
        max_tokens = (f.get(name) if name is not None else f.endpoint.default_max_tokens
                      if f.endpoint.default_max_tokens is not None else self.info.max_model_len - prompt_len)  # fmt: skip
        if name is None and "max_tokens" in self.info.default_sampling:  # the model's max_new_tokens caps it
            max_tokens = min(max_tokens, self.info.default_sampling["max_tokens"])
        return dataclasses.replace(sampling, max_tokens=max_tokens)


def _check_logprob_ids(f: RequestFields) -> None:
    """Generate's sampling params as vLLM's engine takes them: with both set, ``logprobs`` must be
    the number of ``logprob_token_ids`` (elsewhere the ids replace the count)."""
    ids, count = f.get("logprob_token_ids"), f.get("logprobs")
    if ids and count is not None and count != len(ids):
        raise f.error("logprob_token_ids", f"When both logprobs and logprob_token_ids are set, logprobs must equal "
                                           f"the number of ids: logprobs={count}, {len(ids)} ids")  # fmt: skip


def _answered_without_the_engine(f: RequestFields, sampling: SamplingParams) -> bool:
    """A completion that echoes its prompt and generates nothing (``max_tokens: 0``, no prompt
    logprobs): the prompt is the answer, and no engine request is submitted."""
    return bool(f.endpoint.echoes_prompt_alone and f.get("echo", False) and sampling.max_tokens == 0
                and sampling.prompt_logprobs is None)  # fmt: skip
