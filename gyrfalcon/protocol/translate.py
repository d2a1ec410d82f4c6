"""The one boundary where generated wire models become internal requests.

``Translator.translate(endpoint, body, header_request_id)`` runs, in order: extension validation,
strict schema validation (generated model), cross-field rules, the "not supported" check, model
lookup, prompt building and limits, then the plugins' ``gyrfalcon_validate_request``. Every refusal
is a :class:`RequestError` naming its ``param``.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

import jsonschema
import orjson
import pydantic
import pydantic_core

from gyrfalcon import generated
from gyrfalcon.engine_api.interface import Engine
from gyrfalcon.engine_api.types import EngineInfo, EngineRequest, OutputKind, SamplingParams
from gyrfalcon.errors import RequestError
from gyrfalcon.protocol.capabilities import check_supported
from gyrfalcon.protocol.requests import ServingRequest, ToolUse
from gyrfalcon.protocol.rules import RequestFields, check_rules
from gyrfalcon.protocol.tools import tool_constraint, tool_use, with_instructions
from gyrfalcon.openapi.limits import ServedLimits, limits_of, longest_array, walk_schemas
from gyrfalcon.openapi.served import bundle, request_schema_names
from gyrfalcon.protocol.wire import sent_fields, validate

#: the generated model of each endpoint's request body
WIRE_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "generate": generated.GenerateRequest,
    "completions": generated.CompletionRequest,
    "chat": generated.ChatCompletionRequest,
    "chat_batch": generated.BatchChatCompletionRequest,
}

RESPONSE_ID_PREFIX = {"generate": "generate-tokens", "completions": "cmpl", "chat": "chatcmpl", "chat_batch": "chatcmpl"}

#: wire fields copied as they are into SamplingParams
_COPIED = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "stop_token_ids", "ignore_eos",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "allowed_token_ids", "bad_words",
    "prompt_logprobs", "logprob_token_ids", "detokenize",
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16

def _max_properties() -> dict[str, int]:
    """``maxProperties`` of the request fields that state one in the spec (the generated models
    do not enforce it): the spec is the one home of these bounds."""
    spec = bundle()
    schemas = spec["components"]["schemas"]
    bounds: dict[str, int] = {}
    for name in request_schema_names(spec):
        for prop, schema in schemas[name].get("properties", {}).items():
            if "maxProperties" in schema:
                bounds[prop] = schema["maxProperties"]
    return bounds


#: request fields (objects) and the most entries each may hold
MAX_PROPERTIES = _max_properties()


def _spec_max_items() -> int:
    """The largest fixed ``maxItems`` of any request array in the documents."""
    spec = bundle()
    schemas = spec["components"]["schemas"]
    return max(sub["maxItems"] for name in request_schema_names(spec) for sub in walk_schemas(schemas[name])
               if isinstance(sub.get("maxItems"), int))  # fmt: skip


SPEC_MAX_ITEMS = _spec_max_items()

#: OpenAI request fields that change nothing in the output: accepted and recorded (access log)
RECORDED_FIELDS = ("metadata", "service_tier", "safety_identifier", "prompt_cache_key")


def wire_defaults(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """Documented defaults of a generated model's fields, by wire name."""
    defaults = {}
    for name, info in model.model_fields.items():
        default = info.default
        if default is pydantic_core.PydanticUndefined or default is getattr(pydantic, "MISSING", object()):
            continue
        if default is None and not info.is_required() and info.annotation is not None and "None" not in str(info.annotation):
            continue
        defaults[info.alias or name] = default
    return defaults


