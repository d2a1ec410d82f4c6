"""Serving logic: run a translated request on the engine and shape its outputs for the wire.

Knows the OpenAI and generate response shapes; knows nothing of HTTP (the API layer turns the
dicts and chunks produced here into bodies and SSE events).
"""
