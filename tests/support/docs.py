"""The runnable examples of the docs: a test reads its example from the doc, so the doc is the
one home of the code a reader copies."""

from __future__ import annotations

import re
from pathlib import Path


def python_block(doc: Path, needle: str) -> str:
    """The one ```python block of `doc` that contains `needle`.

    Raises:
        AssertionError: no block, or more than one, contains `needle`.
    """
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    found = [block for block in blocks if needle in block]
    assert len(found) == 1, f"{len(found)} python blocks of {doc.name} contain {needle!r}"
    return found[0]
