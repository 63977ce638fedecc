"""Attention variants over the backend contract, and the cache layout each one needs.

T = tokens in this call, S = key positions attended, D = hidden size, Hq / Hkv = query /
key-value heads, Dh = head dim; MLA: H = heads, C = kv_lora_rank (latent), R = qk_rope_head_dim,
Dn = qk_nope_head_dim, Dv = v_head_dim.

- GQA (covers MHA and MQA): per-head K and V projections; the cache holds K and V per KV head.
- MLA (DeepSeek-V2/V3): keys and values are rebuilt from a normalised latent c [C] shared by all
  heads, plus one rotary key part k_R [R] shared by all heads:
      k_h = [W_UK[h] c, k_R],   v_h = W_UV[h] c,   q_h = [q_nope_h, q_rope_h]
  The cache holds only (c, k_R) per position. Two equal ways to attend:
  * naive: reconstruct k_h, v_h for every cached position (kv_b_proj), then ordinary attention;
  * absorbed: q_nope_h . (W_UK[h] c) = (W_UK[h]^T q_nope_h) . c, so the query moves into latent
    space and every head attends over the same [c, k_R] rows (one KV head, MQA); the output
    sum_s p_s W_UV[h] c_s = W_UV[h] (sum_s p_s c_s) maps the latent average back per head.
  Per-head K/V are never materialised in the absorbed form. Prefill (T > 1) uses the naive form,
  whose cost is dominated by matrix products that the latent width C would only enlarge; decode
  uses the absorbed form, which reads C + R values per cached position instead of H (Dn + Dv).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from devices.cache_buffers import StoredRows
from edge.core.errors import ZllmError
from edge.kv_cache import KVCache

MLA_FORMS = ("naive", "absorbed")


# --- GQA / MHA / MQA ----------------------------------------------------------------------------
def gqa_attention(be, spec, layer, x: np.ndarray, cache: KVCache, index: int, start: int,
                  positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, scale: float) -> np.ndarray:
    """x [T, D] (normed) -> the attention block's output [T, D]; appends K/V to the cache."""
    n_tokens = len(x)
    q = be.linear(x, layer.q, layer.q_bias)  # [T, Hq*Dh]
    k = be.linear(x, layer.k, layer.k_bias)  # [T, Hkv*Dh]
    v = be.linear(x, layer.v, layer.v_bias)  # [T, Hkv*Dh]
    if spec.qk_norm_over_projection:  # OLMoE normalises the whole projection, not each head
        q = be.rms_norm(q, layer.q_norm, spec.rms_norm_eps)
        k = be.rms_norm(k, layer.k_norm, spec.rms_norm_eps)
    if spec.clip_qkv is not None:  # OLMoE
        q, k, v = (np.clip(t, -spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
    q = q.reshape(n_tokens, spec.num_attention_heads, spec.head_dim)
    k = k.reshape(n_tokens, spec.num_key_value_heads, spec.head_dim)
    v = v.reshape(n_tokens, spec.num_key_value_heads, spec.head_dim)
    if layer.q_norm is not None and not spec.qk_norm_over_projection:  # Qwen3 normalises each head
        q = be.rms_norm(q, layer.q_norm, spec.rms_norm_eps)
        k = be.rms_norm(k, layer.k_norm, spec.rms_norm_eps)
    q, k = be.rope(q, cos, sin), be.rope(k, cos, sin)
    (keys, values), key_positions = cache.append_stored(index, start, (k, v))  # [S, Hkv, Dh] each, as stored
    attended = attend_stored(be, q, keys, values, positions, key_positions, scale, layer.sliding_window)  # [T, Hq, Dh]
    return be.linear(attended.reshape(n_tokens, -1), layer.o, layer.o_bias)


def attend_stored(be, q: np.ndarray, keys: StoredRows, values: StoredRows, positions: np.ndarray,
                  key_positions: np.ndarray, scale: float, window: int | None) -> np.ndarray:
    """Attention over the cache's rows in their storage format: backends that read f16 / int8 K/V
    directly (`attention_over_cache`) get them as stored; the others only ever hold f32 caches
    (KVCache refuses to allocate anything else for them)."""
    if be.capabilities.stored_attention:
        return be.attention_over_cache(q, keys, values, positions, key_positions, scale, window)
    if keys.format != "f32":
        raise ZllmError(f"device {be.name!r} cannot attend over a {keys.format} KV cache; it reads float32 K/V only; "
                        f"use kv_cache='f32' or device 'cpu' / 'reference'")
    return be.attention(q, keys.data, values.data, positions, key_positions, scale, window)


# --- MLA ----------------------------------------------------------------------------------------
@dataclass
class MlaWeights:
    q: object | None          # q_proj [H*(Dn+R), D], when there is no query LoRA
    q_a: object | None        # q_a_proj [q_lora_rank, D]
    q_a_bias: object | None
    q_a_norm: object | None   # [q_lora_rank]
    q_b: object | None        # q_b_proj [H*(Dn+R), q_lora_rank]
    kv_a: object              # kv_a_proj_with_mqa [C+R, D]
    kv_a_bias: object | None
    kv_a_norm: object         # [C]
    kv_b: object              # kv_b_proj [H*(Dn+Dv), C], for the naive form
    uk_t: np.ndarray          # W_UK transposed per head [H, C, Dn] f32, for the absorbed form
    uv: np.ndarray            # W_UV [H, Dv, C] f32
    o: object                 # o_proj [D, H*Dv]
    o_bias: object | None
    rope_order: np.ndarray | None  # de-interleaving permutation of the R rotary dims, or None


def load_mla_weights(spec, weight, float_weight, prefix: str) -> MlaWeights:
    """`weight(name, required)` gives a backend-prepared weight, `float_weight(name)` a host f32 array."""
    heads, dn, dv, rank = spec.num_attention_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    kv_b = float_weight(prefix + "kv_b_proj.weight").reshape(heads, dn + dv, rank)  # [H, Dn+Dv, C]
    lora = spec.q_lora_rank is not None
    r = spec.qk_rope_head_dim
    return MlaWeights(
        q=None if lora else weight(prefix + "q_proj.weight"),
        q_a=weight(prefix + "q_a_proj.weight") if lora else None,
        q_a_bias=weight(prefix + "q_a_proj.bias", False) if lora else None,
        q_a_norm=weight(prefix + "q_a_layernorm.weight") if lora else None,
        q_b=weight(prefix + "q_b_proj.weight") if lora else None,
        kv_a=weight(prefix + "kv_a_proj_with_mqa.weight"),
        kv_a_bias=weight(prefix + "kv_a_proj_with_mqa.bias", False),
        kv_a_norm=weight(prefix + "kv_a_layernorm.weight"),
        kv_b=weight(prefix + "kv_b_proj.weight"),
        uk_t=np.ascontiguousarray(kv_b[:, :dn, :].transpose(0, 2, 1)),
        uv=np.ascontiguousarray(kv_b[:, dn:, :]),
        o=weight(prefix + "o_proj.weight"),
        o_bias=weight(prefix + "o_proj.bias", False),
        # DeepSeek pairs rotary dims (0, 1), (2, 3), ...; our rope pairs (i, i + R/2). Permuting q's
        # and k's rotary dims the same way leaves every dot product unchanged.
        rope_order=np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)]) if spec.rope_interleaved else None,
    )


