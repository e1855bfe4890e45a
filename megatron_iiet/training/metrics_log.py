"""Reading a run's metrics.jsonl back (the file metrics.py appends to). Standard library only:
the tools that compare and collect runs read it without importing torch.

A restarted run appends to the same file: resumed from its last checkpoint, or begun again when
none was saved yet, it logs its steps from there a second time. ``last_attempt`` gives the
records the way the run's latest attempt left them, so a curve runs forward once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable


def read_records(path: Path) -> list[dict]:
    """The records of ``path`` (a metrics.jsonl, or the folder holding one) in the order written;
    a line cut by a kill is skipped, the rest still counts. No file: no records."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def last_attempt(records: Iterable[dict], kind: str) -> list[dict]:
    """The records of one kind, in step order, as the latest attempt left them: a record whose
    step is not after the previous one's starts an attempt again, and from its step on it
    replaces what the earlier attempt had logged."""
    kept: list[dict] = []
    for record in records:
        if record.get("kind") != kind:
            continue
        while kept and kept[-1]["step"] >= record["step"]:
            kept.pop()
        kept.append(record)
    return kept
