"""The rollouts' logprobs are the trainer's: every sampled token's logprob as served, in a mixed
batch (prompts of different lengths, ``n`` > 1, other requests beside), equals a plain
``transformers`` forward of the same fp32 weights over prompt + rollout (``gyrfalcon.bench.trainer_match``
measures the same at batch 1, 8 and 64 and on the default model)."""

from __future__ import annotations

from gyrfalcon.bench.trainer_match import gaps, prompts_of, serve
from gyrfalcon.compose import plugins
from gyrfalcon.config import Settings
from gyrfalcon.models.loading import load_weights
from gyrfalcon.validation import RequestValidator


def test_rollout_logprobs_equal_the_trainers_forward(tiny_engine, tiny_model_dir):
    info = tiny_engine.info()
    validator = RequestValidator.of(plugins(Settings(model=tiny_model_dir)), info)
    prompts, others = prompts_of(6, info.vocab_size, seed=1, longest=30), prompts_of(3, info.vocab_size, seed=2)
    rollouts = serve(tiny_engine, validator, prompts, n=2, others=others, max_tokens=16, seed=1)
    assert len(rollouts) == 12 and all(len(r.tokens) == len(r.logprobs) == 16 for r in rollouts)
    assert len({tuple(r.tokens) for r in rollouts}) > 6  # sampled: the choices differ
    trainer, _ = load_weights(tiny_model_dir, "float32", "cpu", "none")
    delta = gaps(trainer, rollouts)
    assert max(delta) <= 1e-5, max(delta)
