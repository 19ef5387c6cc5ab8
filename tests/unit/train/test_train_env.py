from __future__ import annotations

import pytest

from flexrun.errors import ConfigError
from flexrun.train import read_env


def test_defaults_describe_a_single_process_without_run_dir() -> None:
    env = read_env({})
    assert (env.rank, env.world_size, env.local_rank, env.round) == (0, 1, 0, 0)
    assert env.run_dir is None and not env.distributed


def test_torchrun_variables_are_read_and_round_falls_back_to_restart_count() -> None:
    env = read_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_RUN_ID": "job",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert env.distributed and env.master_port == 29500
    assert env.round == 2 and env.restart_count == 2 and env.run_id == "job"


def test_flexrun_variables_override() -> None:
    env = read_env(
        {
            "FLEXRUN_ROUND": "7",
            "FLEXRUN_RUN_DIR": "/runs/x",
            "FLEXRUN_RUN_ID": "r1",
            "FLEXRUN_NODE": "n0",
            "TORCHELASTIC_RESTART_COUNT": "1",
        }
    )
    assert (env.round, env.run_dir, env.run_id, env.node) == (7, "/runs/x", "r1", "n0")


@pytest.mark.parametrize(
    "bad", [{"RANK": "x"}, {"RANK": "2", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "0"}]
)
def test_malformed_environment_is_a_config_error(bad: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        read_env(bad)
