"""The bottom layer every other part of zllm-edge stands on, importing nothing else of the project:
typed errors, argument and size parsing, atomic file writing, the oracle numerics, the model specs,
MoE routing semantics, the KV cache's format names and sizes, and the backend contract's types."""