def _pad_last(x: np.ndarray, width: int) -> np.ndarray:
    """x with zeros appended along the last axis up to `width` (zeros change no dot product)."""
    if x.shape[-1] == width:
        return x
    padding = np.zeros((*x.shape[:-1], width - x.shape[-1]), np.float32)
    return np.concatenate([x, padding], axis=-1)


def mla_attention(be, spec, mla: MlaWeights, x: np.ndarray, cache: KVCache, index: int, start: int,
                  positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, form: str | None = None) -> np.ndarray:
    """x [T, D] (normed) -> the attention block's output [T, D]; appends (latent, rotary key) to the
    cache. form: "naive", "absorbed", or None for naive prefill and absorbed decode."""
    n_tokens = len(x)
    heads, dn, r, rank = spec.num_attention_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
    eps = spec.rms_norm_eps
    if mla.q is not None:
        q = be.linear(x, mla.q)
    else:
        q = be.linear(be.rms_norm(be.linear(x, mla.q_a, mla.q_a_bias), mla.q_a_norm, eps), mla.q_b)
    q = q.reshape(n_tokens, heads, dn + r)
    q_nope, q_rope = q[..., :dn], q[..., dn:]                            # [T, H, Dn], [T, H, R]
    compressed = be.linear(x, mla.kv_a, mla.kv_a_bias)                   # [T, C+R]
    latent = be.rms_norm(compressed[:, :rank], mla.kv_a_norm, eps)       # [T, C]
    k_rope = compressed[:, None, rank:]                                  # [T, 1, R]
    if mla.rope_order is not None:
        q_rope, k_rope = q_rope[..., mla.rope_order], k_rope[..., mla.rope_order]
    q_rope, k_rope = be.rope(np.ascontiguousarray(q_rope), cos, sin), be.rope(np.ascontiguousarray(k_rope), cos, sin)
    (latents, ropes), key_positions = cache.append(index, start, (latent[:, None, :], k_rope))  # [S, 1, C], [S, 1, R]
    scale = spec.mla_softmax_scale
    form = form or ("absorbed" if n_tokens == 1 else "naive")
    if form == "naive":
        attended = _mla_naive(be, spec, mla, q_nope, q_rope, latents, ropes, positions, key_positions, scale)
    elif form == "absorbed":
        attended = _mla_absorbed(be, mla, q_nope, q_rope, latents, ropes, positions, key_positions, scale)
    else:
        raise ValueError(f"MLA form {form!r} is unknown; forms: {', '.join(MLA_FORMS)}")
    return be.linear(attended.reshape(n_tokens, -1), mla.o, mla.o_bias)


