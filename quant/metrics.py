"""How far a quantized (or down-cast) tensor is from the float weights it was made from."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quant.formats import QuantizedTensor

_ELEMENTS_PER_CHUNK = 1 << 20  # rows are measured in chunks so memory stays a fraction of the tensor


@dataclass(frozen=True)
class QuantError:
    max_abs: float  # largest |stored - reference| over all elements
    rel_rms: float  # rms(stored - reference) / rms(reference); 0 when the reference is all zero


def _rows(stored: QuantizedTensor | np.ndarray, chunk: slice) -> np.ndarray:
    if isinstance(stored, QuantizedTensor):
        return stored.dequantize_rows(np.arange(chunk.start, min(chunk.stop, stored.shape[0])))
    return np.asarray(stored[chunk], dtype=np.float32)


def quantization_error(reference: np.ndarray, stored: QuantizedTensor | np.ndarray) -> QuantError:
    """Error of `stored` (a QuantizedTensor, or a float array such as an f16 copy) against reference [N, K]."""
    reference = np.asarray(reference)
    if reference.shape != tuple(stored.shape):
        raise ValueError(f"reference has shape {reference.shape} but the quantized tensor has shape {stored.shape}")
    if reference.size == 0:
        return QuantError(0.0, 0.0)
    reference_2d = reference.reshape(reference.shape[0], -1)
    stored_2d = stored if isinstance(stored, QuantizedTensor) else np.asarray(stored).reshape(reference_2d.shape)
    rows_per_chunk = max(1, _ELEMENTS_PER_CHUNK // reference_2d.shape[1])
    max_abs, error_square_sum, reference_square_sum = 0.0, 0.0, 0.0
    for start in range(0, reference_2d.shape[0], rows_per_chunk):
        chunk = slice(start, start + rows_per_chunk)
        # float64, so that the error of the measurement is far below the error measured
        expected = reference_2d[chunk].astype(np.float64)
        difference = _rows(stored_2d, chunk).astype(np.float64) - expected
        max_abs = max(max_abs, float(np.abs(difference).max()))
        error_square_sum += float(np.square(difference).sum())
        reference_square_sum += float(np.square(expected).sum())
    rel_rms = 0.0 if reference_square_sum == 0 else float(np.sqrt(error_square_sum / reference_square_sum))
    return QuantError(max_abs=max_abs, rel_rms=rel_rms)
