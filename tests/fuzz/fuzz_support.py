"""Shared strategies of the fuzz suite: hostile JSON values, mangled valid records, bytes.

Every fuzz test uses :data:`FUZZ` (bounded examples, derandomized: the same examples in
every CI run, no example database) so the whole suite stays well under two minutes.
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ = settings(
    max_examples=120,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FEW = settings(FUZZ, max_examples=12)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["", "..", "/etc/passwd", "../x", "nan", "inf", "-1", "1e999", "\x00"])
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)


def paths_of(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths_of(v, (*prefix, i))
    return out


def replace_at(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    out = copy.deepcopy(doc)
    node = out
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return out


def mangled(data: st.DataObject, doc: Any) -> Any:
    """``doc`` with one part (any field at any depth, or a field removed) replaced."""
    paths = paths_of(doc)
    path = data.draw(st.sampled_from(paths), label="path")
    if path and data.draw(st.booleans(), label="delete"):
        out = copy.deepcopy(doc)
        node = out
        for p in path[:-1]:
            node = node[p]
        del node[path[-1]]
        return out
    return replace_at(doc, path, data.draw(values, label="value"))


HOW = ("mangle", "random", "truncate", "non_utf8", "deep")
DEEP = b"[" * 50000 + b"]" * 50000
"""A JSON document nested past Python's recursion limit (``json.loads`` raises
RecursionError, which is not a ValueError)."""


def hostile_bytes(data: st.DataObject, valid: bytes, how: tuple[str, ...] = HOW) -> bytes:
    """Bytes a reader may meet instead of ``valid``: a mangled copy of its JSON, random
    bytes, a truncation, a non-UTF-8 byte inside it, or a document nested too deep."""
    how_ = data.draw(st.sampled_from(how), label="how")
    if how_ == "random":
        return data.draw(st.binary(max_size=64))
    if how_ == "truncate":
        return valid[: data.draw(st.integers(0, max(len(valid) - 1, 0)))]
    if how_ == "non_utf8":
        at = data.draw(st.integers(0, len(valid)))
        return valid[:at] + b"\xff\xfe" + valid[at:]
    if how_ == "deep":
        return DEEP
    doc = mangled(data, json.loads(valid))
    return json.dumps(doc, allow_nan=True).encode()


def four_opcode_payload(
    marker: Path, module: str = "torch.distributed.checkpoint.filesystem"
) -> bytes:
    """Issue 18's payload: GLOBAL ``<module> os.mkdir``, BINUNICODE ``<marker>``, TUPLE1,
    REDUCE (after the protocol-4 header that lets a global be a dotted name; then STOP).
    Plain ``pickle.loads`` of it creates the directory ``marker``."""
    path = str(marker).encode()
    return (
        b"\x80\x04c"
        + module.encode()
        + b"\nos.mkdir\nX"
        + struct.pack("<I", len(path))
        + path
        + b"\x85R."
    )
