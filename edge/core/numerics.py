"""The oracle's elementwise and normalising numerics in numpy, shared by the reference device, MoE
routing and the expert predictor so that each is written once. Arrays keep their dtype unless a
function says otherwise."""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis; weight is a float array of that length."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(variance + eps)) * np.asarray(weight, dtype=np.float32)


def softmax(scores: np.ndarray) -> np.ndarray:
    """exp(s - max s) / sum exp(s - max s) over the last axis (-inf scores get weight 0)."""
    shifted = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(shifted)
    return weights / weights.sum(axis=-1, keepdims=True)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) as float32."""
    # exp(-x) overflows float32 below x = -88: 1 / (1 + inf) = 0 is then the right limit, not an error
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), in x's dtype."""
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for very negative x; silu -> 0 is right
        return x / (1.0 + np.exp(-x))


GELU_TANH_C = np.sqrt(2.0 / np.pi)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in x's dtype."""
    return (0.5 * x * (1.0 + np.tanh(GELU_TANH_C * (x + 0.044715 * x ** 3)))).astype(x.dtype)
