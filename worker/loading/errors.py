"""What loading a model raises, apart from the loaders so that each loader can raise them without
importing the module that picks it (loader.py)."""

from __future__ import annotations


class ModelNotFoundError(FileNotFoundError):
    """The named model does not exist or is not a kind we can load."""


class UnsupportedModelError(ValueError):
    """The file is valid GGUF but not a model this loader can build (architecture, tensor type)."""
