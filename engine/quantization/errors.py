"""The errors of a quantization setting the model, checkpoint or device cannot run."""

from __future__ import annotations


class QuantizationError(ValueError):
    """A quantization setting this model, checkpoint or device cannot run; the message names
    the value and what is supported. Raised at start-up, before the model serves anything."""


class QuantizationFormatError(QuantizationError):
    """A pre-quantized checkpoint whose format, bits, version or tensor layout is unsupported.

    The message names the tensor (or config key) and the value that was refused.
    """
