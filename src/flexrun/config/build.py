"""From parsed ``flexrun run`` arguments (and the environment) to a validated RunConfig.

Owns the precedence rules that span several options (``--shutdown-timeout`` vs
``--stop-grace`` vs ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; ``--run-path`` over ``--module`` and
``--no-python``; which ``PET_*`` were given; ``SLURM_*`` below both, :mod:`flexrun.config.slurm`)
and the assembly; every value's syntax is in
:mod:`flexrun.config.parsing`, the job's shape in :mod:`flexrun.config.topology`, the address in
:mod:`flexrun.config.netaddr`. The environment is the mapping the CLI captured
(:func:`flexrun.config.process_environ`); nothing here reads ``os.environ``.
"""

from __future__ import annotations

import logging
import re
import sys
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from flexrun.config import netaddr, numa, plugins
from flexrun.config.accelerate import accelerate_env
from flexrun.config.backends import ALIASES, BACKENDS, backend_named
from flexrun.config.credentials import generated_secret, store_credentials
from flexrun.config.parsing import (
    STREAMS,
    check_name,
    parse_duration,
    parse_kv,
    parse_nnodes,
    parse_nproc,
    parse_ranks_filter,
    parse_signals,
    parse_std,
    pet_name,
)
from flexrun.config.run_parts import (
    DEFAULT_SIGNALS,
    ObserveSettings,
    OutputSettings,
    SpareSettings,
    StdStreams,
    WorkerSpec,
)
from flexrun.config.script_imports import BEYOND, script_imports
from flexrun.config.settings import (
    EXPECTED_WAIT_S,
    LIVE_MAX_RESTARTS,
    LIVE_RESTART_WINDOW_S,
    RendezvousSettings,
    RunConfig,
    StaticJob,
    StoreSettings,
    check_dir_arg,
    default_node_id,
    resolve_mode,
)
from flexrun.config.slurm import apply_slurm_defaults
from flexrun.config.topology import Given, Shape, shape_of
from flexrun.errors import ConfigError

log = logging.getLogger("flexrun.config")
_STATIC_OPTIONS = ("node_rank", "master_addr", "master_port")


def _given(a: Mapping[str, Any], environ: Mapping[str, str], dest: str) -> bool:
    """The user set ``dest``: on the command line, or through its ``PET_*`` variable."""
    return dest in a.get("explicit", ()) or pet_name(dest) in environ


def _std(text: str | None, flag: str) -> StdStreams:
    value = parse_std(text, flag)
    if isinstance(value, dict):
        return StdStreams(default=frozenset(), by_rank=value)
    return StdStreams(default=value)


MAX_COUNT = 1_000_000_000
"""The largest count a flag takes (restarts, ranks, ports, spares): beyond it a number is
a typo, and one past a float's range broke the readers of the events it was logged in."""


def _modules(value: object, flag: str) -> tuple[str, ...]:
    """Comma-separated dotted module names (``transformers,lightning.pytorch``)."""
    names = tuple(n.strip() for n in str(value or "").split(",") if n.strip())
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ConfigError(f"{flag} {name!r}: not a module name (comma-separated a.b.c)")
    return names


def _int(value: object, flag: str, *, low: int = 0) -> int:
    text = str(value).strip()
    if len(text) > 20:
        raise ConfigError(f"{flag} {text[:24]!r}...: expected an integer of at most 20 digits")
    try:
        number = int(text)
    except ValueError:
        raise ConfigError(f"{flag} {value!r}: expected an integer") from None
    if number < low:
        raise ConfigError(f"{flag} {number}: must be {low} or more")
    if number > MAX_COUNT:
        raise ConfigError(f"{flag} {number}: must be at most {MAX_COUNT}")
    return number


def _port_or_none(raw: object, flag: str) -> int | None:
    if raw in (None, ""):
        return None
    port = _int(raw, flag)
    if not 0 <= port < 65536:
        raise ConfigError(f"{flag} {port}: out of range 0-65535")
    return port


