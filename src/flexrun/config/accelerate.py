"""``--accelerate-config FILE``: the environment ``accelerate launch`` gives its workers.

Owns translating an ``accelerate config`` file into the variables accelerate's launcher
sets (``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_DYNAMO_*``, ``FSDP_*``,
``MEGATRON_LM_*``, ``PARALLELISM_CONFIG_*``, ``OMP_NUM_THREADS``...). It does not copy
accelerate's mapping: it asks the job's own interpreter (``PYTHON_EXEC``, the workers'
accelerate, the same version) to run accelerate's launcher up to the environment, exactly
as ``accelerate launch --config_file FILE`` would (its own validation, then
``prepare_multi_gpu_env`` for multi-GPU/FSDP/Megatron-LM, ``prepare_deepspeed_cmd_env``
for DeepSpeed, ``prepare_simple_launcher_cmd_env`` otherwise), and keeps what that adds or
changes, less what flexrun sets for each worker itself (rank, world, master address).
accelerate reads the file with ``yaml.safe_load``/``json``; nothing in it runs.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from flexrun.errors import ConfigError

TIMEOUT_S = 120.0
"""How long accelerate may take (importing it imports torch) before the option fails."""

LAUNCHER_OWNED = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
        "PYTHONPATH",
    }
)
"""Variables accelerate's launchers may set that are flexrun's to set per worker (or the
caller's): never taken from the config."""

_PROBE = r"""
import json, os, sys
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import launch as L

args = launch_command_parser().parse_args(["--config_file", sys.argv[1], "flexrun-script.py"])
args, defaults, mp_from_config = _validate_launch_command(args)
if args.tpu and not args.cpu:
    sys.exit("TPU configs are not supported under flexrun")
if defaults is not None and str(defaults.compute_environment) == "AMAZON_SAGEMAKER":
    sys.exit("SageMaker configs are not supported under flexrun")
if args.use_deepspeed and not args.cpu:
    fields = list(defaults.deepspeed_config.keys()) if defaults else []
    if mp_from_config:
        fields.append("mixed_precision")
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = L.prepare_deepspeed_cmd_env(args)
elif (args.use_fsdp or args.use_megatron_lm or args.multi_gpu) and not args.cpu:
    env = L.prepare_multi_gpu_env(args)
else:
    _, env = L.prepare_simple_launcher_cmd_env(args)
print(json.dumps({k: v for k, v in env.items() if os.environ.get(k) != v}))
"""


def accelerate_env(
    path: str | os.PathLike[str], python: str, environ: Mapping[str, str]
) -> dict[str, str]:
    """The variables ``accelerate launch --config_file path`` would add to ``environ``.

    Raises:
        ConfigError: the file is missing, accelerate is not installed for ``python``, or
            accelerate refuses the file (its message).
    """
    cfg = Path(path)
    if not cfg.is_file():
        raise ConfigError(f"--accelerate-config {path}: no such file")
    try:
        done = subprocess.run(
            [python, "-c", _PROBE, str(cfg.absolute())],
            env=dict(environ),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"--accelerate-config {path}: could not run {python}: {exc}") from exc
    if done.returncode != 0:
        lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
        last = lines[-1] if lines else f"exit {done.returncode}"
        if "No module named 'accelerate" in done.stderr:
            last = f"accelerate is not installed for {python}"
        raise ConfigError(f"--accelerate-config {path}: {last}")
    try:
        added = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise ConfigError(f"--accelerate-config {path}: unreadable answer from accelerate") from exc
    return {str(k): str(v) for k, v in added.items() if k not in LAUNCHER_OWNED}
