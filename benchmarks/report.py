"""The common ending of a benchmark script: its result as JSON on stdout (after the table) and, when
asked, in a file."""
from __future__ import annotations

import json


def publish(result, json_path: str | None) -> None:
    print(json.dumps(result, indent=1))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
