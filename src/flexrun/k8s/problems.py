"""Findings about manifests: what ``flexrun k8s validate`` reports, and how it names places.

Owns the :class:`Problem` / :class:`Report` values every checker returns, the dotted path
notation (``spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].image``) and the
translation of JSON Schema errors into problems (an ``additionalProperties: false``
violation becomes one ``unknown field`` problem per extra key, at that key's path). It
does not know any object kind (``validate.py`` and the per-kind checkers do).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """One finding about one object."""

    obj: str
    """``Kind/name`` of the object (``doc N`` when it has neither)."""
    path: str
    """Dotted path of the offending field inside the object (``""`` for the whole object)."""
    message: str
    error: bool = True
    """False for a warning: legal, but probably not what was meant."""

    def __str__(self) -> str:
        where = f"{self.obj}: {self.path}" if self.path else self.obj
        return f"{where}: {'' if self.error else 'warning: '}{self.message}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Report:
    """The verdict on a set of manifests."""

    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()
    """What was and was not checked (e.g. the core schemas were unavailable)."""
    checked: tuple[str, ...] = field(default_factory=tuple)
    """``Kind/name`` of every object looked at."""

    @property
    def errors(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.error)

    @property
    def ok(self) -> bool:
        return not self.errors


def dotted(parts: Iterable[Any]) -> str:
    """``["spec", "containers", 0, "image"]`` -> ``spec.containers[0].image``."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def schema_problems(obj_name: str, validator: Any, doc: object) -> list[Problem]:
    """Every error of a ``jsonschema`` validator on ``doc``, as problems with paths."""
    found = []
    for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        path = list(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, Mapping):
            allowed = err.schema.get("properties", {})
            for extra in sorted(str(k) for k in err.instance if k not in allowed):
                found.append(
                    Problem(obj=obj_name, path=dotted([*path, extra]), message="unknown field")
                )
            continue
        message = err.message
        if err.validator == "enum":
            message = f"{err.instance!r} not one of {', '.join(map(str, err.validator_value))}"
        found.append(Problem(obj=obj_name, path=dotted(path), message=message))
    return found


def draft7_problems(obj_name: str, schema: Mapping[str, Any], doc: object) -> list[Problem]:
    """:func:`schema_problems` with a plain Draft 7 validator of ``schema``."""
    import jsonschema

    return schema_problems(obj_name, jsonschema.Draft7Validator(schema), doc)


def name_of(doc: object, index: int) -> str:
    """``Kind/name`` of a manifest, or ``Kind (doc N)`` / ``doc N`` when it lacks them."""
    if isinstance(doc, Mapping):
        meta = doc.get("metadata")
        name = meta.get("name") if isinstance(meta, Mapping) else None
        kind = doc.get("kind")
        if isinstance(kind, str) and isinstance(name, str):
            return f"{kind}/{name}"
        if isinstance(kind, str):
            return f"{kind} (doc {index + 1})"
    return f"doc {index + 1}"


def dedupe(problems: Iterable[Problem]) -> list[Problem]:
    """The problems in order, each (object, path, message) once."""
    seen: set[tuple[str, str, str]] = set()
    out = []
    for p in problems:
        key = (p.obj, p.path, p.message)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


__all__ = ["Problem", "Report", "dedupe", "dotted", "draft7_problems", "name_of", "schema_problems"]
