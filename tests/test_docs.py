"""Docs that cannot rot: a figure says the conditions it was measured under, not when or on which day's machine,
and no page keeps counts of the code's own lines (they are stale at the next commit)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIARY = re.compile(r"this (shared )?machine|slow phase|faster phase|(latest|previous|this) round\b|the round before"
                   r"|earlier the same (day|evening)|line counts?\b|\bwc -l\b", re.I)


def test_docs_say_conditions_not_a_diary() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
             for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for n, line in enumerate(path.read_text().splitlines(), 1) if DIARY.search(line)]
    assert found == []