class Translator:
    """Turns request bodies into :class:`ServingRequest` objects for one engine."""

    def __init__(
        self,
        engine: Engine,
        served_model_names: list[str],
        extension_schemas: dict[str, dict[str, Any]],
        validate_hook: Callable[..., Any] | None = None,
        max_prompts: int | None = None,
        max_seqs: int | None = None,
        tool_parser: Any = None,
    ) -> None:
        self.engine = engine
        #: the convention tool calls are written in (gyrfalcon.tools.parsers), None: no tools
        self.tool_parser = tool_parser
        self._renders_tools: bool | None = None
        #: most sequences (prompts × n) in one request
        self.max_seqs = max_seqs
        self.info: EngineInfo = engine.info()
        self.served_model_names = served_model_names
        self._extensions = jsonschema.Draft202012Validator(
            {"type": "object", "properties": extension_schemas, "additionalProperties": False}
        )
        self._validate_hook = validate_hook
        #: the bounds the served spec states, enforced by the same table (gyrfalcon.openapi.limits)
        self.limits = ServedLimits(
            model_names=served_model_names, vocab_size=self.info.vocab_size, max_model_len=self.info.max_model_len,
            max_request_seqs=max_seqs or self.info.max_request_seqs, max_logprobs=self.info.max_logprobs,
            max_prompts=max_prompts,
        )  # fmt: skip
        #: the longest array any request may hold here: longer ones are refused before the body is walked
        self.max_array_items = longest_array(self.limits, SPEC_MAX_ITEMS)
        self._defaults = {endpoint: wire_defaults(model) for endpoint, model in WIRE_MODELS.items()}
        self._defaults["generate"].update(wire_defaults(generated.GenerateSamplingParams))

    # ------------------------------------------------------------------ steps
    def translate(self, endpoint: str, body: Any, header_request_id: str | None = None) -> ServingRequest:
        if not isinstance(body, dict):
            raise RequestError("The request body must be a JSON object", None)
        body = dict(body)
        raw_extensions = body.pop("extensions", None)
        wire = validate(WIRE_MODELS[endpoint], body)  # schema errors first, extensions' included
        extensions = self._check_extensions(raw_extensions) if raw_extensions is not None else None
        sent = sent_fields(wire)
        if extensions is not None:
            sent["extensions"] = extensions
        fields = RequestFields.from_body(endpoint, sent)
        check_rules(fields)
        check_supported(fields, self._defaults[endpoint], self.info.capabilities)
        model = self._model_name(fields.get("model"))
        self._check_limits(fields)

        external_id = header_request_id or fields.get("request_id")
        response_id = f"{RESPONSE_ID_PREFIX[endpoint]}-{external_id or uuid.uuid4().hex}"
        tools = tool_use(fields, body, self.tool_parser) if endpoint in ("chat", "chat_batch") else None
        prompts, prompt_texts, prompt_param = self._prompts(fields, tools)
        sampling = self._sampling(fields)
        sampling.structured_outputs = tool_constraint(tools, fields, structured_constraint(fields, body))
        if self.max_seqs is not None and len(prompts) * sampling.n > self.max_seqs:
            raise fields.error(
                "n", f"{len(prompts)} prompts x n={sampling.n} asks for more than the {self.max_seqs} sequences one request may have"
            )
        stream = bool(fields.get("stream", False))
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        requests = []
        for i, prompt in enumerate(prompts):
            params = self._with_max_tokens(fields, sampling, len(prompt), prompt_param)
            requests.append(
                EngineRequest(
                    request_id=f"{response_id}-{i}-{uuid.uuid4().hex[:8]}",
                    prompt_token_ids=prompt,
                    sampling=params,
                    output_kind=kind,
                    extensions=dict(extensions or {}),
                    cache_salt=fields.get("cache_salt"),
                    priority=fields.get("priority", 0),
                )
            )
        if self._validate_hook is not None:
            try:
                for request in requests:
                    self._validate_hook(endpoint=endpoint, request=request, info=self.info)
            except RequestError as exc:
                exc.param = hook_param(fields, exc.param)
                raise
        stream_options = fields.get("stream_options") or {}
        # kept only where it differs from structured_outputs' own wire name (whose sub-fields it would hide)
        constraint_param = hook_param(fields, "structured_outputs") if sampling.structured_outputs is not None else None
        if constraint_param == fields.param("structured_outputs"):
            constraint_param = None
        echo = bool(fields.get("echo", False))
        prompt_only = endpoint == "completions" and echo and requests[0].sampling.max_tokens == 0
        return ServingRequest(
            endpoint=endpoint,
            model=model,
            response_id=response_id,
            requests=requests,
            n=sampling.n,
            stream=stream,
            include_usage=bool(stream_options.get("include_usage", False)),
            # vLLM: usage on every chunk only when the usage chunk is asked for too
            continuous_usage=bool(stream_options.get("include_usage")) and bool(stream_options.get("continuous_usage_stats")),
            echo=echo,
            prompt_texts=prompt_texts,
            constraint_param=constraint_param,
            return_token_ids=bool(fields.get("return_token_ids", False)),
            return_tokens_as_token_ids=bool(fields.get("return_tokens_as_token_ids", False)),
            logprobs=fields.get("logprobs"),
            user=fields.get("user"),
            recorded={name: fields.get(name) for name in RECORDED_FIELDS if fields.has(name)},
            prompt_only=prompt_only and requests[0].sampling.prompt_logprobs is None,
            prompt_logprobs=fields.get("prompt_logprobs"),
            tools=tools,
        )

    def _check_extensions(self, extensions: Any) -> dict[str, Any]:
        error = next(iter(self._extensions.iter_errors(extensions)), None)
        if error is not None:
            path = ".".join(str(p) for p in error.absolute_path)
            param = f"extensions.{path}" if path else "extensions"
            raise RequestError(f"Invalid value for '{param}': {error.message}", param)
        return extensions

    def _model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise RequestError(f"The model '{requested}' does not exist", "model", status=404, type="NotFoundError")
        return requested

    def _check_limits(self, f: RequestFields) -> None:
        """The deployment limits laid over the served spec (one table), and the bounds the generated
        models do not enforce (maxProperties, uniqueItems)."""
        for name, value in f.values.items():
            self._check_field(name, value, f.param(name))
        for name, most in MAX_PROPERTIES.items():
            if len(f.get(name) or ()) > most:
                raise f.error(name, f"'{name}' holds at most {most} entries")
        ids = f.get("logprob_token_ids") or []
        if len(set(ids)) != len(ids):
            raise f.error("logprob_token_ids", "'logprob_token_ids' must not repeat a token id")

    def _check_field(self, name: str, value: Any, param: str) -> None:
        for limit in limits_of(name):
            refused = limit.check(value, self.limits, param)
            if refused is not None:
                raise RequestError(refused[1], refused[0])

    # ------------------------------------------------------------------ prompts
    def _prompts(self, f: RequestFields, tools: ToolUse | None = None) -> tuple[list[list[int]], list[str], str]:
        """Token ids of every prompt, their texts (for echo), and the prompt's param name."""
        if f.endpoint == "generate":
            return [f.get("token_ids")], [], "token_ids"
        if f.endpoint == "completions":
            return self._completion_prompts(f.get("prompt"))
        conversations = [f.get("messages")] if f.endpoint == "chat" else f.get("messages")
        options = ChatRendering.of(f)
        prompts = [
            self._render_chat(messages, options, "messages" if f.endpoint == "chat" else f"messages.{i}", tools)
            for i, messages in enumerate(conversations)
        ]
        echoed = [options.echoed(messages) for messages in conversations] if f.get("echo") is True else []
        return prompts, echoed, "messages"

    def renders_tools(self) -> bool:
        """Whether the model's chat template renders ``tools`` (probed once)."""
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "x"}]
            tool = {"type": "function", "function": {"name": "probe_tool", "parameters": {"type": "object"}}}
            try:
                self._renders_tools = (self.engine.apply_chat_template(probe, True, template_kwargs={"tools": [tool]})
                                       != self.engine.apply_chat_template(probe, True))  # fmt: skip
            except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
                self._renders_tools = False
        return self._renders_tools

    def _render_chat(self, messages: list[dict[str, Any]], options: ChatRendering, param: str,
                     tools: ToolUse | None = None) -> list[int]:  # fmt: skip
        """Token ids of wire chat messages rendered with the model's template (its special tokens once,
        unless ``add_special_tokens`` asks for the tokenizer's too), with the request's tools."""
        plain = [template_message(m, f"{param}.{i}") for i, m in enumerate(messages)]
        kwargs = options.template_kwargs
        if tools is not None:
            if self.renders_tools():
                kwargs = {**kwargs, "tools": tools.tools}
            else:  # the template knows nothing of tools: the parser's convention, in plain turns
                plain = with_instructions(plain, tools)

        def render(msgs: list[dict[str, str]]) -> str:
            return self.engine.apply_chat_template(msgs, options.add_generation_prompt,
                                                   continue_final_message=options.continue_final_message,
                                                   template_kwargs=kwargs)  # fmt: skip

        try:
            text = render(plain)
            for key, what in (("name", "message names"), ("tool_calls", "tool calls")):
                holders = [i for i, m in enumerate(plain) if key in m]
                if holders and render([{k: v for k, v in m.items() if k != key} for m in plain]) == text:
                    raise RequestError(f"This model's chat template does not render {what}; '{key}' would be ignored",
                                       f"{param}.{holders[0]}.{key}")  # fmt: skip
            tools = [i for i, m in enumerate(plain) if m["role"] == "tool"]
            others = [m for m in plain if m["role"] != "tool"]
            if tools and others and render(others) == text:
                raise RequestError("This model's chat template does not render tool turns; they would be ignored",
                                   f"{param}.{tools[0]}.role")  # fmt: skip
        except RequestError:
            raise
        except Exception as exc:  # a template raising on these messages is the client's 400
            raise RequestError(f"The chat template cannot render these messages: {exc}", param) from None
        return self.engine.tokenize(text, add_special_tokens=options.add_special_tokens)

    # ------------------------------------------------------------------ tokenize / detokenize
    def tokenize(self, body: Any) -> tuple[list[int], list[str] | None]:
        """``POST /tokenize``: the token ids of a prompt (as completions tokenize it) or of messages
        (as chat renders them), and their strings when ``return_token_strs`` asks (else None)."""
        chat = isinstance(body, dict) and "messages" in body
        model = generated.TokenizeChatRequest if chat else generated.TokenizeCompletionRequest
        sent = sent_fields(validate(model, body))
        self._model_name(sent.get("model"))
        if chat:
            ids = self._render_chat(sent["messages"], ChatRendering(sent.get("add_generation_prompt", True)), "messages")
        else:
            ids = self.engine.tokenize(sent["prompt"], add_special_tokens=sent.get("add_special_tokens", True))
        return ids, self.engine.token_pieces(ids) if sent.get("return_token_strs") else None

    def detokenize(self, body: Any) -> str:
        """``POST /detokenize``: the text of token ids inside the vocabulary."""
        sent = sent_fields(validate(generated.DetokenizeRequest, body))
        self._model_name(sent.get("model"))
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
        if f.endpoint in ("chat", "chat_batch"):
            if logprobs is True:
                params.logprobs = f.get("top_logprobs", 0)
        elif logprobs is not None:
            params.logprobs = logprobs
            if f.get("echo") is True:
                # echo with logprobs reports the prompt positions too: gather them at the prefill
                # (the wider of the two counts; the formatter shows each its own)
                params.prompt_logprobs = max(logprobs, params.prompt_logprobs or 0)
        return params

    def _with_max_tokens(self, f: RequestFields, sampling: SamplingParams, prompt_len: int, prompt_param: str) -> SamplingParams:
        """Resolve ``max_tokens`` for one prompt and check that prompt + max_tokens fit the context."""
        context = self.info.max_model_len
        if f.has("max_completion_tokens"):
            name, max_tokens = "max_completion_tokens", f.get("max_completion_tokens")
        elif f.get("max_tokens") is not None:
            name, max_tokens = "max_tokens", f.get("max_tokens")
        elif f.endpoint == "completions":
            name, max_tokens = None, COMPLETIONS_DEFAULT_MAX_TOKENS
        else:
            name, max_tokens = None, context - prompt_len
        if name is None and "max_tokens" in self.info.default_sampling:  # the model's max_new_tokens caps it
            max_tokens = min(max_tokens, self.info.default_sampling["max_tokens"])
        if prompt_len > context or (max_tokens > 0 and prompt_len >= context):
            raise RequestError(
                f"The prompt has {prompt_len} tokens; this model's context is {context} tokens", f.param(prompt_param)
            )
        if prompt_len + max_tokens > context:
            raise RequestError(
                f"This model's context is {context} tokens, but {prompt_len} prompt tokens + {max_tokens} "
                f"completion tokens were requested",
                f.param(name) if name else f.param(prompt_param),
            )
        if sampling.min_tokens > max_tokens:
            raise f.error("min_tokens", f"'min_tokens' ({sampling.min_tokens}) must not exceed 'max_tokens' ({max_tokens})")
        return dataclasses.replace(sampling, max_tokens=max_tokens)


