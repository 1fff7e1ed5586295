"""What the benchmark scripts share: writing their JSON results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write `payload` to `path` (parent folders created) and say so."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {out}")
