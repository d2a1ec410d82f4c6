"""The built-in engine backend: ``transformers`` (torch is imported only when it is built)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gyrfalcon.hookspecs import hookimpl

if TYPE_CHECKING:  # pragma: no cover
    from gyrfalcon.config import Settings
    from gyrfalcon.engine.transformers_engine import TransformersEngine


def create_transformers_engine(settings: Settings, pm: Any = None, **kwargs: Any) -> TransformersEngine:
    """Build and start a :class:`TransformersEngine`.

    ``pm``: the app's plugin manager, whose engine hooks are resolved once now; when None the
    engine builds its own from ``settings.plugins_allow`` / ``settings.plugins_block``. Extra
    keyword arguments (``model_path``, ``start``) go to the engine. Without ``model_path``, a
    ``.gguf`` or unset ``settings.model`` is resolved to its converted cache folder
    (:func:`gyrfalcon.models.default.resolve_model`; a folder is used as it is).
    """
    from gyrfalcon.engine.transformers_engine import TransformersEngine

    if kwargs.get("model_path") is None:
        from gyrfalcon.models.default import resolve_model

        kwargs["model_path"] = resolve_model(settings.model, settings.cache_dir)
    return TransformersEngine(settings, pm, **kwargs)


@hookimpl
def gyrfalcon_engines() -> dict[str, Any]:
    """Offer the ``transformers`` backend."""
    return {"transformers": create_transformers_engine}
