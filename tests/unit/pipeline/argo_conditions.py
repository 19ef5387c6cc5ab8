"""Argo's evaluation of a resource step's success/failure conditions, for the DAG tests.

Argo (``workflow/executor/resource.go``) parses each condition with Kubernetes'
``labels.Parse`` and looks every key up in the object's JSON with gjson: a key must be a
label key (a qualified name: ``[prefix/]name``, the name at most 63 characters of
``[A-Za-z0-9][-A-Za-z0-9_.]*[A-Za-z0-9]``), so a path is dotted names and list indexes and
cannot query a list. Every requirement of the success condition must match; the failure
condition fails the step as soon as any ONE of its requirements matches, and it is
checked first. This is that grammar and those semantics, for the subset the rendered
workflows use (exists, !exists, =, ==, !=, >, <).
"""

from __future__ import annotations

import re
from typing import Any

_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_REQ = re.compile(r"^\s*(!)?\s*([^\s!=<>,()]+)\s*(?:(==|=|!=|>|<)\s*([^\s,()]*))?\s*$")

Requirement = tuple[str, str, str]  # key, operator, value


def _check_key(key: str) -> None:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _PREFIX.match(prefix)):
        raise ValueError(f"{key!r}: invalid key prefix")
    if len(name) > 63 or not _NAME.match(name):
        raise ValueError(f"{key!r}: not a qualified name (Argo's condition keys are label keys)")


def parse(selector: str) -> list[Requirement]:
    """The requirements of one condition; ValueError where labels.Parse would fail."""
    out: list[Requirement] = []
    for part in selector.split(","):
        m = _REQ.match(part)
        if not m:
            raise ValueError(f"{part!r}: unparseable requirement")
        neg, key, op, value = m.groups()
        _check_key(key)
        if neg and op:
            raise ValueError(f"{part!r}: '!' takes a bare key")
        if op is None:
            out.append((key, "!exists" if neg else "exists", ""))
            continue
        if op in (">", "<"):
            int(value)  # labels.Parse: the value of > and < is an integer
        elif not _VALUE.match(value) or len(value) > 63:
            raise ValueError(f"{part!r}: invalid label value")
        out.append((key, "=" if op == "==" else op, value))
    return out


def lookup(obj: Any, key: str) -> tuple[bool, str]:
    """gjson's GetBytes(json, key) for a dotted path: (exists, String())."""
    cur = obj
    for seg in key.split("."):
        if isinstance(cur, dict) and seg in cur:
            cur = cur[seg]
        elif isinstance(cur, list) and seg.isdigit() and int(seg) < len(cur):
            cur = cur[int(seg)]
        else:
            return False, ""
    if isinstance(cur, bool):
        return True, "true" if cur else "false"
    return True, str(cur) if not isinstance(cur, (dict, list)) else repr(cur)


def matches(req: Requirement, obj: Any) -> bool:
    key, op, value = req
    has, got = lookup(obj, key)
    if op == "exists":
        return has
    if op == "!exists":
        return not has
    if op == "=":
        return has and got == value
    if op == "!=":
        return not has or got != value
    try:
        n = int(got)
    except ValueError:
        return False
    return has and (n > int(value) if op == ">" else n < int(value))


def outcome(success: str | None, failure: str | None, obj: Any) -> str:
    """'failed', 'succeeded' or 'waiting', as Argo decides on one poll of the object."""
    if failure and any(matches(r, obj) for r in parse(failure)):
        return "failed"
    if success and all(matches(r, obj) for r in parse(success)):
        return "succeeded"
    return "waiting"


def schema_has_path(schema: dict[str, Any], key: str) -> bool:
    """Whether a dotted path names a field of an openAPIV3Schema (list indexes -> items,
    map keys -> additionalProperties)."""
    cur = schema
    for seg in key.split("."):
        if cur.get("type") == "array" and seg.isdigit():
            cur = cur.get("items", {})
        elif seg in cur.get("properties", {}):
            cur = cur["properties"][seg]
        elif isinstance(cur.get("additionalProperties"), dict):
            cur = cur["additionalProperties"]
        else:
            return False
    return True
