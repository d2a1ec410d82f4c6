"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar, structural tag)
compiled by llguidance into a token mask on the batch (:mod:`.processor`, in the engine), checked on
the API side first (:mod:`.grammar`). The built-in plugin :mod:`gyrfalcon.plugins.structured_outputs`
registers both through the ordinary hooks."""
