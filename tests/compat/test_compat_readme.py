"""The docs' "Differences from torchrun" table is the suite's list of allowed differences.

The table lives in docs/user/torchrun.md (the page the README and the docs site link to).
"""

from __future__ import annotations

import re
from pathlib import Path

from allowed import ALLOWED

PAGE = Path(__file__).resolve().parents[2] / "docs" / "user" / "torchrun.md"
START, END = "<!-- compat-differences:start -->", "<!-- compat-differences:end -->"


def _table() -> dict[str, str]:
    text = PAGE.read_text()
    assert START in text and END in text, f"{PAGE} lacks the compat-differences table"
    body = text[text.index(START) + len(START) : text.index(END)]
    rows = {}
    for line in body.splitlines():
        m = re.fullmatch(r"\|\s*`([a-z0-9-]+)`\s*\|(.*)\|\s*", line.strip())
        if m:
            rows[m.group(1)] = " ".join(m.group(2).split())
    return rows


def test_the_docs_list_exactly_the_allowed_differences() -> None:
    assert set(_table()) == set(ALLOWED)


def test_the_docs_give_each_difference_its_reason() -> None:
    table = _table()
    for key, reason in ALLOWED.items():
        assert table[key] == " ".join(reason.split()), key