def _stop_grace(a: Mapping[str, Any], environ: Mapping[str, str]) -> float:
    """``--shutdown-timeout``/``--stop-grace`` (same setting; CLI or PET_*) >
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` > 30 s (torchrun's order)."""
    shutdown, grace = a.get("shutdown_timeout"), a.get("stop_grace")
    values = {}
    if shutdown not in (None, ""):
        values["--shutdown-timeout"] = parse_duration(shutdown, "--shutdown-timeout")
    if grace not in (None, ""):
        values["--stop-grace"] = parse_duration(grace, "--stop-grace")
    if len(set(values.values())) > 1:
        raise ConfigError(
            "--shutdown-timeout and --stop-grace are the same setting (seconds between SIGTERM "
            "and SIGKILL); give one"
        )
    if values:
        return next(iter(values.values()))
    if "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in environ:
        return parse_duration(
            environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"], "TORCH_ELASTIC_SHUTDOWN_TIMEOUT="
        )
    return 30.0


def _backend(raw: object) -> str:
    backend = str(raw or "static").strip().lower()
    if backend in ALIASES:
        name, note = ALIASES[backend]
        log.info("%s", note)
        return name
    if backend not in BACKENDS:
        refusal = plugins.rendezvous_handler_refusal(backend)
        names = ", ".join((*BACKENDS, *ALIASES))
        raise ConfigError(refusal or f"--rdzv-backend {raw!r} is unknown; choose one of {names}")
    return backend


def _shape(a: Mapping[str, Any], environ: Mapping[str, str], is_host: bool | None) -> Shape:
    nnodes_text = str(a["nnodes"])
    master_port = a.get("master_port")
    return shape_of(
        Given(
            backend=_backend(a["rdzv_backend"]),
            backend_given=_given(a, environ, "rdzv_backend"),
            endpoint=str(a["rdzv_endpoint"] or "").strip(),
            standalone=bool(a["standalone"]),
            nnodes=parse_nnodes(nnodes_text),
            nnodes_text=nnodes_text,
            node_rank=_int(a.get("node_rank") or 0, "--node-rank"),
            master_addr=str(a.get("master_addr") or "127.0.0.1").strip(),
            master_port=None if master_port in (None, "") else _int(master_port, "--master-port"),
            static_given=tuple(
                d.replace("_", "-") for d in _STATIC_OPTIONS if _given(a, environ, d)
            ),
            is_host=is_host,
        )
    )


def _run_id(a: Mapping[str, Any], shape: Shape) -> str:
    raw = str(a.get("rdzv_id") or "").strip()
    one_host = not shape.endpoints and shape.static_rank is None
    if a["standalone"] and not a.get("rdzv_id_given"):
        # torchrun: a fresh id for every standalone run (its --rdzv-id is ignored there).
        return f"standalone-{uuid.uuid4().hex[:8]}"
    if one_host and raw in ("", "none") and not a.get("rdzv_id_given"):
        return f"local-{uuid.uuid4().hex[:8]}"
    run_id = raw or "none"
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", run_id):
        raise ConfigError(f"--rdzv-id {run_id!r}: use letters, digits, '.', '_' or '-'")
    return check_name(run_id, "--rdzv-id")


def _node_id(a: Mapping[str, Any]) -> str:
    given = a.get("node_id")
    return default_node_id() if given is None else check_name(str(given), "--node-id")


