"""CheckpointOptions (issue 15), storage options from the environment (issue 19), and no
side effects at ``import flexrun.train``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from flexrun.errors import CheckpointError, ConfigError
from flexrun.storage_options import STORAGE_OPTIONS_ENV, check_no_secrets
from flexrun.train import Checkpointer, CheckpointOptions, storage_options_from_env
from flexrun.train.context import single_process_context


def test_options_are_a_frozen_validated_record() -> None:
    o = CheckpointOptions(keep_last=2, persist_cpu_share=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.keep_last = 5  # type: ignore[misc]
    for bad in (
        {"keep_last": 0},
        {"keep_every": 0},
        {"max_failed_saves": 0},
        {"failed_saves_grace_s": -1.0},
        {"failed_saves_grace_s": float("nan")},
        {"persist_cpu_share": 0.0},
        {"persist_cpu_share": 1.5},
        {"persist_max_bytes_s": 0.0},
        {"persist_max_bytes_s": float("inf")},
    ):
        with pytest.raises(CheckpointError):
            CheckpointOptions(**bad)  # type: ignore[arg-type]


def test_the_old_keyword_arguments_still_work_and_override_options(tmp_path: Path) -> None:
    ctx = single_process_context()
    old = Checkpointer(tmp_path / "a", ctx=ctx, keep_last=2, async_save=False, save_rng=False)
    new = Checkpointer(
        tmp_path / "b",
        ctx=ctx,
        options=CheckpointOptions(keep_last=2, async_save=False, save_rng=False),
    )
    assert old.options == new.options
    both = Checkpointer(tmp_path / "c", ctx=ctx, options=new.options, keep_last=7)
    assert both.options.keep_last == 7 and both.options.async_save is False
    with pytest.raises(TypeError, match="keep_lsat"):
        Checkpointer(tmp_path / "d", ctx=ctx, keep_lsat=2)
    with pytest.raises(CheckpointError, match="keep_last"):
        Checkpointer(tmp_path / "e", ctx=ctx, keep_last=0)


def test_storage_options_come_from_the_environment_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, json.dumps({"skip_instance_cache": True}))
    assert storage_options_from_env() == {"skip_instance_cache": True}
    c = Checkpointer(
        f"memory://ck-{uuid.uuid4().hex}", ctx=single_process_context(), storage_options="env"
    )
    assert c.directory.startswith("memory://")
    for raw, match in (("not json", "not JSON"), ("[1]", "JSON object")):
        monkeypatch.setenv(STORAGE_OPTIONS_ENV, raw)
        with pytest.raises(ConfigError, match=match):
            storage_options_from_env()
    monkeypatch.delenv(STORAGE_OPTIONS_ENV)
    assert storage_options_from_env() == {}
    with pytest.raises(CheckpointError, match="local paths"):
        Checkpointer(tmp_path, ctx=single_process_context(), storage_options={"anon": True})
    with pytest.raises(CheckpointError, match="mapping or 'env'"):
        Checkpointer("memory://x", ctx=single_process_context(), storage_options="ENV")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [
        {"secret": "x"},
        {"key": "AKIA"},
        {"client_kwargs": {"aws_secret_access_key": "x"}},
        {"config_kwargs": {"x": [{"password": "p"}]}},
        {"account_key": "k"},
        {"sas_token": "t"},
        {"token": "ya29.secret"},
    ],
)
def test_credentials_in_storage_options_from_a_spec_are_refused(options: dict) -> None:
    with pytest.raises(ConfigError, match="credential"):
        check_no_secrets(options, "checkpoint.storageOptions")


def test_storage_options_without_credentials_pass() -> None:
    check_no_secrets(
        {
            "endpoint_url": "http://minio:9000",
            "profile": "training",
            "client_kwargs": {"region_name": "eu-west-1"},
            "token": "google_default",
        },
        "x",
    )


_PROBE = """
import os, signal, sys, time
import flexrun.train as ft
print("handler", signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL, os.path.exists(sys.argv[1]))
ft.report_progress(1)  # first use installs the dump
os.kill(os.getpid(), signal.SIGUSR2)
time.sleep(0.5)
print("dumped", "report_progress" in open(sys.argv[1]).read() or "<module>" in open(sys.argv[1]).read())
"""


@pytest.mark.timeout(120)
def test_import_has_no_side_effects_and_first_use_installs_the_stack_dump(tmp_path: Path) -> None:
    stacks = tmp_path / "stacks.txt"
    env = dict(
        os.environ, FLEXRUN_STACK_FILE=str(stacks), FLEXRUN_PROGRESS_FILE=str(tmp_path / "p")
    )
    r = subprocess.run(
        [sys.executable, "-c", _PROBE, str(stacks)],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "handler True False" in r.stdout  # nothing registered, nothing opened at import
    assert "dumped True" in r.stdout  # SIGUSR2 after report_progress dumps every thread