def _mla_naive(be, spec, mla, q_nope, q_rope, latents, ropes, positions, key_positions, scale) -> np.ndarray:
    """Per-head K/V rebuilt from the latent for every cached position -> [T, H, Dv]."""
    heads, dn, dv, r = spec.num_attention_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.qk_rope_head_dim
    n_keys = len(latents)
    kv = be.linear(np.ascontiguousarray(latents[:, 0, :]), mla.kv_b).reshape(n_keys, heads, dn + dv)  # [S, H, Dn+Dv]
    keys = np.concatenate([kv[..., :dn], np.broadcast_to(ropes, (n_keys, heads, r))], axis=-1)  # [S, H, Dn+R]
    query = np.concatenate([q_nope, q_rope], axis=-1)                                        # [T, H, Dn+R]
    width = max(dn + r, dv)  # the backend's attention takes one head width for q, k and v
    attended = be.attention(_pad_last(query, width), _pad_last(keys, width), _pad_last(kv[..., dn:], width),
                            positions, key_positions, scale, None)
    return attended[..., :dv]


def _mla_absorbed(be, mla, q_nope, q_rope, latents, ropes, positions, key_positions, scale) -> np.ndarray:
    """Attention in latent space: one shared [c, k_R] key row per position (MQA) -> [T, H, Dv]."""
    rank = latents.shape[-1]
    q_latent = be.head_matmul(np.ascontiguousarray(q_nope), mla.uk_t)  # [T, H, C] = W_UK[h]^T q_nope_h
    query = np.concatenate([q_latent, q_rope], axis=-1)               # [T, H, C+R]
    keys = np.concatenate([latents, ropes], axis=-1)                  # [S, 1, C+R]
    # values are the latents; passing the key rows as values keeps one head width, and the R
    # trailing output dims (the rotary parts averaged) are dropped
    latent_average = be.attention(query, keys, keys, positions, key_positions, scale, None)[..., :rank]  # [T, H, C]
    return be.head_matmul(np.ascontiguousarray(latent_average), mla.uv)  # [T, H, Dv] = W_UV[h] (sum p c)
