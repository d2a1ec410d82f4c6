"""Session fixtures: the tiny random model (built once, offline) and a started engine on it."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# before any BLAS call of the session: in-process engines compute each row alone, as a server does
from gyrfalcon.engine.determinism import ask_for_reproducible_blas  # noqa: E402

ask_for_reproducible_blas()

import pytest  # noqa: E402

TINY_MAX_MODEL_LEN = 128
TINY_MAX_NUM_SEQS = 8


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder holding the tiny random Llama and its BPE tokenizer (see gyrfalcon.models.tiny)."""
    from gyrfalcon.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


def tiny_settings(model_dir: str, **overrides):
    """Settings for an engine on the tiny model: context 128, 8 sequences, fp32 on CPU, seed 0, eager
    (the compiled decode step is tested once, in tests/unit/test_decode_path.py)."""
    from gyrfalcon.config import Settings

    values = dict(model=model_dir, max_model_len=TINY_MAX_MODEL_LEN, max_num_seqs=TINY_MAX_NUM_SEQS,
                  max_queue_len=16, dtype="float32", device="cpu", seed=0, num_threads=1, enforce_eager=True)  # fmt: skip
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: str):
    """A started ``TransformersEngine`` on the tiny model, ready (loaded and warmed up)."""
    from gyrfalcon.plugins.engines import create_transformers_engine

    engine = create_transformers_engine(tiny_settings(tiny_model_dir))
    health = engine.wait_ready(timeout=120)
    assert health.ready, health.message
    yield engine
    engine.shutdown(grace=1.0)


#: limits of the live test server: small, so that every valid request (and fuzzing) stays fast
LIVE_ARGS = ["--max-model-len", "64", "--max-num-seqs", "8", "--served-model-name", "tiny", "--max-queue-len", "32",
             "--num-threads", "1"]  # fmt: skip


@pytest.fixture(scope="session")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """``gyrfalcon serve`` on the tiny model under gunicorn (a subprocess), torn down at the end."""
    from tests.live_server import start_server, stop_server

    log = tmp_path_factory.mktemp("live") / "server.log"
    server = start_server(["--model", tiny_model_dir, *LIVE_ARGS], str(log))
    try:
        yield server
    finally:
        stop_server(server)
