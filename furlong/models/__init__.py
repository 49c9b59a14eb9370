"""Models: the local tiny-model and tokenizer factory, loading a local directory, the TITO check."""

from furlong.models.factory import ARCHS, SIZES, create_model
from furlong.models.loading import ModelDirError, check_model_dir, load_model, load_tokenizer

__all__ = ["ARCHS", "SIZES", "ModelDirError", "check_model_dir", "create_model", "load_model", "load_tokenizer"]
