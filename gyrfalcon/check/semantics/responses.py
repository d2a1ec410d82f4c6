"""Promises of the Responses API (/v1/responses): the event stream's order and framing, its text
the concatenated deltas, the stored state, and refusals that name their field."""

from __future__ import annotations

from typing import Any

from gyrfalcon.check.registry import Broken, Unsupported, check
from gyrfalcon.check.semantics.flavours import expect
from gyrfalcon.check.target import Reply, accepted, refused

PATH = "/v1/responses"
BASE = {"input": "Say something.", "max_output_tokens": 8}


def _created(target) -> Reply:
    """A plain request's Response; a server that refuses it loudly (the route missing, or a 4xx:
    a model without a chat template cannot render its input) does not offer the API."""
    reply = target.post(PATH, {"model": target.model, **BASE})
    if reply.status in (404, 405):
        raise Unsupported(f"POST {PATH}: the route is missing ({reply.status})")
    return accepted(reply)


def _text(response: dict[str, Any]) -> str:
    return "".join(part.get("text", "") for item in response.get("output") or [] if item.get("type") == "message"
                   for part in item.get("content") or [])  # fmt: skip


@check("responses")
def response_object(target):
    """A Response: its id, object, status, output items (a message of output_text parts) and usage
    with input, output and total tokens."""
    body = _created(target).json
    expect(isinstance(body.get("id"), str) and body.get("object") == "response", f"not a Response: {str(body)[:200]}")
    expect(body.get("status") in ("completed", "incomplete"), f"status {body.get('status')!r}")
    expect(isinstance(body.get("output"), list) and all(i.get("type") in ("message", "function_call") for i in body["output"]),
           f"output items {str(body.get('output'))[:200]}")  # fmt: skip
    usage = body.get("usage") or {}
    expect(all(isinstance(usage.get(k), int) for k in ("input_tokens", "output_tokens", "total_tokens"))
           and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"], f"usage {usage}")  # fmt: skip


def _events(reply: Reply) -> list[dict[str, Any]]:
    events = reply.events
    expect(bool(events) and all(isinstance(e, dict) for e in events), f"the stream's events: {str(events)[:200]}")
    if "[DONE]" in events:
        raise Broken("a Responses stream ends with its last event, not data: [DONE]")
    return events


@check("responses", "stream")
def stream_events_in_order(target):
    """Streamed: response.created, response.in_progress, the message's item and part added, its
    deltas, the done events, then response.completed (or .incomplete); every event its
    sequence_number in order, and its text is the concatenated deltas."""
    reply = target.post(PATH, {"model": target.model, **BASE, "stream": True})
    if reply.status in (404, 405):
        raise Unsupported(f"POST {PATH}: the route is missing ({reply.status})")
    events = _events(accepted(reply))
    kinds = [e.get("type") for e in events]
    expect(kinds[:2] == ["response.created", "response.in_progress"], f"the stream opens with {kinds[:2]}")
    expect(kinds[-1] in ("response.completed", "response.incomplete"), f"the stream ends with {kinds[-1:]}")
    expect([e.get("sequence_number") for e in events] == list(range(len(events))),
           f"sequence numbers {[e.get('sequence_number') for e in events][:20]}")  # fmt: skip
    if "response.output_text.delta" in kinds:
        first, done = kinds.index("response.output_text.delta"), kinds.index("response.output_text.done")
        expect("response.output_item.added" in kinds[:first] and "response.content_part.added" in kinds[:first],
               f"deltas before their item and part were added: {kinds[:first + 1]}")  # fmt: skip
        expect(first < done < kinds.index("response.content_part.done") < len(kinds) - 1, f"the done events: {kinds}")
    deltas = "".join(e.get("delta", "") for e in events if e.get("type") == "response.output_text.delta")
    final = events[-1].get("response") or {}
    expect(_text(final) == deltas, f"the final text {_text(final)[:80]!r} is not the deltas {deltas[:80]!r}")
    dones = [e.get("text") for e in events if e.get("type") == "response.output_text.done"]
    expect(dones in ([], [deltas]), f"output_text.done's text {str(dones)[:80]} is not the deltas")


@check("responses", "store")
def stored_state(target):
    """A stored response (store defaults to true) is retrieved as it was answered, lists its input
    items, continues through previous_response_id, and once deleted is a 404."""
    body = _created(target).json
    again = target.get(f"{PATH}/{body['id']}")
    if again.status in (404, 405) and target.get(f"{PATH}/gyrfalcon-check-no-such-id").status == 405:
        raise Unsupported("GET /v1/responses/{id} is missing")
    expect(again.status == 200 and again.json.get("id") == body["id"] and _text(again.json) == _text(body),
           f"GET {PATH}/{{id}}: {again.describe()}")  # fmt: skip
    items = target.get(f"{PATH}/{body['id']}/input_items")
    expect(items.status == 200 and items.json.get("object") == "list" and len(items.json.get("data") or []) == 1,
           f"input_items: {items.describe()}")  # fmt: skip
    chained = target.post(PATH, {"model": target.model, **BASE, "previous_response_id": body["id"]})
    expect(chained.status == 200 and chained.json["usage"]["input_tokens"] > body["usage"]["input_tokens"],
           f"a continuation sees the earlier turns: {chained.describe()}")  # fmt: skip
    gone = target.request("DELETE", f"{PATH}/{body['id']}")
    expect(gone.status == 200 and gone.json.get("deleted") is True, f"DELETE: {gone.describe()}")
    expect(target.get(f"{PATH}/{body['id']}").status == 404, "a deleted response is still there")


#: (name, body fields, param)
REFUSALS = [
    ("an unknown previous_response_id", {"previous_response_id": "resp_gyrfalcon_check_none"}, "previous_response_id"),
    ("max_output_tokens 0", {"max_output_tokens": 0}, "max_output_tokens"),
    ("temperature -1", {"temperature": -1}, "temperature"),
    ("a tool_choice naming no tool", {"tools": [{"type": "function", "name": "f"}],
                                      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ("an invalid text.format schema", {"text": {"format": {"type": "json_schema", "name": "x",
                                                           "schema": {"type": "nonsense"}}}}, "text.format"),
]  # fmt: skip


@check("responses", params=[(name, (body, param)) for name, body, param in REFUSALS])
def refusals_name_their_field(target, case):
    """What a Responses request cannot get is a 400 (a 404 for an unknown stored response) naming
    its field as the Responses API writes it."""
    body, param = case
    reply = target.post(PATH, {"model": target.model, **BASE, **body})
    if reply.status == 404 and param == "previous_response_id":
        error = reply.error()
        expect(param in str(error.get("param")) or "previous_response_id" in str(error.get("message")),
               f"the 404 does not name previous_response_id: {reply.describe()}")  # fmt: skip
        return
    refused(reply, param)
