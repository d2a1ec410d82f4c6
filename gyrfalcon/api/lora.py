"""vLLM's routes for LoRA adapters at run time (``--enable-lora``): ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, answered in vLLM's words (plain text) once the change holds. Behind
the API key; the served spec lists them only where they are served. The adapters themselves are
the engine's (:mod:`gyrfalcon.engine.lora`)."""

from __future__ import annotations

import falcon

from gyrfalcon.api.context import ServerContext
from gyrfalcon.api.control import no_query
from gyrfalcon.api.resources import offload
from gyrfalcon.protocol.endpoints import LOAD_LORA_ADAPTER, UNLOAD_LORA_ADAPTER
from gyrfalcon.protocol.wire import sent_fields, validate


def _text(resp: falcon.Response, text: str) -> None:
    resp.content_type = falcon.MEDIA_TEXT
    resp.text = text


class LoadLoraAdapterResource:
    """``POST /v1/load_lora_adapter``: answered once the adapter serves."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        no_query(req)
        sent = sent_fields(validate(LOAD_LORA_ADAPTER, self.ctx.translator().parse(await self.ctx.read_body(req))))
        name = sent["lora_name"]
        await offload(self.ctx.engine.load_lora_adapter, name, sent["lora_path"], bool(sent.get("load_inplace")))
        _text(resp, f"Success: LoRA adapter '{name}' added successfully.")


class UnloadLoraAdapterResource:
    """``POST /v1/unload_lora_adapter``: answered once the adapter no longer serves new requests."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        no_query(req)
        sent = sent_fields(validate(UNLOAD_LORA_ADAPTER, self.ctx.translator().parse(await self.ctx.read_body(req))))
        await offload(self.ctx.engine.unload_lora_adapter, sent["lora_name"])
        _text(resp, f"Success: LoRA adapter '{sent['lora_name']}' removed successfully.")


#: the resource of each of ``protocol.endpoints.LORA_ROUTES``
LORA_RESOURCES = {"/v1/load_lora_adapter": LoadLoraAdapterResource, "/v1/unload_lora_adapter": UnloadLoraAdapterResource}
