"""The error every pre-quantized checkpoint reader raises for a file it cannot use."""

from __future__ import annotations


class QuantizationFormatError(ValueError):
    """A pre-quantized checkpoint whose format, bits, version or tensor layout is unsupported.

    The message names the tensor (or config key) and the value that was refused.
    """
