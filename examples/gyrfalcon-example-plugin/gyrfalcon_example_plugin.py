"""An example third-party gyrfalcon plugin, loaded through the ``gyrfalcon`` entry point.

It adds the request field ``extensions.suppress_token_ids`` (a frontend hook declares its JSON
Schema, so it appears in the served spec and is validated) and honours it with a batch-shaped logits
processor (an engine hook) that makes those tokens impossible to sample.

The processor follows the engine's persistent batch: when a sequence that asks for the field joins,
``add_row`` writes its mask into a per-slot device tensor once; each step gathers the masks of its
rows by slot, with no tensor built from Python lists and no copy to the host.
"""

from __future__ import annotations

from typing import Any

from gyrfalcon import hookimpl
from gyrfalcon.errors import RequestError
from gyrfalcon.policies import LogitsProcessor, SlotTensor, put_rows, row_index, take_rows

FIELD = "suppress_token_ids"


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
            "maxItems": 16,
            "uniqueItems": True,
            "description": "Token ids that may never be sampled (x-token-id: the server caps them below its vocabulary).",
        }
    }


@hookimpl
def gyrfalcon_logits_processors(info: Any) -> list[LogitsProcessor]:
    return [SuppressTokens()]