def build_run_config(ns: object, environ: Mapping[str, str]) -> RunConfig:
    """Build and validate a RunConfig from parsed ``flexrun run`` arguments.

    Raises:
        ConfigError: any bad value, with the flag and the fix in its message.
    """
    a: dict[str, Any] = {k: v for k, v in vars(ns).items() if k != "environ"}
    apply_slurm_defaults(a, environ)  # (below the command line and PET_*)
    a["rdzv_id_given"] = _given(a, environ, "rdzv_id")
    raw_conf, secret, password = store_credentials(parse_kv(a["rdzv_conf"] or ""), environ)
    shape = _shape(a, environ, None)
    conf = backend_named(shape.backend).parse_conf(raw_conf, max_nodes=shape.max_nodes)
    if conf.is_host is not None:
        shape = _shape(a, environ, conf.is_host)
    for line in conf.warnings:
        log.warning("%s", line)
    for line in conf.notes:
        log.info("%s", line)
    static = None  # (a static job's one store is at its master: the given endpoint)
    if shape.static_rank is not None:
        host, port = shape.endpoints[0]
        static = StaticJob(
            nnodes=shape.max_nodes, node_rank=shape.static_rank, master_addr=host, master_port=port
        )
    nproc = parse_nproc(a["nproc_per_node"])
    run_path = bool(a.get("run_path"))
    module = bool(a["module"]) and not run_path
    no_python = bool(a["no_python"]) and not run_path
    mode = resolve_mode(str(a["mode"]), a["training_script"], module=module or no_python)
    max_restarts = _int(a["max_restarts"], "--max-restarts")
    if mode == "live" and not _given(a, environ, "max_restarts"):
        max_restarts = LIVE_MAX_RESTARTS  # (live mode exists to survive failures)
    rdzv = RendezvousSettings(
        min_nodes=shape.min_nodes,
        max_nodes=shape.max_nodes,
        last_call_s=conf.last_call_s,
        join_timeout_s=conf.join_timeout_s,
        expected_nodes=int(a.get("expected_nodes") or 0),
        # (well inside the join timeout: every node, followers too, must see the first
        # round before theirs runs out, or a short --rdzv-conf join_timeout would end a
        # job that had its MIN nodes while it waited for a task that never started)
        expected_wait_s=min(EXPECTED_WAIT_S, conf.join_timeout_s / 4),
        heartbeat_interval_s=conf.heartbeat_interval_s,
        heartbeat_timeout_s=conf.heartbeat_timeout_s,
        max_restarts=max_restarts,
        restart_window_s=LIVE_RESTART_WINDOW_S if mode == "live" else 0.0,
        static=static is not None,
        crash_loop_restarts=_int(a["crash_loop_restarts"], "--crash-loop-restarts"),
    )
    store = StoreSettings(
        backend=shape.backend,
        endpoints=shape.endpoints,
        host_store=shape.host_store,
        connect_timeout_s=conf.connect_timeout_s,
        op_timeout_s=conf.read_timeout_s,
        conf=dict(conf.backend_conf),
        secret=secret,
        password=password,
    )
    run_id = _run_id(a, shape)
    run_dir = Path(a["run_dir"]) if a.get("run_dir") else Path("flexrun-runs") / run_id
    check_dir_arg(run_dir.absolute(), "--run-dir")
    log_dir = Path(a["log_dir"]).absolute() if a.get("log_dir") else None
    if log_dir is not None:
        check_dir_arg(log_dir, "--log-dir")
    if bool(a.get("standalone")) and secret is None:
        # (Live workers sign too: the agent gives them the secret as a file,
        # FLEXRUN_JOB_SECRET_FILE, read by flexrun.store.factory.connect_from_env.)
        store = replace(store, secret=generated_secret())
    accelerate = (
        accelerate_env(
            a["accelerate_config"], environ.get("PYTHON_EXEC") or sys.executable, environ
        )
        if a.get("accelerate_config")
        else {}
    )
    shards = _int(a.get("live_shards") or 1, "--live-shards", low=1)
    # A spare is an interpreter with torch imported: the defaults give a script that imports
    # only the standard library no restart pool of its own (a node's `flexrun spares` are
    # warm already), and start its first workers cold.
    imports = BEYOND if module or no_python else script_imports(a["training_script"])
    spares_raw = a["warm_spares"]
    if spares_raw not in (None, ""):
        spares = _int(spares_raw, "--warm-spares")
    elif mode == "live":
        spares = shards
    else:
        spares = nproc if imports.anywhere or a.get("spares_dir") else 0
    redirects, tee = _std(a["redirects"], "--redirects"), _std(a["tee"], "--tee")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if a.get("virtual_local_rank") and visible is not None and nproc > len(visible.split(",")):
        raise ConfigError(
            f"--virtual-local-rank: {nproc} workers but CUDA_VISIBLE_DEVICES={visible} names "
            f"{len(visible.split(','))} devices (worker N gets the N-th)"
        )
    advertised = netaddr.choose_advertised(
        shape.toward, shape.toward_port, explicit=(a.get("local_addr") or None)
    )
    numa_mode = a.get("numa_binding")
    logs_specs = a.get("logs_specs")
    if logs_specs:
        plugins.logs_specs_entry(logs_specs)
    monitor = parse_duration(a["monitor_interval"], "--monitor-interval")
    signals = parse_signals(a.get("signals_to_handle") or ",".join(DEFAULT_SIGNALS))
    return RunConfig(
        worker=WorkerSpec(
            entrypoint=a["training_script"],
            args=tuple(a["training_script_args"]),
            module=module,
            no_python=no_python,
            nproc_per_node=nproc,
            role=check_name(str(a["role"]), "--role"),
            # torchrun accepts 0 (check as often as possible): every 10 ms here.
            monitor_interval_s=max(monitor, 0.01),
            stop_grace_s=_stop_grace(a, environ),
            signals_to_handle=signals,
            start_method=str(a.get("start_method") or "spawn"),
            run_path=run_path,
            python_exec=environ.get("PYTHON_EXEC") or sys.executable,
            virtual_local_rank=bool(a.get("virtual_local_rank")),
            slurm_task=a.get("slurm_task") if nproc == 1 else None,
            numa_binding=numa_mode or None,
            numa_cpus=numa.cpus_per_local_rank(numa_mode, nproc) if numa_mode else (),
            # torchrun exports it to its own environment, so every worker inherits it.
            # (--accelerate-config: what `accelerate launch` would export, over the caller's.)
            environ={**environ, **accelerate, "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(signals)},
        ),
        output=OutputSettings(
            run_dir=run_dir.absolute(),
            log_dir=log_dir,
            console_streams=(STREAMS - redirects.default) | tee.default,
            redirects=redirects,
            tee=tee,
            local_ranks_filter=parse_ranks_filter(a.get("local_ranks_filter")),
            duplicate_stdout_filters=tuple(a.get("duplicate_stdout_filters") or ()),
            duplicate_stderr_filters=tuple(a.get("duplicate_stderr_filters") or ()),
            # torch 2.15's --log-line-prefix-template wins over the variable (torch's order).
            log_line_prefix_template=(
                a.get("log_line_prefix_template")
                or environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
                or None
            ),
            logs_specs=logs_specs or None,
            event_log_handler=plugins.check_event_log_handler(
                str(a.get("event_log_handler") or "null")
            ),
            launcher_error_file=(
                Path(environ["TORCHELASTIC_ERROR_FILE"])
                if environ.get("TORCHELASTIC_ERROR_FILE")
                else None
            ),
        ),
        observe=ObserveSettings(
            metrics_port=_port_or_none(a.get("metrics_port"), "--metrics-port"),
            metrics_host=str(a.get("metrics_host") or "127.0.0.1"),
            resource_interval_s=parse_duration(a["resource_interval"], "--resource-interval"),
        ),
        spares=SpareSettings(
            warm_spares=spares,
            spares_dir=Path(a["spares_dir"]).absolute() if a.get("spares_dir") else None,
            spare_preload=_modules(a.get("spare_preload"), "--spare-preload"),
            first_from_pool=imports.at_start,
        ),
        run_id=run_id,
        node_id=_node_id(a),
        local_addr=advertised.addr,
        socket_ifname=advertised.ifname,
        static=static,
        store=store,
        rendezvous=rdzv,
        mode=mode,
        live_shards=shards,
        hang_timeout_s=parse_duration(a["hang_timeout"], "--hang-timeout"),
    )