#: chat template arguments a request's chat_template_kwargs may not override
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "tokenize",
                                    "add_generation_prompt", "continue_final_message", "return_dict",
                                    "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs"})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ChatRendering:
    """How a request's conversations are rendered (the chat endpoints' template options)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def echoed(self, messages: list[dict[str, Any]]) -> str:
        """What ``echo`` puts before each choice's content: the last turn's content when it has the
        reply's role (assistant; without a generation prompt, the reply continues the last turn)."""
        last = messages[-1]
        if self.add_generation_prompt and last["role"] != "assistant":
            return ""
        content = last.get("content") or ""
        return content if isinstance(content, str) else "\n".join(part["text"] for part in content)

    @classmethod
    def of(cls, f: RequestFields) -> ChatRendering:
        if f.get("continue_final_message") is True and f.get("add_generation_prompt") is not False:
            # runtime-only (continue_final_message_alone): one more if/then made the chat schema too
            # complex for Schemathesis' generator
            raise f.error("continue_final_message",
                          "'continue_final_message' continues the last message: it needs 'add_generation_prompt': false")  # fmt: skip
        kwargs = dict(f.get("chat_template_kwargs") or {})
        for key in kwargs:
            if key in RESERVED_TEMPLATE_ARGS:
                raise f.error("chat_template_kwargs", f"'chat_template_kwargs' may not set the template's own argument '{key}'")
        return cls(f.get("add_generation_prompt", True), f.get("continue_final_message", False),
                   f.get("add_special_tokens", False), kwargs)  # fmt: skip


