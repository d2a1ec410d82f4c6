"""The plugin host: documented hooks, built-ins registered like third-party plugins, filters."""

from __future__ import annotations

import inspect

import pytest

from gyrfalcon import hookspecs
from gyrfalcon.plugins import DEFAULT_PLUGINS, merged_dict, plugin_manager


def hookspec_functions():
    return [f for name, f in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("gyrfalcon_")]


def test_every_hook_is_documented():
    hooks = hookspec_functions()
    assert len(hooks) >= 8
    for hook in hooks:
        doc = inspect.getdoc(hook) or ""
        assert len(doc.split()) >= 12, f"{hook.__name__} needs a docstring contract"


def test_builtins_are_registered_by_name_like_entry_points():
    pm = plugin_manager()
    names = {pm.get_name(p) for p in pm.get_plugins()}
    assert set(DEFAULT_PLUGINS) <= names
    assert "transformers" in merged_dict(pm.hook.gyrfalcon_engines(), "engine")


def test_blocklist_and_allowlist():
    pm = plugin_manager(block=["gyrfalcon.plugins.sampling"])
    assert not pm.has_plugin("gyrfalcon.plugins.sampling")
    pm = plugin_manager(allow=["gyrfalcon.plugins.engines"])
    assert [pm.get_name(p) for p in pm.get_plugins()] == ["gyrfalcon.plugins.engines"]


def test_misspelt_hook_implementation_fails_at_startup():
    pm = plugin_manager()

    class Typo:
        @hookspecs.hookimpl
        def gyrfalcon_logits_procesors(self, info):  # noqa: D401 - deliberately misspelt
            return []

    pm.register(Typo())
    with pytest.raises(Exception, match="unknown hook"):
        pm.check_pending()


def test_two_plugins_offering_one_name_is_an_error():
    with pytest.raises(RuntimeError, match="offered by two plugins"):
        merged_dict([{"x": 1}, {"x": 2}], "engine")
