"""An example third-party gyrfalcon plugin, loaded through the ``gyrfalcon`` entry point.

It adds the request field ``extensions.suppress_token_ids`` (a frontend hook declares its JSON
Schema, so it appears in the served spec and is validated) and honours it with a batch-shaped logits
processor (an engine hook) that makes those tokens impossible to sample.

The processor follows the engine's persistent batch: when a sequence that asks for the field joins,
``add_row`` writes its mask into a per-slot device tensor once; each step gathers the masks of its
rows by slot, with no tensor built from Python lists and no copy to the host.

It also adds a route (``GET /suppress_token_ids``, and HEAD), a Falcon ASGI resource whose
responder is a coroutine, as every route of the app's.
"""

from __future__ import annotations

from typing import Any

from gyrfalcon import hookimpl
from gyrfalcon.errors import RequestError
from gyrfalcon.policies import LogitsProcessor, SlotTensor, put_rows, row_index, take_rows

FIELD = "suppress_token_ids"
MAX_ITEMS = 16


class SuppressTokens(LogitsProcessor):
    name = "suppress_token_ids"
    fields = frozenset({FIELD})
    order = 50

    def validate(self, params: Any, extensions: dict[str, Any], info: Any) -> None:
        for token_id in extensions.get(FIELD, []):
            if token_id >= info.vocab_size:
                raise RequestError(f"token id {token_id} is outside the vocabulary", f"extensions.{FIELD}")

    def __init__(self) -> None:
        self.masks = SlotTensor(None, "bool", False)  # per slot: True for the tokens to suppress

    def wants(self, params: Any, extensions: dict[str, Any]) -> bool:
        return bool(extensions.get(FIELD))

    def add_row(self, slot: int, row: Any) -> None:
        mask = self.masks.row(slot, row.device, row.vocab_size)
        mask.zero_()
        mask[list(row.extensions[FIELD])] = True

    def __call__(self, logits, rows, selected):
        index = row_index(selected, logits)
        masks = self.masks.take(rows.slots_of(selected, index))
        return put_rows(logits, index, take_rows(logits, index).masked_fill(masks, float("-inf")))


@hookimpl
def gyrfalcon_request_extensions() -> dict[str, dict[str, Any]]:
    return {
        FIELD: {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "x-token-id": True},
            "maxItems": MAX_ITEMS,
            "uniqueItems": True,
            "description": "Token ids that may never be sampled (x-token-id: the server caps them below its vocabulary).",
        }
    }


@hookimpl
def gyrfalcon_logits_processors(info: Any) -> list[LogitsProcessor]:
    return [SuppressTokens()]


class SuppressTokensInfo:
    """``GET /suppress_token_ids``: what the field takes on this server."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def on_get(self, req: Any, resp: Any) -> None:
        if not self.engine.health().ready:  # the engine's info comes once the model is loaded
            raise RequestError("The model is loading", None, status=503, headers={"Retry-After": "1"})
        max_token_id = self.engine.info().vocab_size - 1
        resp.media = {"field": f"extensions.{FIELD}", "max_items": MAX_ITEMS, "max_token_id": max_token_id}


@hookimpl
def gyrfalcon_add_routes(app: Any, engine: Any, settings: Any) -> None:
    app.add_route("/suppress_token_ids", SuppressTokensInfo(engine))
