"""The plugin contract of gyrfalcon. The docstrings below ARE the documentation of every hook.

Plugins are modules or objects with functions marked ``@hookimpl`` (``gyrfalcon.hookimpl``), found
through the ``gyrfalcon`` entry-point group; the built-in behaviour is shipped as default plugins
registered through the same path (``gyrfalcon.plugins.DEFAULT_PLUGINS``).

There are two kinds of hooks, because the engine may live in another process:

* **frontend hooks** run in the HTTP process, import no torch and must be pure and fast;
* **engine hooks** run in the engine process and are resolved once when the engine starts, never
  looked up inside the step loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import falcon.asgi

    from gyrfalcon.config import Settings
    from gyrfalcon.engine_api.interface import Engine
    from gyrfalcon.engine_api.types import EngineInfo, EngineRequest
    from gyrfalcon.policies import LogitsProcessor, LogprobGatherer

PROJECT = "gyrfalcon"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---------------------------------------------------------------- frontend hooks


@hookspec
def gyrfalcon_engines() -> dict[str, Any]:
    """Offer engine backends: return ``{name: factory}``.

    ``factory(settings: Settings, pm: pluggy.PluginManager) -> Engine`` builds and starts an engine;
    ``pm`` is the app's plugin manager, whose engine hooks the engine resolves once at start. A
    backend that deals in token ids only implements :class:`gyrfalcon.engine_api.interface.EngineCore`
    and returns it wrapped in :class:`gyrfalcon.client.EngineClient`, which does the text work
    (tokenizer, chat template, detokenisation, stop strings) as the built-in backend does. The backend that serves is
    chosen by the ``--engine`` setting (default ``transformers``), never by plugin order; two plugins
    offering the same name is a start-up error.
    """


@hookspec
def gyrfalcon_request_extensions() -> dict[str, dict[str, Any]]:
    """Declare request fields of your own: return ``{name: json_schema_fragment}``.

    Each name becomes a typed property of the ``extensions`` object accepted by generate,
    completions, chat and batch chat; the fragments are merged into the served OpenAPI spec (so they
    are fuzzed) and validated at run time. The validated values reach the engine in
    ``EngineRequest.extensions[name]``. A name declared twice is a start-up error. A plugin that
    declares a field must also honour it (an engine hook listing it in ``fields``), or the request is
    rejected with 400 as unsupported.
    """


@hookspec
def gyrfalcon_validate_request(endpoint: str, request: EngineRequest, info: EngineInfo) -> None:
    """Check a translated request after the built-in rules; raise ``RequestError`` to refuse it.

    ``endpoint`` is one of ``"generate"``, ``"completions"``, ``"chat"``, ``"chat_batch"``,
    ``"responses"`` (the name of the endpoint in ``protocol/endpoints.py``). Raise
    :class:`gyrfalcon.errors.RequestError` with the offending ``param`` (a 400; another
    :class:`gyrfalcon.errors.Kind` as its ``type`` for another answer). Must not modify ``request``
    and must not block.
    """


@hookspec
def gyrfalcon_tool_parsers() -> dict[str, Any]:
    """Offer tool-call conventions: return ``{name: parser}``, each a
    :class:`gyrfalcon.tools.parsers.ToolCallParser` (its instructions for templates that do not
    render tools, its grammar for ``tool_choice`` ``required`` or a named function, and how calls are
    read back from the text). The ``--tool-call-parser`` setting picks one (default ``hermes``); a
    name offered twice is a start-up error. Parsers run on the API side, on text.
    """


@hookspec
def gyrfalcon_add_routes(app: falcon.asgi.App, engine: Engine, settings: Settings) -> None:
    """Add routes of your own to the Falcon ASGI app (``app.add_route(...)``) at start-up.

    The app is ``falcon.asgi.App``: responders are coroutines (``async def on_get(self, req, resp)``)
    running on the worker's event loop, so anything that takes CPU time or blocks (the tokenizer,
    file or network I/O without ``await``) goes to a thread (``await asyncio.to_thread(...)``), or
    every other client waits. A route that answers GET answers HEAD too. Your resources answer errors
    with :class:`gyrfalcon.errors.RequestError` so that they share the error envelope of every other
    route; the API-key check covers your routes as well.
    """


@hookspec
def gyrfalcon_startup(settings: Settings) -> None:
    """Called once per worker process after the app and its engine are built, before it serves
    (the ASGI server's lifespan start-up).

    Open what your plugin needs for the worker's lifetime here (not at import: the gunicorn master
    imports plugins before forking). Exceptions abort the worker's start.
    """


@hookspec
def gyrfalcon_shutdown() -> None:
    """Called once per worker process when it stops serving, before the engine shuts down.

    Release what ``gyrfalcon_startup`` opened; must not block for long (the worker has a graceful
    timeout of a few seconds).
    """


# ---------------------------------------------------------------- engine hooks


@hookspec
def gyrfalcon_logits_processors(info: EngineInfo) -> list[LogitsProcessor]:
    """Offer batch-shaped logits processors (see :class:`gyrfalcon.policies.LogitsProcessor`).

    Called once when the engine starts. Each processor transforms ``[B, V]`` logits for the rows
    that want it, declares the request fields it honours (``fields``, reported by the engine as
    capabilities) and validates them at submit time. Processors run in ascending ``order``. The
    rows are whichever sequences draw a token in a step (decode rows and prompts that just finished
    prefilling, side by side).

    The engine keeps a persistent batch: ``wants`` is asked once per sequence, when it joins (its
    first draw, or its first after a preemption), and the processor hears ``add_row(slot, row)``
    then and ``remove_row(slot)`` when the sequence leaves. Keep per-row state on the device,
    indexed by slot (:class:`gyrfalcon.policies.SlotTensor`), and gather it in ``__call__`` with
    ``BatchRows.slots``; never build tensors from Python lists per step, and never copy to the host
    (the step makes one host transfer for everyone). A processor that sets ``uses_output_counts``
    reads the generated-token counts the engine keeps (``BatchRows.output_counts``). A processor
    that needs randomness draws from the row's generator in ``BatchRows.generators``, seeded per
    draw from (the choice's seed, the position), so a preempted and recomputed sequence sees the
    same numbers.
    """


@hookspec
def gyrfalcon_logprob_gatherers(info: EngineInfo) -> list[LogprobGatherer]:
    """Offer logprob gatherers (see :class:`gyrfalcon.policies.LogprobGatherer`).

    Called once when the engine starts. Each gatherer picks, from the same batched log-softmax the
    step sampled from (raw: before any processor), which token ids to report at each position
    (top-k, explicit ids, …) and declares the fields it honours. It returns its picks as a
    :class:`gyrfalcon.policies.Gathered` left on the device, so that they reach the host with the
    step's sampled ids in one transfer (a list of host pairs still works, at the cost of a sync of
    its own). Generated-position gatherers hear the persistent batch's ``add_row`` and
    ``remove_row`` events as processors do. A gatherer whose ``positions`` is ``"prompt"`` runs
    once per request on its prefill's logits instead, one row per prompt position
    (``prompt_logprobs``). The engine merges every gatherer's ids behind the position's own
    token, without duplicates, and clamps values to -9999.0.
    """
