"""torchrun's ``--duplicate-std{out,err}-filters`` in the drain (proc/drain.py): matching
lines of tee'd streams copied, after their prefix, into one shared file."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from flexrun.proc import drain as d


def test_a_line_matches_when_it_holds_any_needle_and_an_empty_needle_matches_all() -> None:
    needles = d.filter_needles(("apple", "orange"))
    assert d.line_matches(b"an apple a day", needles)
    assert d.line_matches(b"orange", needles)
    assert not d.line_matches(b"a pear", needles)
    assert d.line_matches(b"anything", d.filter_needles(("",)))
    assert not d.line_matches(b"anything", ())


@pytest.mark.timeout(10)
def test_matching_lines_of_every_stream_go_to_one_file_after_their_prefix(tmp_path: Path) -> None:
    filtered = d.FilteredLog(tmp_path / "filtered_stdout.log", d.filter_needles(("apple",)))
    filtered.open()
    assert (tmp_path / "filtered_stdout.log").read_bytes() == b""  # created at once
    drains = []
    ends = []
    for rank in (0, 1):
        read, write = os.pipe()
        copy = d.StreamCopy(
            "stdout", tmp_path / f"{rank}.log", None, f"[r{rank}]:".encode(), duplicate=filtered
        )
        drain = d.Drain(str(rank), {read: copy})
        drain.start()
        drains.append(drain)
        ends.append(write)
    os.write(ends[0], b"apple one\npear\nappl")
    os.write(ends[1], b"no\napple two\n")
    os.write(ends[0], b"e three")  # (a line split across reads, and no final newline)
    for fd in ends:
        os.close(fd)
    for drain in drains:
        assert drain.wait_eof(5)
        drain.close()
    filtered.close()
    lines = sorted((tmp_path / "filtered_stdout.log").read_text().splitlines())
    assert lines == ["[r0]:apple one", "[r0]:apple three", "[r1]:apple two"]
    assert (tmp_path / "0.log").read_bytes() == b"apple one\npear\napple three"


def test_only_prefixed_streams_are_filtered_as_torchrun_filters_only_teed_ones(
    tmp_path: Path,
) -> None:
    filtered = d.FilteredLog(tmp_path / "f.log", d.filter_needles(("x",)))
    con = d.Console(
        frozenset({"stdout", "stderr"}),
        {"stderr": "[0]:"},
        {"stdout": filtered, "stderr": filtered},
    )
    assert con._copy("stdout", tmp_path).duplicate is None
    assert con._copy("stderr", tmp_path).duplicate is filtered


def test_a_filtered_file_that_cannot_be_written_drops_lines_and_says_so(tmp_path: Path) -> None:
    said: list[str] = []
    notice = d._DiskNotice()
    notice.say = said.append
    old, d.DISK_NOTICE = d.DISK_NOTICE, notice
    try:
        filtered = d.FilteredLog(tmp_path / "missing" / "f.log", d.filter_needles(("a",)))
        filtered.open()
        filtered.offer(b"[0]:", [b"a1", b"b", b"a2"])
        filtered.close()
        filtered.offer(b"[0]:", [b"a3"])  # (closed: not written, not counted)
    finally:
        d.DISK_NOTICE = old
    assert len(said) == 1 and "cannot write worker logs" in said[0]
    assert notice.dropped_lines == 2


def test_lines_offered_from_many_threads_stay_whole(tmp_path: Path) -> None:
    filtered = d.FilteredLog(tmp_path / "f.log", d.filter_needles(("k",)))
    line = b"k" * 5000

    def feed(i: int) -> None:
        for _ in range(50):
            filtered.offer(f"[{i}]:".encode(), [line])

    threads = [threading.Thread(target=feed, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    filtered.close()
    got = (tmp_path / "f.log").read_bytes().splitlines()
    assert len(got) == 200 and all(g.endswith(line) and len(g) == len(line) + 4 for g in got)
