"""``flexrun run``'s parser against torch's own ``torch.distributed.run.get_args_parser()``.

Option by option: spellings, destination, default, nargs, choices, what the type accepts,
and the ``PET_*`` fallback. A torch release that adds or changes an option fails here, not
in a user's bug report.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Mapping

import pytest
import torch
import torch.distributed.run as torchrun

from flexrun.cli import build_parser
from flexrun.config.numa import MODES
from flexrun.errors import ConfigError

_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
# flexrun's options are torch 2.13's (and 2.15's additions); an older torch's parser differs
# on purpose (2.10's --master-port defaults to 29500, 2.13's to None), so it is not the spec.
older_torch = pytest.mark.skipif(
    _TORCH < (2, 13), reason=f"torch {torch.__version__}: flexrun follows torch 2.13's parser"
)
FLEXRUN_ONLY = {
    "stop_grace",
    "run_dir",
    "node_id",
    "mode",
    "live_shards",
    "hang_timeout",
    "crash_loop_restarts",
    "metrics_port",
    "metrics_host",
    "resource_interval",
    "warm_spares",
    "spares_dir",
    "spare_preload",
    "accelerate_config",
}
SAMPLES = ["0", "1", "7", "-1", "2.5", "nan", "x", "a,b", "a,,b", "", "1:4", "SIGUSR1"]


@pytest.fixture
def clean_pet(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for key in list(os.environ):
        if key.startswith("PET_"):
            monkeypatch.delenv(key)
    yield monkeypatch


def _torch(monkeypatch: pytest.MonkeyPatch, env: Mapping[str, str]) -> argparse.ArgumentParser:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        return torchrun.get_args_parser()
    finally:
        for k in env:
            monkeypatch.delenv(k)


def _flexrun(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = build_parser(dict(env))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def _actions(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in p._actions if a.dest != "help"}


def _apply(type_: object, text: str) -> object:
    if type_ is None:
        return text
    try:
        return type_(text)  # type: ignore[operator]
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return "<rejected>"


@older_torch
def test_every_torchrun_option_is_accepted_with_the_same_spellings(clean_pet) -> None:
    ours, theirs = _actions(_flexrun({})), _actions(_torch(clean_pet, {}))
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"torchrun options flexrun lacks: {missing}"
    for dest, t in theirs.items():
        assert set(t.option_strings) == set(ours[dest].option_strings), dest


# torch 2.13's options: an older torch lacks some of them (flexrun still takes them).
TORCH_2_13 = {
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
    "standalone", "max_restarts", "monitor_interval", "start_method", "event_log_handler",
    "role", "module", "no_python", "run_path", "log_dir", "redirects", "tee",
    "local_ranks_filter", "duplicate_stdout_filters", "duplicate_stderr_filters", "node_rank",
    "master_addr", "master_port", "local_addr", "logs_specs", "numa_binding",
    "signals_to_handle", "shutdown_timeout", "virtual_local_rank", "training_script",
    "training_script_args",
}  # fmt: skip


# torch 2.15's additions: flexrun takes them on an older torch too.
TORCH_2_15 = TORCH_2_13 | {"log_line_prefix_template", "print_completion"}


def test_flexrun_adds_only_its_documented_options(clean_pet) -> None:
    theirs = set(_actions(_torch(clean_pet, {})))
    extra = set(_actions(_flexrun({}))) - theirs
    assert extra - TORCH_2_15 == FLEXRUN_ONLY
    if theirs >= TORCH_2_15:
        assert extra == FLEXRUN_ONLY


@older_torch
def test_defaults_nargs_and_choices_match(clean_pet) -> None:
    ours, theirs = _actions(_flexrun({})), _actions(_torch(clean_pet, {}))
    for dest, t in theirs.items():
        o = ours[dest]
        assert o.default == t.default, dest
        assert o.nargs == t.nargs, dest
        assert (list(o.choices) if o.choices else None) == (
            list(t.choices) if t.choices else None
        ), dest
        assert o.required == t.required, dest


@older_torch
def test_types_accept_and_convert_the_same_values(clean_pet) -> None:
    ours, theirs = _actions(_flexrun({})), _actions(_torch(clean_pet, {}))
    for dest, t in theirs.items():
        for text in SAMPLES:
            assert repr(_apply(ours[dest].type, text)) == repr(_apply(t.type, text)), (dest, text)


def _env_value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "1"
    if action.choices:
        return str(list(action.choices)[-1])
    if action.type is int:
        return "3"
    if action.type is float:
        return "0.5"
    return "a,b"


@older_torch
def test_pet_fallback_follows_torchruns_rules(clean_pet) -> None:
    plain = _actions(_torch(clean_pet, {}))
    for dest, t in plain.items():
        if not t.option_strings:
            continue  # positionals
        env = {f"PET_{dest.upper()}": _env_value(t)}
        theirs = _actions(_torch(clean_pet, env))[dest].default
        ours = _actions(_flexrun(env))[dest].default
        assert ours == theirs, (dest, env, ours, theirs)


@older_torch
@pytest.mark.parametrize("value", ["0", "1", "2"])
def test_pet_flags_are_bool_of_int(clean_pet, value: str) -> None:
    env = {"PET_STANDALONE": value, "PET_VIRTUAL_LOCAL_RANK": value}
    theirs = _torch(clean_pet, env).parse_args(["s.py"])
    ours = _flexrun(env).parse_args(["s.py"])
    assert ours.standalone == theirs.standalone == bool(int(value))
    assert ours.virtual_local_rank == theirs.virtual_local_rank


def test_a_non_integer_pet_flag_is_one_clear_error(clean_pet) -> None:
    with pytest.raises(ConfigError, match="PET_STANDALONE"):
        _flexrun({"PET_STANDALONE": "maybe"})
    assert _flexrun({"PET_STANDALONE": "true"}).parse_args(["s.py"]).standalone


TORCHRUN_COMMAND_LINES = [
    ["--standalone", "--nproc-per-node", "4", "train.py", "--lr", "1"],
    [
        "--nnodes=2",
        "--nproc_per_node=8",
        "--node_rank=1",
        "--master_addr=10.0.0.1",
        "--master_port=29501",
        "train.py",
    ],
    [
        "--nnodes",
        "1:4",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "h:29400",
        "--rdzv-id",
        "j",
        "--rdzv-conf",
        "join_timeout=5,last_call_timeout=1",
        "train.py",
    ],
    [
        "-r",
        "3",
        "-t",
        "0:3,1:1",
        "--log-dir",
        "/tmp/x",
        "--local-ranks-filter",
        "0,1",
        "-m",
        "pkg.mod",
        "a",
        "-b",
    ],
    ["--no-python", "--run-path", "--start-method", "fork", "--monitor-interval", "1", "x.sh"],
    [
        "--logs-specs",
        "mine",
        "--numa-binding",
        "socket",
        "--signals-to-handle",
        "SIGUSR1",
        "--shutdown-timeout",
        "5",
        "--virtual-local-rank",
        "--event-log-handler",
        "console",
        "s.py",
    ],
    [
        "--duplicate-stdout-filters",
        "apple,,pie,orange",
        "--duplicate_stderr_filters",
        "x",
        "--max_restarts",
        "3",
        "--role",
        "trainer",
        "--local_addr",
        "1.2.3.4",
        "s.py",
    ],
]


@older_torch
@pytest.mark.parametrize("argv", TORCHRUN_COMMAND_LINES)
def test_torchrun_command_lines_parse_to_the_same_values(clean_pet, argv: list[str]) -> None:
    theirs = vars(_torch(clean_pet, {}).parse_args(argv))
    ours = vars(_flexrun({}).parse_args(argv))
    for dest, value in theirs.items():
        assert ours[dest] == value, dest


def test_numa_modes_are_torchs() -> None:
    binding = pytest.importorskip("torch.numa.binding", reason="this torch has no NUMA binding")
    AffinityMode = binding.AffinityMode  # noqa: N806

    assert tuple(m.value for m in AffinityMode) == MODES


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _flexrun({}).parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for action in _flexrun({})._actions:
        if action.option_strings and action.dest != "help":
            assert f"(default: {action.default})" in out, action.dest
