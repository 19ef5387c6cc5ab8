"""The agent's copier of worker output (proc/drain.py), on real pipes and terminals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flexrun.proc import drain as d


def _read_all(fd: int) -> bytes:
    out = b""
    while chunk := os.read(fd, 65536):
        out += chunk
    return out


@pytest.mark.timeout(10)
def test_a_pipe_is_logged_whole_and_shown_line_by_line_with_its_prefix(tmp_path: Path) -> None:
    con_r, con_w = os.pipe()
    read, write = os.pipe()
    copy = d.StreamCopy("stderr", tmp_path / "stderr.log", con_w, b"[rank3]:", keep_tail=True)
    drain = d.Drain("t", {read: copy})
    drain.start()
    os.write(write, b"one\ntw")
    os.write(write, b"o\nno newline")
    os.close(write)
    assert drain.wait_eof(5)
    drain.close()
    os.close(con_w)
    assert _read_all(con_r) == b"[rank3]:one\n[rank3]:two\n[rank3]:no newline\n"
    assert (tmp_path / "stderr.log").read_bytes() == b"one\ntwo\nno newline"
    assert copy.tail == b"one\ntwo\nno newline"


@pytest.mark.timeout(10)
def test_a_terminal_passes_bytes_unmodified_and_its_reader_sees_a_tty(tmp_path: Path) -> None:
    con_r, con_w = os.pipe()
    master, slave = d.open_pty(con_w)  # (not a terminal: the window size is left alone)
    assert os.isatty(slave)
    drain = d.Drain("t", {master: d.StreamCopy("stdout", tmp_path / "o.log", con_w, None)})
    drain.start()
    os.write(slave, b"\r 10%|#\r 20%|##\nend\n")  # no output processing: \n stays \n
    os.close(slave)
    assert drain.wait_eof(5)
    drain.close()
    os.close(con_w)
    assert _read_all(con_r) == b"\r 10%|#\r 20%|##\nend\n"
    assert (tmp_path / "o.log").read_bytes() == b"\r 10%|#\r 20%|##\nend\n"


def test_a_log_that_cannot_be_written_is_dropped_said_once_and_resumed(tmp_path: Path) -> None:
    said: list[str] = []
    notice = d._DiskNotice()
    notice.say = said.append
    old, d.DISK_NOTICE = d.DISK_NOTICE, notice
    try:
        gone = tmp_path / "missing"  # (a directory that is not there fails every open)
        copy = d.StreamCopy("stdout", gone / "stdout.log", None, b"")
        copy.feed(b"a\nb\n")
        copy.feed(b"c\n")
        assert notice.dropped_lines == 3 and len(said) == 1
        assert "cannot write worker logs" in said[0]
        gone.mkdir()
        copy.feed(b"d\n")
        copy.end()
        assert (gone / "stdout.log").read_bytes() == b"d\n"
        assert len(said) == 2 and "written again (3 line(s) dropped" in said[1]
    finally:
        d.DISK_NOTICE = old


@pytest.mark.timeout(10)
def test_a_process_that_opens_its_output_by_path_is_drained_too(tmp_path: Path) -> None:
    paths, drain = d.output_paths(tmp_path, d.Console())
    for name, path in paths.items():
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOCTTY)
        os.write(fd, f"{name} line\n".encode())
        os.close(fd)
    assert drain.wait_eof(5)  # (releases the agent's own write ends)
    assert drain.tail("stderr") == "stderr line\n"
    drain.close()
    assert (tmp_path / "stdout.log").read_text() == "stdout line\n"
    assert not Path(paths["stdout"]).exists()  # its private FIFO directory is gone