#: message fields only one role may carry
ROLE_ONLY_FIELDS = {"tool_calls": "assistant", "reasoning_content": "assistant", "tool_call_id": "tool"}


def template_message(message: dict[str, Any], param: str) -> dict[str, Any]:
    """A wire chat message as chat templates expect it (the runtime rule message_fields_match_role).

    ``developer`` becomes ``system``; text parts are joined by newlines; an assistant turn without
    content gets ``""`` (templates concatenate it); tool-call arguments are parsed from their JSON
    text, as vLLM hands them to Hugging Face templates.
    """
    role = message["role"]
    content = message.get("content")
    for key, owner in ROLE_ONLY_FIELDS.items():
        if message.get(key) is not None and role != owner:
            raise RequestError(f"'{key}' belongs to {owner} messages, not to a {role} message", f"{param}.{key}")
    if role == "tool" and message.get("tool_call_id") is None:
        raise RequestError("A tool message needs the 'tool_call_id' of the call it answers", f"{param}.tool_call_id")
    if content is None and role != "assistant":
        raise RequestError(f"A {role} message needs 'content'", f"{param}.content")
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    plain: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content or ""}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if message.get(key) is not None:
            plain[key] = message[key]
    if message.get("tool_calls"):
        plain["tool_calls"] = [_template_tool_call(call, f"{param}.tool_calls.{j}") for j, call in enumerate(message["tool_calls"])]
    return plain


