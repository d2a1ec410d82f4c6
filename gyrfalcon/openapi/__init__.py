"""The contract: OpenAPI 3.1 documents (the source of truth) and the served spec built from them.

- ``common.yaml``: shared schemas (error envelope, usage, stream options, extensions, SSE event)
  and the shared error responses;
- ``generate.yaml``: ``POST /inference/v1/generate`` (token ids in, token ids out);
- ``openai.yaml``: the OpenAI-compatible routes, health, version and the spec route.

Pydantic models are generated from these files into ``gyrfalcon.generated`` (``python -m
gyrfalcon.codegen``); :mod:`gyrfalcon.openapi.served` bundles them and lays a deployment's limits over
them for ``GET /openapi.json``.
"""

from gyrfalcon.engine_api.limits import FIELD_LIMITS, ServedLimits
from gyrfalcon.openapi.served import (
    DOCUMENTS,
    OPENAPI_DIR,
    bundle,
    request_field_names,
    request_schema_names,
    rule_ids,
    served_spec,
    x_rules,
)

__all__ = [
    "DOCUMENTS",
    "FIELD_LIMITS",
    "OPENAPI_DIR",
    "ServedLimits",
    "bundle",
    "request_field_names",
    "request_schema_names",
    "rule_ids",
    "served_spec",
    "x_rules",
]
