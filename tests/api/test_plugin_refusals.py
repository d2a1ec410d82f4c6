"""A third-party plugin's ``gyrfalcon_validate_request`` refusing over HTTP: a 400 naming the field
as the client wrote it, whatever kind the plugin gives its error; an engine's failure stays a 500."""

from __future__ import annotations

import pytest

from gyrfalcon import hookimpl
from gyrfalcon.api.errors import http_status
from gyrfalcon.config import Settings
from gyrfalcon.engine_api.types import EngineError
from gyrfalcon.errors import RequestError
from gyrfalcon.plugins import plugin_manager
from tests.helpers import api_client, served_app


class HouseRules:
    """Refuses hot sampling under a kind of its own, and stop ids with the default kind."""

    @hookimpl
    def gyrfalcon_validate_request(self, endpoint, request, info):
        if request.sampling.temperature > 1.5:
            raise RequestError("this deployment samples at temperature 1.5 at most", "temperature", type="house_rule")
        if request.sampling.stop_token_ids:
            raise RequestError("stop_token_ids are not allowed here", "stop_token_ids")


@pytest.fixture(scope="module")
def client(tiny_engine, tiny_model_dir):
    pm = plugin_manager()
    pm.register(HouseRules(), name="house-rules")
    settings = Settings(model=str(tiny_model_dir), served_model_name=["tiny"])
    return api_client(served_app(tiny_engine, settings, pm))


@pytest.mark.parametrize(
    ("path", "body", "param", "type_"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 1.9}, "temperature", "house_rule"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.9}, "temperature",
         "house_rule"),
        ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"stop_token_ids": [7], "max_tokens": 2}},
         "sampling_params.stop_token_ids", "BadRequestError"),
    ],
)  # fmt: skip
def test_a_plugin_refusal_is_a_400_naming_the_wire_field(client, path, body, param, type_):
    r = client.simulate_post(path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json["error"]["param"] == param and r.json["error"]["type"] == type_ and r.json["error"]["code"] == 400


def test_an_engine_failure_of_a_kind_of_its_own_stays_a_500():
    assert http_status(EngineError("the kernel library vanished", type="lost_kernels")) == 500
    assert http_status(RequestError("refused", "x", type="house_rule")) == 400
