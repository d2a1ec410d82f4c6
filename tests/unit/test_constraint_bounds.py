"""A constraint or tool schema is bounded before any work, and its checks are cached by a hash
within a byte budget (``gyrfalcon.structured.grammar``): distinct large schemas cannot grow a worker."""

from __future__ import annotations

import pytest

from gyrfalcon.errors import RequestError
from gyrfalcon.structured import grammar
from gyrfalcon.structured.grammar import MAX_CONSTRAINT_BYTES, MAX_CONSTRAINT_NODES, DigestCache, check_json_schema


def _schema(i: int, properties: int) -> dict:
    return {"type": "object", "properties": {f"p{i}_{j:06d}": {"type": "integer"} for j in range(properties)}}


def test_a_schema_larger_than_the_bound_is_refused_before_any_check():
    big = _schema(0, MAX_CONSTRAINT_BYTES // 20)
    with pytest.raises(RequestError, match="bytes as JSON; at most") as refused:
        check_json_schema(big, "tools.0.function.parameters")
    assert refused.value.param == "tools.0.function.parameters"
    wide = {"anyOf": [{"enum": [[] for _ in range(1_000)]} for _ in range(MAX_CONSTRAINT_NODES // 1_000 + 1)]}
    with pytest.raises(RequestError, match="more than 20,000 objects and arrays"):
        grammar.bounded_key(wide, "structured_outputs.json")
    check_json_schema(_schema(1, 100), "tools.0.function.parameters")  # within the bounds: checked


def test_the_checks_keep_digests_within_a_byte_budget():
    """30 distinct 12 KB schemas: the cache keeps a digest and a verdict each, not the schemas."""
    before = grammar._SCHEMA_PROBLEMS.bytes
    for i in range(30):
        check_json_schema(_schema(i + 10, 400), "response_format.json_schema.schema")
    assert 0 < grammar._SCHEMA_PROBLEMS.bytes - before <= 30 * 200
    assert grammar._SCHEMA_PROBLEMS.bytes <= grammar.CACHE_BYTES


def test_a_digest_cache_stays_within_its_budget_and_skips_large_values():
    computed = []

    def compute(text: str) -> str:
        computed.append(text)
        return text * 10

    cache = DigestCache(len, budget=20_000, entry_bytes=5_000)
    for i in range(100):
        assert cache.get(f"{i:0100d}", compute) == f"{i:0100d}" * 10
    assert cache.bytes <= 20_000 and 0 < len(cache) < 100
    assert cache.get(f"{99:0100d}", compute) == f"{99:0100d}" * 10 and len(computed) == 100  # a hit
    size = len(cache)
    cache.get("x" * 1_000, compute)  # 10,000 bytes: computed, not kept
    assert len(cache) == size
    cache.get("x" * 1_000, compute)
    assert computed[-2:] == ["x" * 1_000] * 2


def test_a_constraint_is_compiled_at_submit_and_the_step_loop_only_copies_it(tiny_engine, monkeypatch):
    """The structured-output processor compiles a constraint when the engine takes the request
    (its ``prepare``, at submit, off the step loop that every running request waits on); a row
    joining the batch copies the cached matcher; the compiled matchers are kept within a byte budget."""
    from gyrfalcon.engine_api.types import EngineRequest, OutputKind, SamplingParams
    from gyrfalcon.policies import NewRow
    from gyrfalcon.structured import processor as module

    (structured,) = [p for p in tiny_engine.core.processors if p.name == "structured_outputs"]
    params = SamplingParams(structured_outputs={"regex": "[a-f]{3}-compiled-at-submit"}, max_tokens=2)
    held = structured._compiled.bytes
    with tiny_engine.submit(EngineRequest("compiled-at-submit", [1, 2], params, OutputKind.FINAL_ONLY)) as stream:
        assert structured._compiled.bytes > held  # before any step could take the row
        assert list(stream)[-1].finished

    def compile_again(constraint):
        raise AssertionError("the step loop compiled a constraint")

    monkeypatch.setattr(structured, "_compile", compile_again)
    structured.add_row(63, NewRow(params, {}, [1, 2], [], tiny_engine.info().vocab_size, "cpu"))
    assert not structured._rows[63].matcher.is_error()
    structured.remove_row(63)
    assert structured._compiled.bytes <= module.CACHE_BYTES
