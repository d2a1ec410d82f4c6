"""Tool calling on the API side: the parsers of tool-call conventions (:mod:`.parsers`)."""
