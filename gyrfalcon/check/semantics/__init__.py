"""The semantic checks, one module per endpoint group; importing this package registers them all
(in report order)."""

from gyrfalcon.check.semantics import models, texts, completions, chat, generate, batch, errors  # noqa: F401
