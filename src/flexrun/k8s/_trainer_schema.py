"""Kubeflow Trainer v2.3.0's CRD schemas as a validator: shipped data, closed, with CEL rules.

Owns turning ``schemas/trainer-v2.3.0.json`` (the ``openAPIV3Schema`` of ``TrainJob`` and
``TrainingRuntime``/``ClusterTrainingRuntime``, source and version noted in that folder's
README) into a ``jsonschema`` validator per kind that also enforces what the API server
adds to a plain JSON Schema:

- **structural pruning**: an object the schema lists properties for (and no
  ``x-kubernetes-preserve-unknown-fields``) takes no other field; the API server would
  drop a typo silently, so it is reported as ``unknown field``;
- ``x-kubernetes-list-type``: ``map`` lists have unique keys, ``set`` lists unique items;
- ``x-kubernetes-validations`` (CEL): every rule of these CRDs that applies on creation,
  translated by hand (:data:`CEL_RULES`); transition rules (``oldSelf``) only apply to
  updates and are skipped. A test fails if the CRDs gain a rule with no translation.

It does not know the controller's rules (``validate_trainer``).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator, Mapping
from functools import cache
from importlib import resources
from typing import Any

from flexrun.k8s._pytorchjob_rules import OBJECT_META

SCHEMA_FILE = "trainer-v2.3.0.json"
KINDS = ("TrainJob", "TrainingRuntime", "ClusterTrainingRuntime")

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://.+$")


def _name(obj: Any) -> Any:
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    return meta.get("name") if isinstance(meta, Mapping) else None


def _has(obj: Any, key: str) -> bool:
    return isinstance(obj, Mapping) and obj.get(key) is not None


#: CEL rule text -> (check that is True when the rule holds, path of the field it is about
#: relative to where the rule sits). A rule whose field is absent holds (CEL would not
#: evaluate it on a missing optional field, and ``required`` is checked separately).
CEL_RULES: dict[str, tuple[Callable[[Any], bool], tuple[str, ...]]] = {
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')": (
        lambda o: not isinstance(_name(o), str) or bool(_DNS1035.match(_name(o))),
        ("metadata", "name"),
    ),
    "size(self.metadata.name) <= 63": (
        lambda o: not isinstance(_name(o), str) or len(_name(o)) <= 63,
        ("metadata", "name"),
    ),
    "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')": (
        lambda s: not isinstance(s, str) or s == "" or bool(_URI.match(s)),
        (),
    ),
    "self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']": (
        lambda s: s in ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue"),
        (),
    ),
    "has(self.lastUpdatedTime)": (lambda o: _has(o, "lastUpdatedTime"), ()),
    "[has(self.torch), has(self.mpi), has(self.jax), has(self.xgboost),has(self.flux)]"
    ".filter(x, x).size() <= 1": (
        lambda o: sum(_has(o, k) for k in ("torch", "mpi", "jax", "xgboost", "flux")) <= 1,
        (),
    ),
    "self >= 1": (lambda n: not isinstance(n, int) or n >= 1, ()),
    "!self.exists(c, c == 'node')": (lambda items: "node" not in (items or []), ()),
    "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' && "
    "self.replicatedJobs.exists(x, has(x.dependsOn)))": (
        lambda o: (
            not (
                isinstance(o.get("startupPolicy"), Mapping)
                and o["startupPolicy"].get("startupPolicyOrder") == "InOrder"
                and any(_has(j, "dependsOn") for j in o.get("replicatedJobs") or [])
            )
        ),
        (),
    ),
    "self.templates.all(t, !has(t.metadata.namespace) || size(t.metadata.namespace) == 0)": (
        lambda o: all(
            not (isinstance(t, Mapping) and isinstance(t.get("metadata"), Mapping))
            or not t["metadata"].get("namespace")
            for t in o.get("templates") or []
        ),
        (),
    ),
}


def cel_rules_in(schema: Any) -> Iterator[str]:
    """Every creation-time CEL rule text in a schema (transition rules excluded)."""
    if isinstance(schema, Mapping):
        for rule in schema.get("x-kubernetes-validations") or []:
            text = rule.get("rule", "")
            if "oldSelf" not in text:
                yield text
        for value in schema.values():
            yield from cel_rules_in(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from cel_rules_in(value)


def _close(node: Any) -> None:
    """Add ``additionalProperties: false`` where the API server prunes unknown fields."""
    if isinstance(node, dict):
        if (
            node.get("type") == "object"
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node.setdefault("properties", {})
            node["additionalProperties"] = False
        for key, value in node.items():
            if key != "x-kubernetes-validations":
                _close(value)
    elif isinstance(node, list):
        for value in node:
            _close(value)


@cache
def shipped() -> dict[str, Any]:
    """The packaged schema file, parsed (source, version and the schemas)."""
    text = (resources.files("flexrun.k8s") / "schemas" / SCHEMA_FILE).read_text("utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def schema_for(kind: str) -> dict[str, Any]:
    """The closed schema of ``kind`` (ObjectMeta's known fields at the top level)."""
    schemas = shipped()["schemas"]
    base = schemas["TrainingRuntime" if kind == "ClusterTrainingRuntime" else kind]
    schema = copy.deepcopy(base)
    _close(schema)
    schema["properties"]["metadata"] = copy.deepcopy(OBJECT_META)
    schema["properties"]["apiVersion"] = {"const": shipped()["apiVersion"]}
    schema["properties"]["kind"] = {"const": kind}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return schema


def _list_type(validator: Any, value: Any, instance: Any, schema: Mapping[str, Any]) -> Any:
    from jsonschema import ValidationError

    if not isinstance(instance, list) or value not in ("map", "set"):
        return
    keys = schema.get("x-kubernetes-list-map-keys") or []
    seen: set[str] = set()
    for i, item in enumerate(instance):
        if value == "map":
            if not isinstance(item, Mapping):
                continue
            ident = json.dumps([item.get(k) for k in keys], sort_keys=True, default=str)
            what = ", ".join(f"{k}={item.get(k)!r}" for k in keys)
        else:
            ident = json.dumps(item, sort_keys=True, default=str)
            what = repr(item)
        if ident in seen:
            yield ValidationError(f"duplicate entry ({what})", path=[i])
        seen.add(ident)


def _cel(validator: Any, rules: Any, instance: Any, schema: Mapping[str, Any]) -> Any:
    from jsonschema import ValidationError

    for rule in rules or []:
        text = rule.get("rule", "")
        check = CEL_RULES.get(text)
        if "oldSelf" in text or check is None:
            continue
        holds, rel = check
        try:
            ok = holds(instance)
        except (AttributeError, TypeError):
            ok = True  # a type error elsewhere in the object; the schema reports that
        if not ok:
            yield ValidationError(rule.get("message") or f"violates {text}", path=list(rel))


@cache
def validator_for(kind: str) -> Any:
    """A ``jsonschema`` validator for ``kind`` with the Kubernetes keywords above."""
    import jsonschema

    cls = jsonschema.validators.extend(
        jsonschema.Draft7Validator,
        {"x-kubernetes-list-type": _list_type, "x-kubernetes-validations": _cel},
    )
    return cls(schema_for(kind))


__all__ = ["CEL_RULES", "KINDS", "cel_rules_in", "schema_for", "shipped", "validator_for"]
