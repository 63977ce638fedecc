"""How far a quantized tensor is from the float weights it was made from."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quant.formats import QuantizedTensor


@dataclass(frozen=True)
class QuantError:
    max_abs: float  # largest |dequantized - reference| over all elements
    rel_rms: float  # rms(dequantized - reference) / rms(reference); 0 when the reference is all zero


def quantization_error(reference: np.ndarray, qt: QuantizedTensor) -> QuantError:
    reference = np.asarray(reference)
    if reference.shape != qt.shape:
        raise ValueError(f"reference has shape {reference.shape} but the quantized tensor has shape {qt.shape}")
    # float64, so that the error of the measurement is far below the error measured
    reference = reference.astype(np.float64)
    difference = qt.dequantize().astype(np.float64) - reference
    reference_rms = np.sqrt(np.mean(reference**2))
    rel_rms = 0.0 if reference_rms == 0 else float(np.sqrt(np.mean(difference**2)) / reference_rms)
    return QuantError(max_abs=float(np.abs(difference).max()), rel_rms=rel_rms)
