"""Versioned model directories: publish makes v1, v2, ...; rollback only moves the pointer."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrun.errors import ConfigError
from flexrun.pipeline.versions import current, publish, rollback, staging_dir, versions

pytestmark = pytest.mark.timeout(30)


def _publish(root: Path, text: str) -> str:
    staging = staging_dir(root)
    (staging / "w.txt").write_text(text)
    return publish(root, staging)


def test_publish_numbers_versions_and_points_current_at_the_newest(tmp_path: Path) -> None:
    root = tmp_path / "models"
    assert current(root) is None and versions(root) == []
    assert _publish(root, "a") == "v1"
    assert _publish(root, "b") == "v2"
    assert versions(root) == ["v1", "v2"]
    assert current(root) == "v2"
    assert (root / "v1" / "w.txt").read_text() == "a"
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


def test_rollback_moves_the_pointer_only(tmp_path: Path) -> None:
    root = tmp_path / "models"
    for t in "abc":
        _publish(root, t)
    assert rollback(root) == ("v3", "v2")
    assert current(root) == "v2"
    assert versions(root) == ["v1", "v2", "v3"]
    assert rollback(root, "v3") == ("v2", "v3")
    assert _publish(root, "d") == "v4"  # numbering never reuses a version


def test_rollback_errors_name_the_problem(tmp_path: Path) -> None:
    root = tmp_path / "models"
    with pytest.raises(ConfigError, match="no model versions"):
        rollback(root)
    _publish(root, "a")
    with pytest.raises(ConfigError, match="oldest version"):
        rollback(root)
    with pytest.raises(ConfigError, match="no version 'v9'"):
        rollback(root, "v9")
