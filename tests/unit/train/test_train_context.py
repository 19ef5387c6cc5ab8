from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

import flexrun.train as ft
from flexrun.errors import ConfigError


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_init_without_rendezvous_is_single_process_and_idempotent() -> None:
    ft.shutdown()
    ctx = ft.init(env=ft.read_env({}), run_dir="/tmp/x")
    try:
        assert ctx.world_size == 1 and ctx.backend is None and ctx.run_dir == "/tmp/x"
        assert ft.init() is ctx and ft.current() is ctx
    finally:
        ft.shutdown()
        ft.shutdown()
    assert ft.current() is None


@pytest.mark.timeout(60)
def test_init_forms_a_gloo_group_from_torchrun_variables_and_shutdown_destroys_it() -> None:
    ft.shutdown()
    env = ft.read_env(
        {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port())}
    )
    ctx = ft.init(env=env)
    try:
        assert ctx.backend == "gloo" and dist.is_initialized() and dist.get_world_size() == 1
    finally:
        ft.shutdown()
    assert not dist.is_initialized()


def test_several_workers_without_rendezvous_address_is_a_config_error() -> None:
    ft.shutdown()
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        ft.init(env=ft.read_env({"RANK": "0", "WORLD_SIZE": "2"}))


@pytest.mark.timeout(60)
def test_flexrun_train_does_not_import_the_agent() -> None:
    code = "import sys, flexrun.train; print([m for m in sys.modules if m.startswith('flexrun.agent')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
