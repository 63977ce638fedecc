"""JSON read from files a user hands us: config.json and its siblings, safetensors headers, zllm.json.

`parse_json` is json.loads with every way the text can fail as one ValueError whose message says
why, so that each reader turns it into its own typed error (ConversionError for a source,
CheckpointError for a checkpoint) naming the file."""
from __future__ import annotations

import json
from typing import Any

# Real configs nest 4 levels, a checkpoint's manifest 8. json's parser recurses once per level (100,000
# nested lists raise RecursionError), and so do repr, json.dumps and dataclasses.asdict of the value.
MAX_DEPTH = 64


def parse_json(text: str | bytes) -> Any:
    """The value of JSON `text` (bytes in UTF-8, -16 or -32, as json.loads takes them).

    Raises ValueError: the text is not JSON (json's message), not text (the codec's), or nests
    arrays and objects deeper than MAX_DEPTH."""
    too_deep = ValueError(f"arrays and objects nest deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(text)
    except RecursionError:
        raise too_deep from None
    if _depth_exceeds(value, MAX_DEPTH):
        raise too_deep
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether `value` nests lists and dicts more than `limit` deep; iterative, so any depth is safe."""
    pending = [(value, 1)] if isinstance(value, (dict, list)) else []
    while pending:
        node, depth = pending.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
