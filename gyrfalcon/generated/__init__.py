"""Pydantic v2 wire models generated from ``gyrfalcon/openapi/*.yaml``.

HAND-WRITTEN re-export: this ``__init__.py`` is the only hand-written file in the folder. The
modules ``common.py``, ``generate.py`` and ``openai.py`` are written by ``python -m gyrfalcon.codegen``
(datamodel-code-generator) and must never be edited by hand; change the YAML and regenerate.

Validating a request body::

    data = orjson.loads(body)    # then turn whole floats (1.0) into ints: fuzzers send them for integers
    req = CompletionRequest.model_validate(data, strict=True)

Absent optional fields. A field WITH a wire default in the spec (``default:``) holds that default
when the client omits it (``stream`` is ``False``, ``n`` is ``1``, completions ``max_tokens`` is
``16``, completions ``logprobs`` is ``None``); a client that sends the default is indistinguishable
from one that omits it. A field WITHOUT a default holds the sentinel ``pydantic.MISSING`` when
omitted (``seed``, ``stop``, ``max_tokens`` on chat/generate, ``logprob_token_ids``,
``sampling_params``, ``stream_options``, ...). Test for it by identity::

    from pydantic import MISSING
    if req.seed is MISSING: ...
    seed = None if req.seed is MISSING else req.seed

``MISSING`` is truthy: never write ``req.seed or default``. To know which fields the client sent,
use ``req.model_fields_set``. ``model_dump()`` leaves ``MISSING`` fields out.

Not enforced by these models (the protocol layer checks them): the ``if``/``then`` cross-field
rules (``x-rule`` in the YAML), ``uniqueItems`` on ``logprob_token_ids``, and every deployment limit
of the served spec (model names, vocabulary size, context length, ``max_num_seqs``,
``max_logprobs``, unsupported fields, plugin ``extensions`` properties).
``Extensions`` forbids every key: validate ``extensions`` against the plugins' fragments separately.

Pydantic quirk: a boolean ``const`` becomes ``Literal[False]``, which accepts ``0`` (and ``0.0``
once whole floats are ints) even with ``strict=True``. So request documents never use ``const`` on
a boolean property: write a plain ``type: boolean`` and an ``x-rule`` instead.
"""

from gyrfalcon.generated.common import (
    ErrorDetail,
    ErrorResponse,
    Extensions,
    JsonSchemaFormat,
    PromptLogprob,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    ResponseFormatText,
    ServerSentEvent,
    StreamOptions,
    StructuredOutputs,
    Usage,
)
from gyrfalcon.generated.generate import (
    AbortRequestsRequest,
    AbortRequestsResponse,
    GenerateChoice,
    GenerateLogprobEntry,
    GenerateLogprobs,
    GenerateRequest,
    GenerateResponse,
    GenerateSamplingParams,
    GenerateStreamResponse,
    GenerateTopLogprob,
    IsPausedResponse,
    PauseResponse,
    SleepResponse,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsResponse,
    WeightVersionResponse,
)
from gyrfalcon.generated.openai import (
    BatchChatCompletionRequest,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatContentPartText,
    ChatDelta,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatNamedToolChoice,
    ChatTool,
    ChatToolCall,
    ChatToolCallDelta,
    ChatResponseMessage,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    HealthResponse,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    ModelPermission,
    Response,
    ResponseDeleted,
    ResponseItemList,
    ResponsesRequest,
    ResponseFunctionCall,
    ResponseFunctionCallOutput,
    ResponseFunctionTool,
    ResponseHostedTool,
    ResponseInputMessage,
    ResponseInputText,
    ResponseOutputItem,
    ResponseOutputText,
    ResponseUsage,
    VersionResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    UnloadLoraAdapterRequest,
)

__all__ = [
    "AbortRequestsRequest",
    "AbortRequestsResponse",
    "BatchChatCompletionRequest",
    "ChatCompletionChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatContentPartText",
    "ChatDelta",
    "ChatLogprobToken",
    "ChatLogprobs",
    "ChatMessage",
    "ChatNamedToolChoice",
    "ChatResponseMessage",
    "ChatTool",
    "ChatToolCall",
    "ChatToolCallDelta",
    "ChatTopLogprob",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamResponse",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorDetail",
    "ErrorResponse",
    "Extensions",
    "GenerateChoice",
    "GenerateLogprobEntry",
    "GenerateLogprobs",
    "GenerateRequest",
    "GenerateResponse",
    "GenerateSamplingParams",
    "GenerateStreamResponse",
    "GenerateTopLogprob",
    "HealthResponse",
    "LoadLoraAdapterRequest",
    "IsPausedResponse",
    "JsonSchemaFormat",
    "ModelCard",
    "ModelList",
    "ModelPermission",
    "PauseResponse",
    "PromptLogprob",
    "Response",
    "ResponseDeleted",
    "ResponseFormatJsonObject",
    "ResponseFormatJsonSchema",
    "ResponseFormatText",
    "ResponseFunctionCall",
    "ResponseFunctionCallOutput",
    "ResponseFunctionTool",
    "ResponseHostedTool",
    "ResponseInputMessage",
    "ResponseInputText",
    "ResponseItemList",
    "ResponseOutputItem",
    "ResponseOutputText",
    "ResponseUsage",
    "ResponsesRequest",
    "ServerSentEvent",
    "SleepResponse",
    "StreamOptions",
    "StructuredOutputs",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeResponse",
    "UnloadLoraAdapterRequest",
    "UpdateWeightsFromDiskRequest",
    "UpdateWeightsResponse",
    "Usage",
    "VersionResponse",
    "WeightVersionResponse",
]
