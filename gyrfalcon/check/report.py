"""The report of a run: one line per check for people, JSON and JUnit XML for machines."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import Counter

from gyrfalcon.check.registry import Outcome, Result

_MARK = {Outcome.PASSED: "PASS", Outcome.FAILED: "FAIL", Outcome.UNSUPPORTED: "UNSUPPORTED",
         Outcome.INCONCLUSIVE: "INCONCLUSIVE", Outcome.ERROR: "ERROR"}


def line(result: Result) -> str:
    """``PASS  chat.n_choices  (0.12 s)``; a failure adds its reason and its curl line."""
    text = f"{_MARK[result.outcome]:<12} {result.check.name}  ({result.seconds:.2f} s)"
    if result.message:
        text += f"\n             {result.message}"
    if result.reproduce:
        text += f"\n             reproduce: {result.reproduce}"
    return text


def counts(results: list[Result]) -> Counter:
    return Counter(r.outcome.value for r in results)


def summary(results: list[Result]) -> str:
    c = counts(results)
    return (f"{len(results)} checks: {c['passed']} passed, {c['failed']} failed, {c['unsupported']} unsupported"
            f", {c['inconclusive']} inconclusive, {c['error']} errors")  # fmt: skip


def to_json(results: list[Result], target_url: str, model: str | None) -> str:
    return json.dumps({
        "target": target_url, "model": model, "summary": dict(counts(results)),
        "checks": [{"name": r.check.name, "endpoint": r.check.endpoint, "features": list(r.check.features),
                    "outcome": r.outcome.value, "message": r.message, "reproduce": r.reproduce,
                    "seconds": round(r.seconds, 3), "promise": r.check.doc} for r in results],
    }, indent=2)  # fmt: skip


def to_junit(results: list[Result], target_url: str) -> str:
    """One testsuite; a failure is a <failure>, unsupported and inconclusive a <skipped>, an error an <error>."""
    c = counts(results)
    suite = ET.Element("testsuite", name="gyrfalcon-check", tests=str(len(results)), failures=str(c["failed"]),
                       errors=str(c["error"]), skipped=str(c["unsupported"] + c["inconclusive"]),
                       time=f"{sum(r.seconds for r in results):.3f}")  # fmt: skip
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="target", value=target_url)
    for r in results:
        case = ET.SubElement(suite, "testcase", classname=f"gyrfalcon.check.{r.check.endpoint}", name=r.check.name,
                             time=f"{r.seconds:.3f}")  # fmt: skip
        if r.outcome is Outcome.FAILED:
            ET.SubElement(case, "failure", message=r.message[:500]).text = f"{r.message}\nreproduce: {r.reproduce}"
        elif r.outcome is Outcome.ERROR:
            ET.SubElement(case, "error", message=r.message[:500]).text = r.message
        elif r.outcome in (Outcome.UNSUPPORTED, Outcome.INCONCLUSIVE):
            ET.SubElement(case, "skipped", message=f"{r.outcome.value}: {r.message[:480]}")
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)
