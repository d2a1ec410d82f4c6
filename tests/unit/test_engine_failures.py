"""A step that raises fails the requests it held, in-band, and the loop keeps serving."""

from __future__ import annotations

from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings
from tests.unit.test_batching import PROMPTS, request


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny_model_dir):
    engine = create_transformers_engine(tiny_settings(tiny_model_dir))
    try:
        assert engine.wait_ready(60).ready
        forward = engine.runner.forward
        calls = {"n": 0}

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("boom")
            return forward(*args, **kwargs)

        engine.runner.forward = flaky
        (last,) = list(engine.submit(request(PROMPTS[0], n=2, temperature=1.0, max_tokens=10, ignore_eos=True)))
        assert last.finished and last.error is not None and "boom" in last.error.message
        assert engine.stats()["requests_failed"] == 1 and not engine._live
        (ok,) = list(engine.submit(request(PROMPTS[1], temperature=0.0, max_tokens=5, ignore_eos=True)))
        assert ok.error is None and len(ok.outputs[0].token_ids) == 5
    finally:
        engine.shutdown(0)
