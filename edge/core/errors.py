"""Typed errors. Each says what was found, what was expected, and what to do."""


class ZllmError(Exception):
    """Base of every error zllm-edge raises on purpose; the CLI prints these without a traceback."""


class ConversionError(ZllmError):
    """The source model cannot be converted (missing or malformed files)."""


class UnsupportedModelError(ConversionError):
    """The source is well-formed but its architecture or tokenizer is not supported."""


class CheckpointError(ZllmError):
    """A zllm checkpoint is missing, malformed, or of an unsupported format version."""


class SessionError(ZllmError):
    """A session was asked for something its state does not allow (context or cache full)."""


class NumericalError(ZllmError):
    """A model computed NaN or infinite values (its logits): damaged weights or config, or a device that
    computes wrongly."""


class ExpertCacheError(ZllmError):
    """A device's expert cache cannot hold what the model needs at once (the message names the minimum)."""


class InvalidArgumentError(ZllmError, ValueError):
    """An argument of the API or the CLI has the wrong type or value; the message names it, what it got
    and what it accepts. Also a ValueError, which is what such a mistake raised before it was typed."""
