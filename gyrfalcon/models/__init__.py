"""Model folders: loading a local Hugging Face folder, and the tiny test model."""

from gyrfalcon.models.loading import load_model, load_model_and_tokenizer, load_tokenizer
from gyrfalcon.models.tiny import build_tiny_model

__all__ = ["build_tiny_model", "load_model", "load_model_and_tokenizer", "load_tokenizer"]
