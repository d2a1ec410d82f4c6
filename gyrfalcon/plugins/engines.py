"""The built-in engine backend: ``transformers`` (torch is imported only when it is built)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gyrfalcon.hookspecs import hookimpl

if TYPE_CHECKING:  # pragma: no cover
    from gyrfalcon.client import EngineClient
    from gyrfalcon.config import Settings


def create_transformers_engine(
    settings: Settings, pm: Any = None, *, model_path: str | None = None, start: bool = True
) -> EngineClient:
    """Build (and with ``start``, start) a :class:`TransformersEngine` from the server's settings,
    behind the :class:`EngineClient` that does its text work (``.core`` is the engine itself).

    ``pm``: the app's plugin manager, whose engine hooks are resolved once now; None builds one
    from ``settings.plugins_allow`` / ``settings.plugins_block`` (standalone use and tests).
    Without ``model_path``, a ``.gguf`` or unset ``settings.model`` is resolved to its converted
    cache folder (:func:`gyrfalcon.models.default.resolve_model`; a folder is used as it is).
    """
    from gyrfalcon.engine.determinism import ask_for_reproducible_blas

    ask_for_reproducible_blas()  # before torch's first BLAS call: every way of building the engine gets it
    from gyrfalcon.client import EngineClient
    from gyrfalcon.engine.transformers_engine import TransformersEngine
    from gyrfalcon.engine_api.config import EngineConfig

    if model_path is None:
        from gyrfalcon.models.default import resolve_model

        model_path = resolve_model(settings.model, settings.cache_dir)
    if pm is None:
        from gyrfalcon.plugins import settings_plugin_manager

        pm = settings_plugin_manager(settings)
    core = TransformersEngine(EngineConfig.from_settings(settings, model_path), pm, start=start)
    return EngineClient(core, model_name=settings.served_names()[0])


def build_engine(settings: Settings, pm: Any) -> Any:
    """The engine backend named by ``settings.engine``, from the plugins' offers (an ``Engine``)."""
    from gyrfalcon.plugins import installed

    try:
        factory = installed(pm.hook.gyrfalcon_engines(), "engine", settings.engine)
    except ValueError as exc:  # the process cannot serve: it stops with that one line
        raise SystemExit(str(exc)) from None
    return factory(settings, pm)


def engine_core(engine: Any) -> Any:
    """The token-id core of an engine a factory built: what the engine process serves (an
    :class:`EngineClient`'s text work runs in the API workers instead)."""
    from gyrfalcon.client import EngineClient

    return engine.core if isinstance(engine, EngineClient) else engine


@hookimpl
def gyrfalcon_engines() -> dict[str, Any]:
    """Offer the ``transformers`` backend."""
    return {"transformers": create_transformers_engine}
