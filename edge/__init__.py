"""zllm-edge: run large language models on devices that cannot hold them comfortably.

    import edge
    model = edge.load("smollm2-ckpt", device="reference")
    for piece in model.generate("The capital of France is", max_new_tokens=16):
        print(piece, end="", flush=True)
"""
from edge.api import Model, load
from edge.errors import CheckpointError, ConversionError, SessionError, UnsupportedModelError, ZllmError

__all__ = ["load", "Model", "ZllmError", "ConversionError", "UnsupportedModelError", "CheckpointError",
           "SessionError"]
__version__ = "0.1.0"
