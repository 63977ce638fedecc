"""The check every forward pass's logits pass before a token is chosen from them."""
from __future__ import annotations

import numpy as np

from edge.core.errors import NumericalError


def check_finite_logits(logits: np.ndarray, first_position: int, device: str) -> None:
    """Refuse NaN or infinite logits (float [V] of the token at `first_position`, or [T, V] of T tokens
    from it): sampled or argmaxed, they give garbage tokens that look like output. One np.isfinite over
    [V] per step costs microseconds against the step's milliseconds."""
    if np.isfinite(logits).all():
        return
    rows = np.asarray(logits).reshape(-1, logits.shape[-1])
    finite = np.isfinite(rows)
    row = int(np.argmin(finite.all(axis=1)))
    value = rows[row][~finite[row]][0]
    remedy = "its checkpoint or config is damaged: convert the model again"
    if device != "reference":
        remedy = (f"its checkpoint or config is damaged (convert the model again), or device {device!r} computes "
                  f"wrongly (compare it with the reference: zllm-edge diff MODEL PROMPT --devices reference,{device})")
    raise NumericalError(f"the model produced non-finite logits ({value}) at position {first_position + row}; "
                         f"{remedy}")
