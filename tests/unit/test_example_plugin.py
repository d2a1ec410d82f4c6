"""The third-party example package, installed with pip, is loaded through its entry point and
changes a response."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gyrfalcon-example-plugin"

PROBE = textwrap.dedent(
    """
    import json, sys
    from gyrfalcon.config import Settings
    from gyrfalcon.plugins import plugin_manager
    from gyrfalcon.plugins.engines import create_transformers_engine
    from tests.helpers import api_client, served_app

    pm = plugin_manager()
    assert pm.has_plugin("suppress_tokens"), [pm.get_name(p) for p in pm.get_plugins()]
    settings = Settings(model=sys.argv[1], max_model_len=64, served_model_name=["tiny"], enforce_eager=True)
    engine = create_transformers_engine(settings, pm)
    assert engine.wait_ready(60).ready
    client = api_client(served_app(engine, settings, pm))
    body = {"token_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_tokens": 3, "ignore_eos": True}}
    plain = client.simulate_post("/inference/v1/generate", json=body).json["choices"][0]["token_ids"]
    body["extensions"] = {"suppress_token_ids": [plain[0]]}
    changed = client.simulate_post("/inference/v1/generate", json=body).json["choices"][0]["token_ids"]
    bad = client.simulate_post("/inference/v1/generate", json={**body, "extensions": {"suppress_token_ids": [-1]}})
    spec = client.simulate_get("/openapi.json").json
    route = client.simulate_get("/suppress_token_ids")
    head = client.simulate_head("/suppress_token_ids")
    ext = spec["components"]["schemas"]["Extensions"]["properties"]["suppress_token_ids"]
    print(json.dumps({"plain": plain, "changed": changed, "bad": [bad.status_code, bad.json["error"]["param"]],
                      "max_id": ext["items"]["maximum"], "caps": sorted(engine.info().capabilities),
                      "route": [route.status_code, route.json], "head": [head.status_code, head.text]}))
    engine.shutdown(1)
    """
)


@pytest.mark.slow
def test_example_plugin_loaded_through_its_entry_point(tmp_path, tiny_model_dir):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(EXAMPLE)],
        check=True,
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", PROBE, tiny_model_dir], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["changed"][0] != result["plain"][0]  # the suppressed token never comes
    assert result["plain"][0] not in result["changed"]
    assert result["bad"] == [400, "extensions.suppress_token_ids.0"]
    assert result["max_id"] == 511  # x-token-id: capped below the tiny vocabulary
    assert "suppress_token_ids" in result["caps"]
    # its async route, HEAD included
    assert result["route"] == [200, {"field": "extensions.suppress_token_ids", "max_items": 16, "max_token_id": 511}]
    assert result["head"] == [200, ""]
