"""The documentation site builds with MkDocs in strict mode: no broken link, no missing anchor,
no page left out of the nav, no nav entry without its page (mkdocs.yml, docs/).

A page added under docs/ must be added to mkdocs.yml's nav; a link must name a page or an
anchor that exists. Files outside docs/ (tests/, bench/results/, src/) are named in backticks,
not linked: tests/test_doc_refs.py checks those.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # (a banner, not a warning)
    )


@pytest.mark.timeout(300)
def test_the_docs_site_builds_in_strict_mode(tmp_path: Path) -> None:
    res = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "WARNING" not in res.stderr, res.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "user" / "torchrun" / "index.html").is_file()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flaw", ["broken-link", "page-not-in-nav"])
def test_a_broken_link_or_an_unlisted_page_fails_the_build(tmp_path: Path, flaw: str) -> None:
    """The strict build is what catches these: on a copy of the docs, each flaw fails it."""
    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("mkdocs.yml", "SECURITY.md"):  # (the threat-model page includes SECURITY.md)
        (copy / name).write_text((ROOT / name).read_text())
    subprocess.run(["cp", "-r", str(ROOT / "docs"), str(copy / "docs")], check=True, timeout=60)
    if flaw == "broken-link":
        page = copy / "docs" / "user" / "options.md"
        page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
        expect = "no-such-page.md"
    else:
        (copy / "docs" / "user" / "orphan.md").write_text("# Orphan\n\nNot in the nav.\n")
        expect = "orphan.md"
    res = _build(copy / "mkdocs.yml", tmp_path / "site")
    assert res.returncode != 0, res.stdout + res.stderr
    assert expect in res.stderr, res.stderr
