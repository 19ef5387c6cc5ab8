"""Fuzz: the command line of ``flexrun run`` and ``--rdzv-conf`` (flexrun.config).

Every flag that takes a value gets hostile values (non-finite and negative numbers, huge
integers, paths to files, empty strings, control characters); ``--rdzv-conf`` gets
arbitrary ``k=v`` lists over its known keys. Property: a one-line :class:`ConfigError`
(exit 2 at the CLI) or a :class:`RunConfig` whose durations are finite; never another
exception. Nothing is launched (the parse only) and no file is written.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzz_support import FUZZ
from hypothesis import example, given
from hypothesis import strategies as st

from flexrun.cli import build_parser
from flexrun.config import run_config_from_args
from flexrun.config.backends import backend_named
from flexrun.config.parsing import parse_kv
from flexrun.errors import ConfigError

pytestmark = pytest.mark.timeout(180)

RDZV_KEYS = [
    "heartbeat_interval",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "timeout",
    "read_timeout",
    "connect_timeout",
    "request_timeout",
    "is_host",
    "store_type",
    "protocol",
    "tls",
    "user",
    "etcd_prefix",
    "cert",
    "key",
    "cacert",
    "secret_file",
    "password_file",
    "password",
    "nope",
]
HOSTILE = st.sampled_from(
    [
        "nan",
        "inf",
        "-inf",
        "-1",
        "0",
        "1e999",
        "1" * 400,
        "",
        " ",
        "\x01",
        "afile",
        "/",
        "..",
        "0x10",
        "1.5",
        "3",
        "true",
        "yes",
        "a=b",
        "a,b",
        ":",
        "1:2",
        "4:1",
        "127.0.0.1:0",
        "999.1.1.1:1",
        "[::1]:5",
        "c10d",
        "etcd",
        "static",
    ]
) | st.text(max_size=10).map(lambda t: t.replace("\x00", ""))  # argv cannot hold NUL


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("fuzz-config")
    (d / "train.py").write_text("print('never runs')\n")
    (d / "afile").write_text("x")
    old = os.getcwd()
    os.chdir(d)
    try:
        yield d
    finally:
        os.chdir(old)


@FUZZ
@example(pairs=[("keep_alive_max_attempt", "1" * 400)], etcd=False, max_nodes=1)
@example(pairs=[("keep_alive_max_attempt", "\u00b2")], etcd=False, max_nodes=1)
@given(
    pairs=st.lists(st.tuples(st.sampled_from(RDZV_KEYS), HOSTILE), max_size=5),
    etcd=st.booleans(),
    max_nodes=st.integers(1, 10_000),
)
def test_rdzv_conf_is_a_config_error_or_finite_settings(
    workdir: Path, pairs: list[tuple[str, str]], etcd: bool, max_nodes: int
) -> None:
    text = ",".join(f"{k}={v}" for k, v in pairs)
    try:
        backend = backend_named("etcd" if etcd else "c10d")
        parsed = backend.parse_conf(parse_kv(text), max_nodes=max_nodes)
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    # (Its fields, not dir(): on Python 3.10 the __weakref__ that dir() lists on a
    # dataclass(slots=True) raises TypeError when read.)
    for field in dataclasses.fields(parsed):
        v = getattr(parsed, field.name)
        if isinstance(v, float):
            assert math.isfinite(v), (field.name, v)


VALUE_FLAGS = [
    "--nnodes",
    "--nproc-per-node",
    "--node-rank",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--max-restarts",
    "--monitor-interval",
    "--stop-grace",
    "--shutdown-timeout",
    "--hang-timeout",
    "--master-port",
    "--master-addr",
    "--local-addr",
    "--metrics-port",
    "--metrics-host",
    "--resource-interval",
    "--run-dir",
    "--log-dir",
    "--redirects",
    "--tee",
    "--local-ranks-filter",
    "--signals-to-handle",
    "--node-id",
    "--numa-binding",
    "--start-method",
    "--mode",
    "--spares-dir",
    "--warm-spares",
    "--role",
]


@FUZZ
@example(flags=[("--nnodes", "1" * 400)], conf=[], standalone=False)  # overflowed a float
@example(flags=[("--nproc-per-node", "\u00b2")], conf=[], standalone=False)  # isdigit, not int
@example(flags=[("--run-dir", "1" * 400)], conf=[], standalone=False)  # ENAMETOOLONG
@given(
    flags=st.lists(st.tuples(st.sampled_from(VALUE_FLAGS), HOSTILE), min_size=1, max_size=4),
    conf=st.lists(st.tuples(st.sampled_from(RDZV_KEYS), HOSTILE), max_size=2),
    standalone=st.booleans(),
)
def test_a_hostile_command_line_is_one_config_error_or_a_run_config(
    workdir: Path, flags: list[tuple[str, str]], conf: list[tuple[str, str]], standalone: bool
) -> None:
    argv = [f"{flag}={value}" for flag, value in flags]
    if conf:
        argv.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf))
    if standalone:
        argv.append("--standalone")
    env: dict[str, str] = {}
    try:
        ns = build_parser(env).parse_args(["run", *argv, "train.py"])
        cfg = run_config_from_args(ns, env)
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc).strip(), str(exc)
        return
    for group in (cfg, getattr(cfg, "rendezvous", None), getattr(cfg, "store", None)):
        for name in getattr(group, "__slots__", ()):
            v = getattr(group, name, None)
            if isinstance(v, float):
                assert math.isfinite(v), (name, v, argv)
    assert not (workdir / "flexrun-runs").exists()  # the parse creates nothing
