"""A benchmark's rows written under its --out directory: as JSON and as a markdown table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_rows(out: Path, name: str, rows: list[dict[str, Any]]) -> str:
    """Write `rows` (dicts with the same keys, in order) to `out/<name>.json` and, a line per
    row under a header of the keys, to `out/<name>.md` (`out` is made if missing); returns the
    markdown table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    keys = list(rows[0])
    table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    table += ["| " + " | ".join(str(row[key]) for key in keys) + " |" for row in rows]
    text = "\n".join(table) + "\n"
    (out / f"{name}.md").write_text(text)
    return text
