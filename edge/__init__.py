"""zllm-edge: run large language models on devices that cannot hold them comfortably.

    import edge
    model = edge.load("smollm2-ckpt", device="reference")
    for piece in model.generate("The capital of France is", max_new_tokens=16):
        print(piece, end="", flush=True)
"""
from edge.core.errors import (
    CheckpointError,
    ConversionError,
    ExpertCacheError,
    InvalidArgumentError,
    NumericalError,
    SessionError,
    UnsupportedModelError,
    ZllmError,
)

__all__ = ["load", "Model", "Grammar", "parse_tool_calls", "ToolsError", "ZllmError", "ConversionError", "UnsupportedModelError", "CheckpointError",
           "SessionError", "ExpertCacheError", "InvalidArgumentError", "NumericalError", "TokenizerError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The API pulls in converters/ and devices/, which themselves use edge.errors; importing it
    # lazily keeps `import quant` or `import converters` free of a cycle through this package.
    if name in ("load", "Model"):
        from edge import api

        return getattr(api, name)
    if name == "Grammar":
        from edge.constrained import Grammar

        return Grammar
    if name in ("parse_tool_calls", "ToolsError"):
        from edge import tools

        return getattr(tools, name)
    if name == "TokenizerError":  # lives beside the tokenizer, which imports the tokenizers package
        from edge.tokenizer import TokenizerError

        return TokenizerError
    raise AttributeError(f"module 'edge' has no attribute {name!r}")
