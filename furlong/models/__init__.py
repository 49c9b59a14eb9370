"""Models: the local tiny-model and tokenizer factory, and loading from a local directory."""

from furlong.models.factory import ARCHS, SIZES, create_model, load_model, load_tokenizer

__all__ = ["ARCHS", "SIZES", "create_model", "load_model", "load_tokenizer"]
