"""Reading user spec files: the one typed reader both spec formats (k8s jobs, pipelines) use.

Owns two things and nothing else:

- :class:`SpecReader`: a mapping at a dotted path with typed getters. Every getter fails
  with a :class:`~flexrun.errors.SpecError` whose message starts with the field's path
  (``spec.store.port: must be an integer (got 'x')``); :meth:`SpecReader.done` rejects
  fields nobody asked for, so a typo is an error, never silently ignored.
- :func:`load_yaml` / :func:`load_yaml_documents`: a file -> parsed YAML, where every way a
  file can be wrong (missing, unreadable, binary, not UTF-8, not YAML, nested beyond
  reason) is one :class:`~flexrun.errors.SpecError` line, never a traceback.

It knows neither format's fields (``flexrun.k8s.spec``, ``flexrun.pipeline.spec`` do).
PyYAML is imported only when a file is read. Base layer: imports only ``errors``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, overload

from flexrun.errors import SpecError

_MAX_SECONDS = 365 * 86400.0
"""The longest duration a spec may give (one year; as ``config.parsing.MAX_DURATION_S``)."""

_SCALAR = (str, int, float)


def fail(path: str, message: str) -> SpecError:
    """A :class:`SpecError` for the field at ``path`` (``path: message``), on one line."""
    text = f"{path}: {message}" if path else message
    return SpecError(text.replace("\r", "\\r").replace("\n", "\\n"))


def key_text(key: object) -> str:
    """A mapping key as it reads in a dotted path (``repr`` when it is not plain text)."""
    return key if isinstance(key, str) and key.isprintable() and key else repr(key)


def _is_scalar(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, _SCALAR)


class SpecReader:
    """A mapping at a dotted path; typed getters that fail naming the field."""

    def __init__(self, data: object, path: str, *, name: str = "spec") -> None:
        """
        Args:
            data: the parsed value that must be a mapping.
            path: dotted path of ``data`` in the document (``""`` for the top level).
            name: what to call the top level in an error (``pipeline``, ``spec``).

        Raises:
            SpecError: ``data`` is not a mapping.
        """
        if not isinstance(data, Mapping):
            raise fail(path or name, f"must be a mapping (got {type(data).__name__})")
        self.data: Mapping[Any, Any] = data
        self.path = path
        """Dotted path of this mapping; may be renamed once a name is known (a stage)."""
        self._used: set[object] = set()

    def at(self, key: str) -> str:
        """The dotted path of ``key`` inside this mapping."""
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str) -> Any:
        """The value as parsed (None when absent); marks the field as known."""
        self._used.add(key)
        return self.data.get(key)

    # -- scalars ------------------------------------------------------------------------

    @overload
    def str_(self, key: str, default: str) -> str: ...
    @overload
    def str_(self, key: str, default: None = None) -> str | None: ...
    def str_(self, key: str, default: str | None = None) -> str | None:
        """A non-empty string (numbers are not strings here)."""
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, str) or not value:
            raise fail(self.at(key), f"must be a non-empty string (got {value!r})")
        return value

    @overload
    def scalar(self, key: str, default: str) -> str: ...
    @overload
    def scalar(self, key: str, default: None = None) -> str | None: ...
    def scalar(self, key: str, default: str | None = None) -> str | None:
        """A non-empty string, a number written unquoted (``nprocPerNode: 2``) as its text."""
        value = self.raw(key)
        if value is None:
            return default
        if not _is_scalar(value) or value == "":
            raise fail(self.at(key), f"must be a non-empty string (got {value!r})")
        return str(value)

    def req_str(self, key: str) -> str:
        value = self.str_(key)
        if value is None:
            raise fail(self.at(key), "is required")
        return value

    @overload
    def int_(self, key: str, default: int) -> int: ...
    @overload
    def int_(self, key: str, default: None = None) -> int | None: ...
    def int_(self, key: str, default: int | None = None) -> int | None:
        value = self.raw(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(self.at(key), f"must be an integer (got {value!r})")
        return value

    def bool_(self, key: str, default: bool) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise fail(self.at(key), f"must be true or false (got {value!r})")
        return value

    def num(self, key: str, default: float) -> float:
        """A finite number of seconds (``nan`` and ``inf`` are refused)."""
        value = self.raw(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise fail(self.at(key), f"must be a number of seconds (got {value!r})")
        # (an int compares with a float exactly; math.isfinite(int) overflows on a huge one)
        if isinstance(value, float) and not math.isfinite(value):
            raise fail(self.at(key), f"must be a finite number of seconds (got {value!r})")
        if abs(value) > _MAX_SECONDS:
            raise fail(self.at(key), f"must be at most {_MAX_SECONDS:.0f} seconds (one year)")
        return float(value)

    # -- collections --------------------------------------------------------------------

    def sub(self, key: str) -> SpecReader | None:
        """The nested mapping at ``key`` (None when absent)."""
        value = self.raw(key)
        return None if value is None else SpecReader(value, self.at(key))

    def list_(self, key: str) -> list[Any]:
        value = self.raw(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise fail(self.at(key), f"must be a list (got {type(value).__name__})")
        return value

    def str_list(self, key: str) -> tuple[str, ...]:
        """A list of non-empty strings (unquoted numbers as their text)."""
        out = []
        for i, v in enumerate(self.list_(key)):
            if not _is_scalar(v) or v == "":
                raise fail(f"{self.at(key)}[{i}]", f"must be a non-empty string (got {v!r})")
            out.append(str(v))
        return tuple(out)

    def str_map(
        self, key: str, *, key_pattern: re.Pattern[str] | None = None, what: str = "key"
    ) -> tuple[tuple[str, str], ...]:
        """A mapping of names to scalar values, as strings, in file order.

        ``key_pattern``: every name must match it (else ``path.name: is not a valid <what>``).
        """
        value = self.raw(key)
        if value is None:
            return ()
        if not isinstance(value, Mapping):
            raise fail(self.at(key), f"must be a mapping (got {type(value).__name__})")
        out = []
        for k, v in value.items():
            where = f"{self.at(key)}.{key_text(k)}"
            if key_pattern is not None and (not isinstance(k, str) or not key_pattern.match(k)):
                raise fail(where, f"is not a valid {what}")
            if not _is_scalar(v):
                raise fail(where, f"must be a string (got {v!r})")
            out.append((str(k), str(v)))
        return tuple(out)

    def done(self) -> None:
        """Raises SpecError naming the first field no getter asked for."""
        unknown = sorted(key_text(k) for k in self.data if k not in self._used)
        if unknown:
            raise fail(self.at(unknown[0]), "unknown field")


# -- files ----------------------------------------------------------------------------


def read_text(path: str | Path, what: str) -> str:
    """A UTF-8 text file's contents.

    Raises:
        SpecError: missing, unreadable, a directory, or not UTF-8 text (binary).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read {what} ({exc.strerror or exc})") from exc
    if b"\0" in data:
        raise SpecError(f"{path}: not a {what}: a binary file (NUL bytes), expected YAML text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(
            f"{path}: not a {what}: not UTF-8 text (byte {exc.start}: {exc.reason})"
        ) from exc


