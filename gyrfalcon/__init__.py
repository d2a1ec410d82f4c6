"""gyrfalcon: an OpenAI-compatible LLM inference server that returns exactly what was asked."""

from gyrfalcon.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["__version__", "hookimpl"]
