"""Rotary position embeddings: inverse frequencies for each rope scaling, and cos/sin tables.

Layout is Hugging Face's half-split: a head vector x = [x1, x2] rotates as
[x1*cos - x2*sin, x2*cos + x1*sin] with one frequency per pair (i, i + head_dim/2).
"""
from __future__ import annotations

import math

import numpy as np

from edge.core.errors import UnsupportedModelError
from edge.core.spec import LlamaSpec
from edge.core.spec_dense import ROPE_PARAMETERS

SUPPORTED_ROPE_TYPES = tuple(ROPE_PARAMETERS)  # each with the parameters it needs (edge/core/spec_dense.py)


def rope_inv_freq(spec: LlamaSpec, long: bool = False) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim/2] (float64) and the attention factor that scales cos/sin.

    `long` picks longrope's long factors (for calls that reach past original_max_position_embeddings,
    see RopeTable); other rope types have one set of frequencies and ignore it."""
    dim = spec.head_dim
    base = spec.rope_theta
    inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    scaling = spec.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type in ("default", "dynamic"):
        # dynamic NTK rescales only sequences longer than max_position_embeddings (transformers
        # `_compute_dynamic_ntk_parameters`: base * (factor * seq_len / max_pos - (factor - 1)) ** ...
        # is base itself at seq_len <= max_pos), and a session never holds more positions than that
        return inv_freq, 1.0
    if rope_type == "longrope":
        return _longrope_inv_freq(inv_freq, scaling, spec.max_position_embeddings, long)
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "freq_factors":
        # llama.cpp stores llama3-style scaling as a per-frequency divisor (GGUF rope_freqs.weight)
        return inv_freq / np.asarray(scaling["factors"], dtype=np.float64), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, base, scaling, spec.max_position_embeddings)
    raise UnsupportedModelError(
        f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated, short ones kept, the band between blended smoothly
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled)


def _longrope_inv_freq(inv_freq: np.ndarray, scaling: dict, max_positions: int, long: bool
                       ) -> tuple[np.ndarray, float]:
    """LongRoPE (transformers `_compute_longrope_parameters`): a divisor per frequency, short_factor
    within original_max_position_embeddings and long_factor beyond, and cos/sin scaled by
    sqrt(1 + ln(factor) / ln(original)) where factor = max_position_embeddings / original unless given."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = np.asarray(scaling["long_factor" if long else "short_factor"], dtype=np.float64)
    return inv_freq / factors, float(attention_factor)


def _yarn_inv_freq(dim: int, base: float, scaling: dict, max_positions: int) -> tuple[np.ndarray, float]:
    original = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor") or max_positions / original

    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RopeTable:
    """cos/sin for positions, computed in float64 and rounded to float32 once.

    Every rope type but longrope gives each position its own angles. LongRoPE, as transformers
    applies it, rotates all positions of one forward call with the long factors when the call
    reaches past original_max_position_embeddings (max position + 1 > original), else with the short
    ones; so cos_sin and cos_sin_span take one call's positions, contiguous and in order, and
    positions already in the KV cache keep the rotation their own call gave them."""

    def __init__(self, spec: LlamaSpec):
        self.inv_freq, self.attention_factor = rope_inv_freq(spec)
        scaling = spec.rope_scaling or {}
        self.long_inv_freq = None  # longrope's long-factor frequencies, used past `long_after` positions
        if scaling.get("rope_type") == "longrope":
            self.long_inv_freq = rope_inv_freq(spec, long=True)[0]
            self.long_after = int(scaling["original_max_position_embeddings"])
        self._tables: dict[bool, tuple[np.ndarray, np.ndarray]] = {}  # long? -> cos, sin of [0, n) grown on demand

    def uses_long(self, end: int) -> bool:
        """Whether a call whose last position is end - 1 rotates with longrope's long factors."""
        return self.long_inv_freq is not None and end > self.long_after

    def _table(self, positions: np.ndarray, long: bool) -> tuple[np.ndarray, np.ndarray]:
        inv_freq = self.long_inv_freq if long else self.inv_freq
        angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # [T, Dh/2]
        cos = (np.cos(angles) * self.attention_factor).astype(np.float32)
        sin = (np.sin(angles) * self.attention_factor).astype(np.float32)
        return cos, sin

    def cos_sin(self, positions: np.ndarray, call_end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [T, Dh/2] of positions of one call. `call_end` is one past the call's last real
        position when `positions` are not the whole call (a chunk of a prompt, or padded rows)."""
        positions = np.asarray(positions)
        if call_end is None:
            call_end = int(positions.max()) + 1 if positions.size else 0
        return self._table(positions, self.uses_long(call_end))

    def cos_sin_span(self, start: int, n_positions: int) -> tuple[np.ndarray, np.ndarray]:
        """cos_sin(arange(start, start + n_positions)) from a table grown as positions are asked for
        (the same values: each row depends on its position, and the call's end for longrope only);
        read-only views."""
        end = start + n_positions
        long = self.uses_long(end)
        cos, sin = self._tables.get(long, (np.zeros((0, len(self.inv_freq)), np.float32),) * 2)
        if end > len(cos):
            cos, sin = self._table(np.arange(max(end, 2 * len(cos), 256)), long)
            cos.flags.writeable = sin.flags.writeable = False
            self._tables[long] = cos, sin
        return cos[start:end], sin[start:end]
