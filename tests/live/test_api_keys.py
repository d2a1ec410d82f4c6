"""API keys from ``--api-key``, ``$GYRFALCON_API_KEY`` and ``--api-key-file``, all honoured, none of
them in the environment of the server's processes (where children and /proc would see them)."""

from __future__ import annotations

import os
import subprocess

import pytest
import requests

from tests.live_server import start_server, stop_server

pytestmark = pytest.mark.live
KEYS = ("#from-flag-1", "from-env-22", "from-file-333")  # a key may start with "#"


def test_keys_from_flag_env_and_file_and_never_in_an_environment(tiny_model_dir, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# one per line\n{KEYS[2]}\n\n")
    server = start_server(["--model", tiny_model_dir, "--api-key", KEYS[0], "--api-key-file", str(keys_file)],
                          str(tmp_path / "server.log"), env={"GYRFALCON_API_KEY": KEYS[1]})  # fmt: skip
    try:
        body = {"prompt": "hi", "max_tokens": 1}
        assert requests.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 401
        for key in KEYS:
            r = requests.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
            assert r.status_code == 200, (key, r.text)
        processes, parents = [], [str(server.process.pid)]
        while parents:  # the launcher, the engine process, gunicorn's master and its workers
            processes += parents
            parents = subprocess.run(["pgrep", "-P", ",".join(parents)], capture_output=True, text=True).stdout.split()
        assert len(processes) >= 4, server.log()
        for pid in processes:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            assert not any(key.encode() in environ for key in KEYS), pid
        keys_path = next(v for k, v in (e.split(b"=", 1) for e in environ.split(b"\0") if b"=" in e)
                         if k == b"GYRFALCON_API_KEYS_FILE").decode()  # fmt: skip
        assert os.stat(keys_path).st_mode & 0o077 == 0  # only this user reads it
    finally:
        stop_server(server)
    assert not os.path.exists(keys_path)  # removed when the server exits


def test_a_key_source_that_holds_no_key_stops_the_server_instead_of_opening_it(tmp_path, monkeypatch):
    from gyrfalcon.cli import main

    empty = tmp_path / "keys"
    empty.write_text("# nothing yet\n\n")
    assert main(["serve", "--api-key-file", str(empty)]) == 2
    monkeypatch.setenv("GYRFALCON_API_KEY", "")
    assert main(["serve"]) == 2
    monkeypatch.delenv("GYRFALCON_API_KEY")
    assert main(["serve", "--api-key", " padded "]) == 2
