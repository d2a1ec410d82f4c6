"""An example third-party gyrfalcon plugin, loaded through the ``gyrfalcon`` entry point.

It adds the request field ``extensions.suppress_token_ids`` (a frontend hook declares its JSON
Schema, so it appears in the served spec and is validated) and honours it with a batch-shaped logits
processor (an engine hook) that makes those tokens impossible to sample.
"""

from __future__ import annotations

from typing import Any

from gyrfalcon import hookimpl
from gyrfalcon.errors import RequestError
from gyrfalcon.policies import LogitsProcessor

FIELD = "suppress_token_ids"


class SuppressTokens(LogitsProcessor):
    name = "suppress_token_ids"
    fields = frozenset({FIELD})
    order = 50

    def validate(self, params: Any, extensions: dict[str, Any], info: Any) -> None:
        for token_id in extensions.get(FIELD, []):
            if token_id >= info.vocab_size:
                raise RequestError(f"token id {token_id} is outside the vocabulary", f"extensions.{FIELD}")

    def wants(self, params: Any, extensions: dict[str, Any]) -> bool:
        return bool(extensions.get(FIELD))

    def __call__(self, logits, rows, selected):
        for row in selected:
            logits[row, rows.extensions[row][FIELD]] = float("-inf")
        return logits


@hookimpl
def gyrfalcon_request_extensions() -> dict[str, dict[str, Any]]:
    return {
        FIELD: {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "x-token-id": True},
            "maxItems": 16,
            "uniqueItems": True,
            "description": "Token ids that may never be sampled (x-token-id: the server caps them below its vocabulary).",
        }
    }


@hookimpl
def gyrfalcon_logits_processors(info: Any) -> list[LogitsProcessor]:
    return [SuppressTokens()]
