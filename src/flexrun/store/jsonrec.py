"""Parsing the JSON of a record read from a store (or a file another process wrote).

Owns one rule the record decoders share: a record never holds a non-finite number
(``NaN``, ``Infinity``, or ``1e999``, which ``json`` reads as infinity and ``int()`` then
refuses with ``OverflowError``, not the ``ValueError`` decoders catch). Nesting past the
parser's recursion limit stays ``RecursionError``: callers catch it with ``ValueError``.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:24]} is out of range for a record")
    return value


def loads_record(raw: bytes | str) -> Any:
    """``json.loads`` that refuses non-finite numbers.

    Raises:
        ValueError: not JSON (``UnicodeDecodeError`` for bytes that are not text), or a
            non-finite number.
        RecursionError: nested past the parser's limit.
    """
    return json.loads(raw, parse_float=_finite, parse_constant=_finite)


__all__ = ["loads_record"]
