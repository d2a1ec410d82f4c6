"""Speculative decoding: draft tokens proposed cheaply, then verified by the model in one step."""
