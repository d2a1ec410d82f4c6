"""The plugin host: built-in plugins and third-party entry points, registered the same way."""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any

import pluggy

from gyrfalcon import hookspecs

#: Built-in behaviour, registered exactly like a third-party plugin (by module path).
DEFAULT_PLUGINS: tuple[str, ...] = (
    "gyrfalcon.plugins.engines",
    "gyrfalcon.plugins.sampling",
    "gyrfalcon.plugins.penalties",
    "gyrfalcon.plugins.logprobs",
    "gyrfalcon.plugins.structured_outputs",
    "gyrfalcon.plugins.tool_parsers",
)


def _plugin_modules() -> list[tuple[str, Any]]:
    """(name, loader) for every built-in plugin and every ``gyrfalcon`` entry point."""
    found: list[tuple[str, Any]] = [(path, lambda path=path: importlib.import_module(path)) for path in DEFAULT_PLUGINS]
    for ep in metadata.entry_points(group=hookspecs.PROJECT):
        found.append((ep.name, ep.load))
    return found


def plugin_manager(allow: list[str] | None = None, block: list[str] | tuple[str, ...] = ()) -> pluggy.PluginManager:
    """A plugin manager with the hook specifications, the built-ins and the installed plugins.

    ``allow`` (None: all) and ``block`` filter by plugin name: a built-in's module path or a
    third-party entry point's name. A misspelt hook implementation fails here (``check_pending``).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name, load in _plugin_modules():
        if name in block or (allow is not None and name not in allow):
            continue
        if pm.has_plugin(name):
            raise RuntimeError(f"two plugins are named {name!r}")
        pm.register(load(), name=name)
    pm.check_pending()
    return pm


def settings_plugin_manager(settings: Any) -> pluggy.PluginManager:
    """The plugin manager a :class:`gyrfalcon.config.Settings` names (``--plugins-allow`` /
    ``--plugins-block``): what every process that serves builds (:func:`gyrfalcon.compose.plugins`)."""
    return plugin_manager(settings.plugins_allow, settings.plugins_block)


def merged_dict(results: list[dict[str, Any] | None], what: str) -> dict[str, Any]:
    """Merge the dicts returned by a hook's implementations; a key offered twice is an error."""
    merged: dict[str, Any] = {}
    for result in results:
        for key, value in (result or {}).items():
            if key in merged:
                raise RuntimeError(f"{what} {key!r} is offered by two plugins")
            merged[key] = value
    return merged


def installed(results: list[dict[str, Any] | None], what: str, name: str) -> Any:
    """The offer named ``name`` among a hook's merged offers (:func:`merged_dict`); ValueError,
    naming the option and what is installed, when no plugin offers it."""
    offers = merged_dict(results, what)
    if name not in offers:
        flag = "--" + what.replace(" ", "-")
        raise ValueError(f"{flag} {name!r} is not installed; available: {', '.join(sorted(offers))}")
    return offers[name]
