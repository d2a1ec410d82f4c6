"""`serve run gyrfalcon.ray:app key=value …`: the keys are `gyrfalcon serve`'s options, parsed by its parser."""

from __future__ import annotations

import pytest

from gyrfalcon.ray.app import settings_from_options


def test_keys_are_serve_options_with_their_types_and_flags(tiny_model_dir):
    settings, keys_file = settings_from_options({"model": tiny_model_dir, "replicas": "2", "max-replicas": "4",
                                                 "enable_prefix_caching": "false", "enforce_eager": "true",
                                                 "served_model_name": "a b", "routing": "pow2", "replica_cpus": "0.5"})  # fmt: skip
    assert (settings.replicas, settings.max_replicas, settings.replica_cpus) == (2, 4, 0.5)
    assert settings.enable_prefix_caching is False and settings.enforce_eager is True
    assert settings.served_model_name == ["a", "b"] and settings.routing == "pow2" and settings.ray
    assert keys_file is None


def test_a_bad_option_is_refused_as_the_command_line_would(tiny_model_dir):
    with pytest.raises(SystemExit):
        settings_from_options({"model": tiny_model_dir, "routing": "nearest"})
    with pytest.raises(ValueError, match="--replicas"):
        settings_from_options({"model": tiny_model_dir, "replicas": "3", "max_replicas": "2"})


def test_api_keys_go_to_a_private_file(tiny_model_dir, monkeypatch):
    import json
    import os
    import stat

    monkeypatch.setenv("GYRFALCON_API_KEY", "sekret")
    settings, keys_file = settings_from_options({"model": tiny_model_dir})
    try:
        assert json.load(open(keys_file)) == ["sekret"]
        assert stat.S_IMODE(os.stat(keys_file).st_mode) == 0o600
    finally:
        os.unlink(keys_file)
