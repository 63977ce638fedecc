"""Quantization formats: schemes, INT8/INT4 per-group packing, quantize/dequantize, error metrics.

GGUF import lives in quant.gguf_import (imported on demand, it pulls in the gguf package).
"""

from quant.formats import (
    ALL_SCHEMES,
    CODECS,
    FORMATS,
    GROUP_SIZES,
    FormatInfo,
    Int4Codes,
    Int8Codes,
    QuantizedArraysError,
    QuantizedTensor,
    WIDE_SCALE_SCHEMES,
    Scheme,
    dequantize,
    quantize,
    symmetric_zero_point,
)
from quant.metrics import QuantError, quantization_error

__all__ = [
    "ALL_SCHEMES",
    "CODECS",
    "FORMATS",
    "GROUP_SIZES",
    "FormatInfo",
    "Int4Codes",
    "Int8Codes",
    "QuantError",
    "QuantizedArraysError",
    "QuantizedTensor",
    "Scheme",
    "WIDE_SCALE_SCHEMES",
    "dequantize",
    "quantization_error",
    "quantize",
    "symmetric_zero_point",
]