def _parse_yaml(text: str, source: str, *, multi: bool) -> list[Any]:
    import yaml

    try:
        docs = list(yaml.safe_load_all(text)) if multi else [yaml.safe_load(text)]
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: not valid YAML ({exc})".replace("\n", " ")) from exc
    except ValueError as exc:  # a scalar PyYAML cannot convert: 2020-13-45, a 5000-digit int
        raise SpecError(f"{source}: not valid YAML ({exc})".replace("\n", " ")) from exc
    except RecursionError as exc:
        raise SpecError(f"{source}: not valid YAML (nested too deeply)") from exc
    return docs


def load_yaml(path: str | Path, what: str) -> Any:
    """The one YAML document of a spec file, parsed with ``safe_load``.

    Raises:
        SpecError: see :func:`read_text`, or the text is not YAML.
    """
    return _parse_yaml(read_text(path, what), str(path), multi=False)[0]


def load_yaml_documents(path: str | Path, what: str) -> list[Any]:
    """Every document of a multi-document YAML file (empty documents dropped).

    Raises:
        SpecError: see :func:`read_text`, or the text is not YAML.
    """
    return parse_yaml_documents(read_text(path, what), str(path))


def parse_yaml_documents(text: str, source: str) -> list[Any]:
    """Every document of a YAML stream (empty documents dropped).

    Raises:
        SpecError: the text is not YAML.
    """
    return [d for d in _parse_yaml(text, source, multi=True) if d is not None]


__all__ = [
    "SpecReader",
    "fail",
    "key_text",
    "load_yaml",
    "load_yaml_documents",
    "parse_yaml_documents",
    "read_text",
]