def _template_tool_call(call: dict[str, Any], param: str) -> dict[str, Any]:
    try:  # orjson: a decode error past 1024 levels, never a RecursionError
        arguments = orjson.loads(call["function"]["arguments"])
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"Tool call arguments must be a JSON text: {exc}", f"{param}.function.arguments") from None
    return {"id": call["id"], "type": call["type"], "function": {"name": call["function"]["name"], "arguments": arguments}}


def structured_constraint(f: RequestFields, body: dict[str, Any]) -> dict[str, Any] | None:
    """``SamplingParams.structured_outputs`` from ``structured_outputs`` or ``response_format`` (not
    both). JSON schemas are taken from the body as sent: a ``null`` inside a schema means something."""
    response_format = f.get("response_format") or {"type": "text"}
    if f.has("structured_outputs"):
        if response_format["type"] != "text":
            raise f.error("structured_outputs", "'structured_outputs' and 'response_format' cannot be used together")
        sent = body.get("sampling_params", body) if f.endpoint == "generate" else body
        return {k: v for k, v in sent["structured_outputs"].items() if v is not None}
    if response_format["type"] == "json_object":
        return {"json_object": True}
    if response_format["type"] == "json_schema":
        return {"json": body["response_format"]["json_schema"].get("schema") or {}}
    return None


def hook_param(f: RequestFields, param: str | None) -> str | None:
    """A validation hook's engine-side ``param`` as the client wrote it: a constraint that came
    from ``response_format`` is named there."""
    if param is None or not param.startswith("structured_outputs"):
        return param
    if f.has("tools") and f.get("tool_choice") not in (None, "none", "auto"):
        return "tools"  # the calls' grammar: a tool's parameters schema does not compile
    if f.has("response_format"):
        return "response_format.json_schema.schema" if param == "structured_outputs.json" else "response_format"
    return f.param(param)
