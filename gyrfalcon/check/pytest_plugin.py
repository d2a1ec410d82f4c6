"""``pytest --gyrfalcon-url URL``: gyrfalcon's checks as tests of a team's own suite.

Registered through the ``pytest11`` entry point; without ``--gyrfalcon-url`` it adds nothing. One
test per semantic check (``gyrfalcon-check::<name>``, so ``-k`` selects them), plus one per
operation of the Schemathesis phase when ``schema`` is among ``--gyrfalcon-only``'s groups. An
unsupported feature is a skip (``--gyrfalcon-strict`` makes it a failure); an inconclusive check is
a skip either way.
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gyrfalcon", "gyrfalcon check: the OpenAI-compatible contract of a server")
    group.addoption("--gyrfalcon-url", default=None, help="check the server at this URL")
    group.addoption("--gyrfalcon-model", default=None, help="the model to check (default: the first listed)")
    group.addoption("--gyrfalcon-api-key", default=None, help="Bearer token (also $GYRFALCON_CHECK_API_KEY)")
    group.addoption("--gyrfalcon-only", default=None, help="comma-separated endpoint groups (default: all but schema)")
    group.addoption("--gyrfalcon-strict", action="store_true", help="an unsupported feature fails")


class CheckItem(pytest.Item):
    def __init__(self, *, check, target, strict: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.check, self.target, self.strict = check, target, strict

    def runtest(self) -> None:
        from gyrfalcon.check import Outcome, run_check

        result = run_check(self.target, self.check)
        if result.outcome is Outcome.UNSUPPORTED and not self.strict:
            pytest.skip(f"unsupported: {result.message}")
        if result.outcome is Outcome.INCONCLUSIVE:  # the model's doing, never the server's: strict or not
            pytest.skip(f"inconclusive: {result.message}")
        if result.outcome is not Outcome.PASSED:
            raise CheckFailed(result)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CheckFailed):
            r = excinfo.value.result
            return f"{r.outcome.value}: {self.check.doc}\n{r.message}" + (f"\nreproduce: {r.reproduce}" if r.reproduce else "")
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return "gyrfalcon-check", None, self.name


class SchemaItem(CheckItem):
    """One Schemathesis operation; the phase runs once, on the first of them."""

    def runtest(self) -> None:
        from gyrfalcon.check import Outcome

        result = self.parent.schema_results().get(self.check.name)
        if result is None:
            pytest.skip("Schemathesis did not test this operation")
        if result.outcome is not Outcome.PASSED:
            raise CheckFailed(result)


class CheckFailed(Exception):
    def __init__(self, result) -> None:
        super().__init__(result.message)
        self.result = result


class CheckCollector(pytest.Collector):
    def __init__(self, *, target, only: list[str] | None, strict: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.target, self.only, self.strict = target, only, strict
        self._schema: dict | None = None

    def schema_results(self) -> dict:
        if self._schema is None:
            from gyrfalcon.check.schema import run_schema

            self._schema = {r.check.name: r for r in run_schema(self.target, set(self.only or ()))}
        return self._schema

    def collect(self):
        from gyrfalcon.check import selected
        from gyrfalcon.check.registry import ENDPOINTS, Check

        groups = self.only or [g for g in ENDPOINTS if g != "schema"]
        for one in selected([g for g in groups if g != "schema"]):
            yield CheckItem.from_parent(self, name=one.name, check=one, target=self.target, strict=self.strict)
        if "schema" in groups:
            for name in self.schema_results():
                placeholder = Check(name, "schema", (), f"Schemathesis: {name}", lambda t: None)
                yield SchemaItem.from_parent(self, name=name, check=placeholder, target=self.target, strict=self.strict)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    url = config.getoption("gyrfalcon_url")
    if not url:
        return
    from gyrfalcon.check import Target
    from gyrfalcon.check.target import API_KEY_ENV

    only = config.getoption("gyrfalcon_only")
    target = Target(url, config.getoption("gyrfalcon_api_key") or os.environ.get(API_KEY_ENV),
                    config.getoption("gyrfalcon_model"))  # fmt: skip
    collector = CheckCollector.from_parent(session, name="gyrfalcon-check", target=target,
                                           only=[g.strip() for g in only.split(",")] if only else None,
                                           strict=config.getoption("gyrfalcon_strict"))  # fmt: skip
    items.extend(collector.collect())
