"""Configuration: frozen dataclasses, and the one place that reads ``os.environ``.

Owns parsing and validation of what users give flexrun (flags, ``PET_*`` variables,
``--rdzv-conf``), with precedence CLI > environment (``PET_*``) > default. Library code
receives these objects and never reads the environment itself. It does not act on them.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from flexrun.errors import ConfigError

BACKENDS_TCP = ("c10d", "tcp", "static")
BACKENDS_ETCD = ("etcd", "etcd-v3")
BACKENDS = BACKENDS_TCP + BACKENDS_ETCD
DEFAULT_STORE_PORT = 29400


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4). Raises ConfigError on anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
    if not m:
        raise ConfigError(
            f"--nnodes {text!r}: expected N or MIN:MAX with positive integers, e.g. 1:4"
        )
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if lo < 1:
        raise ConfigError(f"--nnodes {text!r}: MIN must be at least 1")
    if lo > hi:
        raise ConfigError(
            f"--nnodes {text!r}: MIN ({lo}) is greater than MAX ({hi}); write MIN:MAX, e.g. {hi}:{lo}"
        )
    return lo, hi


def parse_nproc(text: str, *, cuda_count: int | None = None, cpu_count: int | None = None) -> int:
    """``N``, ``auto``, ``cpu`` or ``gpu`` -> a positive worker count."""
    value = str(text).strip().lower()
    if value == "cpu":
        return cpu_count or os.cpu_count() or 1
    if value in ("gpu", "auto"):
        if cuda_count is None:
            cuda_count = _cuda_count()
        if cuda_count > 0:
            return cuda_count
        if value == "gpu":
            raise ConfigError("--nproc-per-node gpu: no CUDA device is visible on this node")
        return cpu_count or os.cpu_count() or 1
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(
            f"--nproc-per-node {text!r}: expected a positive integer, auto, cpu or gpu"
        )
    return int(value)


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def parse_endpoint(text: str, default_port: int = DEFAULT_STORE_PORT) -> list[tuple[str, int]]:
    """``"host:port[,host2:port2]"`` -> [(host, port), ...]; IPv6 in brackets."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", part)
        if not m:
            raise ConfigError(f"--rdzv-endpoint {text!r}: expected HOST[:PORT][,HOST[:PORT]...]")
        host = m.group(1) or m.group(3)
        port_s = m.group(2) or m.group(4)
        port = int(port_s) if port_s else default_port
        if not 0 < port < 65536:
            raise ConfigError(f"--rdzv-endpoint {text!r}: port {port} is out of range 1-65535")
        out.append((host, port))
    return out


def parse_kv(text: str, what: str = "--rdzv-conf") -> dict[str, str]:
    """``"a=1,b=x"`` -> {"a": "1", "b": "x"}."""
    out: dict[str, str] = {}
    for part in str(text or "").split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{what} {text!r}: expected key=value[,key=value...], got {part!r}")
        out[key.strip()] = value.strip()
    return out


def _conf_float(conf: Mapping[str, str], key: str, default: float) -> float:
    if key not in conf:
        return default
    try:
        value = float(conf[key])
    except ValueError:
        raise ConfigError(
            f"--rdzv-conf {key}={conf[key]!r}: expected a number of seconds"
        ) from None
    if value < 0:
        raise ConfigError(f"--rdzv-conf {key}={conf[key]!r}: must not be negative")
    return value


def _conf_bool(conf: Mapping[str, str], key: str) -> bool | None:
    if key not in conf:
        return None
    value = conf[key].lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"--rdzv-conf {key}={conf[key]!r}: expected true or false")


@dataclass(frozen=True, kw_only=True, slots=True)
class RendezvousSettings:
    """How nodes meet: timing of membership decisions."""

    min_nodes: int = 1
    """Fewest nodes a round may have."""
    max_nodes: int = 1
    """Most nodes a round may have; extra nodes wait as standbys."""
    last_call_s: float = 1.0
    """After MIN nodes are present (and fewer than MAX), wait this long for more before
    closing the round. Short by default: a lone joiner should not wait 30 s."""
    join_timeout_s: float = 600.0
    """How long a node waits for MIN nodes before giving up (exit 2)."""
    heartbeat_interval_s: float = 1.0
    """How often an agent refreshes its keep-alive."""
    heartbeat_timeout_s: float = 5.0
    """A node whose keep-alive is older than this is declared lost."""
    max_restarts: int = 3
    """Failures tolerated per job (membership changes do not count)."""

    def __post_init__(self) -> None:
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise ConfigError(f"nnodes {self.min_nodes}:{self.max_nodes}: need 1 <= MIN <= MAX")
        if self.heartbeat_interval_s <= 0:
            raise ConfigError("heartbeat_interval must be positive")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"heartbeat_timeout ({self.heartbeat_timeout_s:g}s) must exceed "
                f"heartbeat_interval ({self.heartbeat_interval_s:g}s)"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: must be 0 or more")


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreSettings:
    """Which store the rendezvous uses and how to reach it."""

    backend: str = "c10d"
    """One of c10d, tcp, static (embedded tcp store), etcd, etcd-v3."""
    endpoints: tuple[tuple[str, int], ...] = ()
    """Where the store listens; empty with standalone (a free local port is used)."""
    host_store: bool = False
    """Run the tcp store inside this agent (standalone, or the endpoint is this host)."""
    connect_timeout_s: float = 30.0
    """How long to keep trying to reach the store before exit 2."""
    conf: Mapping[str, str] = field(default_factory=dict)
    """Remaining --rdzv-conf options, passed to the backend (e.g. TLS for etcd)."""
    secret: bytes | None = field(default=None, repr=False)
    """The job secret that authenticates every record (see :func:`store_credentials`);
    ``flexrun.store.factory.connect`` then returns a signing store."""
    password: str | None = field(default=None, repr=False)
    """The etcd user's password (``--rdzv-conf user=NAME``), never from the command line."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"--rdzv-backend {self.backend!r} is unknown; choose one of {', '.join(BACKENDS)}"
            )


# -- store credentials (issue 18): one isolated place --------------------------------------
SECRET_ENV_FILE = "FLEXRUN_JOB_SECRET_FILE"
SECRET_ENV = "FLEXRUN_JOB_SECRET"
ETCD_PASSWORD_ENV_FILE = "FLEXRUN_ETCD_PASSWORD_FILE"
ETCD_PASSWORD_ENV = "FLEXRUN_ETCD_PASSWORD"
MIN_SECRET_BYTES = 16


def read_secret_file(path: str, what: str = "job secret") -> bytes:
    """The contents of a secret file, trailing whitespace stripped.

    A file that group or others can read is accepted with a warning (a Kubernetes Secret
    volume is 0644 unless its ``defaultMode`` says otherwise); ``chmod 600`` silences it.

    Raises:
        ConfigError: the file cannot be read or is empty.
    """
    p = Path(path)
    try:
        mode = p.stat().st_mode
        data = p.read_bytes().rstrip()
    except OSError as exc:
        raise ConfigError(f"{what} file {path}: cannot read it ({exc.strerror or exc})") from None
    if not data:
        raise ConfigError(f"{what} file {path} is empty")
    if mode & 0o077:
        import logging

        logging.getLogger("flexrun").warning(
            "%s file %s can be read by other users (mode %o): chmod 600 %s",
            what,
            path,
            mode & 0o777,
            path,
        )
    return data


def store_credentials(
    conf: Mapping[str, str], environ: Mapping[str, str]
) -> tuple[dict[str, str], bytes | None, str | None]:
    """Split the job secret and the etcd password out of ``--rdzv-conf``.

    Returns (the remaining conf, the job secret, the etcd password). Sources, first found
    wins: secret: ``secret_file=PATH`` > ``$FLEXRUN_JOB_SECRET_FILE`` > ``$FLEXRUN_JOB_SECRET``;
    etcd password: ``password_file=PATH`` > ``$FLEXRUN_ETCD_PASSWORD_FILE`` >
    ``$FLEXRUN_ETCD_PASSWORD``. A value on the command line (``secret=``, ``password=``)
    is refused: every user of the machine sees it in ``ps``.

    Raises:
        ConfigError: a value given on the command line, an unreadable or short secret.
    """
    rest = dict(conf)
    for name, instead in (("secret", "secret_file=PATH"), ("password", "password_file=PATH")):
        if name in rest:
            raise ConfigError(
                f"--rdzv-conf {name}=...: a secret on the command line is visible to every user "
                f"in `ps`; use --rdzv-conf {instead} or the environment "
                f"({SECRET_ENV_FILE if name == 'secret' else ETCD_PASSWORD_ENV_FILE})"
            )
    secret: bytes | None = None
    if "secret_file" in rest:
        secret = read_secret_file(rest.pop("secret_file"))
    elif environ.get(SECRET_ENV_FILE):
        secret = read_secret_file(environ[SECRET_ENV_FILE])
    elif environ.get(SECRET_ENV):
        secret = environ[SECRET_ENV].strip().encode()
    if secret is not None and len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the job secret is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
            "(e.g. `openssl rand -hex 32 > secret; chmod 600 secret`)"
        )
    password: str | None = None
    if "password_file" in rest:
        password = read_secret_file(rest.pop("password_file"), "etcd password").decode()
    elif environ.get(ETCD_PASSWORD_ENV_FILE):
        password = read_secret_file(environ[ETCD_PASSWORD_ENV_FILE], "etcd password").decode()
    elif environ.get(ETCD_PASSWORD_ENV):
        password = environ[ETCD_PASSWORD_ENV]
    return rest, secret, password


KEEPALIVES_PER_S = 2000.0
"""The keep-alive writes per second the store is budgeted for at the default interval
(the numbers behind it: ``flexrun.rendezvous.keepalive``)."""


def keepalive_defaults(max_nodes: int) -> tuple[float, float]:
    """(heartbeat_interval_s, heartbeat_timeout_s) by default for up to ``max_nodes``
    nodes: max(1 s, N / 2000 s) and five intervals (1 s / 5 s up to 2000 nodes)."""
    interval = max(1.0, max_nodes / KEEPALIVES_PER_S)
    return interval, 5 * interval


def generated_secret() -> bytes:
    """A fresh random job secret (``--standalone``: one per run)."""
    import secrets

    return secrets.token_hex(32).encode()


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything ``flexrun run`` needs, validated."""

    entrypoint: str
    """Script path, module name (with ``module``) or executable (with ``no_python``)."""
    args: tuple[str, ...] = ()
    """Arguments after the entrypoint."""
    module: bool = False
    no_python: bool = False
    nproc_per_node: int = 1
    run_id: str = "default"
    node_id: str = ""
    """Unique id of this agent (host-pid-random by default)."""
    local_addr: str = "127.0.0.1"
    """Address peers use to reach this node's rank-0 worker (MASTER_ADDR)."""
    role: str = "default"
    run_dir: Path = Path("flexrun-runs/default")
    log_dir: Path | None = None
    console_streams: frozenset[str] = frozenset({"stdout", "stderr"})
    """Which worker streams also go to the agent's console (all go to log files)."""
    monitor_interval_s: float = 0.1
    stop_grace_s: float = 30.0
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    store: StoreSettings = field(default_factory=StoreSettings)
    rendezvous: RendezvousSettings = field(default_factory=RendezvousSettings)
    environ: Mapping[str, str] = field(default_factory=dict)
    """The environment workers inherit (captured by ``from_args``)."""
    mode: str = "restart"
    """``restart`` (torchrun semantics) or ``live`` (survivors never restart)."""
    warm_spares: int = 0
    """Live mode: idle worker processes kept ready (torch imported) to replace a dead one."""
    spares_dir: Path | None = None
    """The node's ``flexrun spares`` directory: spares are taken from it first (None: off)."""
    hang_timeout_s: float = 0.0
    """A rank that reported progress (flexrun.train.report_progress) and then none for this
    long is hung: its stacks are captured and it is treated as failed. 0: off."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (off when None)."""
    resource_interval_s: float = 10.0
    """How often node resources (CPU, memory, disk, network, GPU) go to the event log; 0: never."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node}: must be at least 1")
        if self.monitor_interval_s <= 0:
            raise ConfigError("--monitor-interval must be positive")
        if self.mode not in ("restart", "live"):
            raise ConfigError(f"--mode {self.mode!r}: choose live, restart or auto")
        if self.hang_timeout_s < 0:
            raise ConfigError(
                f"--hang-timeout {self.hang_timeout_s:g}: must be 0 (off) or positive"
            )
        if self.warm_spares < 0:
            raise ConfigError(f"--warm-spares {self.warm_spares}: must be 0 or more")
        if self.mode == "live" and self.store.backend in BACKENDS_ETCD:
            raise ConfigError(
                "--mode live needs the tcp store (--rdzv-backend c10d); etcd serves restart mode"
            )
        if self.stop_grace_s < 0:
            raise ConfigError("--stop-grace must not be negative")
        if not self.module and not self.no_python and not Path(self.entrypoint).is_file():
            raise ConfigError(
                f"training script {self.entrypoint!r} does not exist (or is not a file)"
            )
        if (
            self.no_python
            and shutil.which(self.entrypoint) is None
            and not Path(self.entrypoint).is_file()
        ):
            raise ConfigError(f"--no-python: executable {self.entrypoint!r} not found")


def _streams(text: str | None, flag: str) -> frozenset[str]:
    mapping = {
        "0": frozenset(),
        "1": frozenset({"stdout"}),
        "2": frozenset({"stderr"}),
        "3": frozenset({"stdout", "stderr"}),
    }
    value = (text or "0").strip()
    if ":" in value:
        raise ConfigError(f"{flag} {value!r}: per-rank settings are not supported; use 0-3")
    if value not in mapping:
        raise ConfigError(
            f"{flag} {value!r}: expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"
        )
    return mapping[value]


def default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1", "0.0.0.0")


def is_this_host(host: str) -> bool:
    """True if ``host`` names this machine (as torchrun decides whether to host the store)."""
    if host in _LOCAL_NAMES:
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    try:
        mine = {ai[4][0] for n in names for ai in socket.getaddrinfo(n, None)}
        theirs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(mine & theirs)


def run_config_from_args(ns: object, environ: Mapping[str, str]) -> RunConfig:
    """Build and validate a RunConfig from parsed ``flexrun run`` arguments."""
    a = {k: v for k, v in vars(ns).items() if k != "environ"}
    conf, secret, password = store_credentials(parse_kv(a["rdzv_conf"] or ""), environ)
    min_nodes, max_nodes = parse_nnodes(a["nnodes"])
    backend = str(a["rdzv_backend"]).strip().lower()
    if backend not in BACKENDS:
        raise ConfigError(
            f"--rdzv-backend {a['rdzv_backend']!r} is unknown; choose one of {', '.join(BACKENDS)}"
        )
    standalone = bool(a["standalone"])
    endpoint = a["rdzv_endpoint"] or ""
    if backend == "static" and not endpoint:
        endpoint = f"{a['master_addr']}:{a['master_port']}"
    if standalone:
        if max_nodes != 1 and a["nnodes"] not in ("1", "1:1"):
            raise ConfigError(
                f"--standalone runs one node; drop --nnodes {a['nnodes']} or --standalone"
            )
        min_nodes = max_nodes = 1
        endpoints: tuple[tuple[str, int], ...] = ()
        host_store = True
        backend = "c10d"
    elif not endpoint:
        if max_nodes > 1:
            raise ConfigError(
                "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (e.g. a `flexrun store` on a stable machine)"
            )
        endpoints, host_store = (), True
    else:
        endpoints = tuple(parse_endpoint(endpoint))
        if backend in BACKENDS_TCP and len(endpoints) != 1:
            raise ConfigError(
                f"--rdzv-endpoint {endpoint!r}: the {backend} backend takes one HOST:PORT"
            )
        explicit = _conf_bool(conf, "is_host")
        if backend == "static":
            explicit = int(a["node_rank"] or 0) == 0 if explicit is None else explicit
        host_store = backend in BACKENDS_TCP and (
            explicit if explicit is not None else is_this_host(endpoints[0][0])
        )
    default_interval, _ = keepalive_defaults(max_nodes)
    interval = _conf_float(conf, "heartbeat_interval", default_interval)
    rdzv = RendezvousSettings(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        last_call_s=_conf_float(conf, "last_call_timeout", 1.0),
        join_timeout_s=_conf_float(conf, "join_timeout", 600.0),
        heartbeat_interval_s=interval,
        heartbeat_timeout_s=_conf_float(conf, "heartbeat_timeout", max(5.0, 5 * interval)),
        max_restarts=int(a["max_restarts"]),
    )
    known = {
        "is_host",
        "last_call_timeout",
        "join_timeout",
        "heartbeat_interval",
        "heartbeat_timeout",
        "connect_timeout",
    }
    store = StoreSettings(
        backend=backend,
        endpoints=endpoints,
        host_store=host_store,
        connect_timeout_s=_conf_float(conf, "connect_timeout", 30.0),
        conf={k: v for k, v in conf.items() if k not in known},
        secret=secret,
        password=password,
    )
    run_id = a["rdzv_id"] or ("none" if standalone or not endpoints else "default")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", run_id):
        raise ConfigError(f"--rdzv-id {run_id!r}: use letters, digits, '.', '_' or '-'")
    if standalone and not a["rdzv_id"]:
        run_id = f"standalone-{uuid.uuid4().hex[:8]}"
    run_dir = Path(a["run_dir"]) if a["run_dir"] else Path("flexrun-runs") / run_id
    nproc = parse_nproc(a["nproc_per_node"])
    mode = resolve_mode(
        str(a["mode"]), a["training_script"], module=bool(a["module"]) or bool(a["no_python"])
    )
    if standalone and secret is None and mode != "live":
        store = replace(store, secret=generated_secret())
    if mode == "live" and secret is not None:
        # Live workers open the store themselves (flexrun.train.live_group) and do not sign
        # yet: store.factory.connect_from_env is their signing client, to be wired in.
        raise ConfigError(
            "--mode live with a job secret: live workers cannot authenticate store records "
            "yet; run restart mode, or live mode without FLEXRUN_JOB_SECRET_FILE/secret_file"
        )
    spares_raw = a["warm_spares"]
    try:
        spares = (
            int(spares_raw) if spares_raw not in (None, "") else (1 if mode == "live" else nproc)
        )
    except ValueError:
        raise ConfigError(f"--warm-spares {spares_raw!r}: expected an integer") from None
    console = frozenset({"stdout", "stderr"}) - _streams(a["redirects"], "--redirects")
    return RunConfig(
        entrypoint=a["training_script"],
        args=tuple(a["training_script_args"]),
        module=bool(a["module"]),
        no_python=bool(a["no_python"]),
        nproc_per_node=nproc,
        run_id=run_id,
        node_id=a["node_id"] or default_node_id(),
        local_addr=a["local_addr"] or _default_local_addr(endpoints),
        role=a["role"],
        run_dir=run_dir.absolute(),
        log_dir=Path(a["log_dir"]).absolute() if a["log_dir"] else None,
        console_streams=console | _streams(a["tee"], "--tee"),
        monitor_interval_s=float(a["monitor_interval"]),
        stop_grace_s=float(a["stop_grace"]),
        store=store,
        rendezvous=rdzv,
        environ=dict(environ),
        mode=mode,
        warm_spares=spares,
        spares_dir=Path(a["spares_dir"]).absolute() if a["spares_dir"] else None,
        metrics_port=_port_or_none(a["metrics_port"], "--metrics-port"),
        hang_timeout_s=float(a["hang_timeout"]),
        resource_interval_s=float(a["resource_interval"]),
    )


def _default_local_addr(endpoints: tuple[tuple[str, int], ...]) -> str:
    """Loopback for one-machine jobs; else this host's name, as torchrun does."""
    if not endpoints or endpoints[0][0] in _LOCAL_NAMES or endpoints[0][0].startswith("127."):
        return "127.0.0.1"
    return socket.getfqdn()


def _port_or_none(raw: object, flag: str) -> int | None:
    if raw in (None, ""):
        return None
    try:
        port = int(str(raw))
    except ValueError:
        raise ConfigError(f"{flag} {raw!r}: expected a port number") from None
    if not 0 <= port < 65536:
        raise ConfigError(f"{flag} {port}: out of range 0-65535")
    return port


LIVE_API_MARKERS = ("LiveLoop",)


def resolve_mode(mode: str, script: str, *, module: bool) -> str:
    """``auto`` -> ``live`` when the script uses flexrun.train's loop API, else ``restart``."""
    mode = mode.strip().lower()
    if mode != "auto":
        if mode not in ("live", "restart"):
            raise ConfigError(f"--mode {mode!r}: choose live, restart or auto")
        return mode
    if module:
        return "restart"
    try:
        text = Path(script).read_text(errors="replace")
    except OSError:
        return "restart"
    return "live" if any(m in text for m in LIVE_API_MARKERS) else "restart"


def env_default(environ: Mapping[str, str], option: str, default: str | None) -> str | None:
    """torchrun's rule: option ``--foo-bar`` defaults from ``PET_FOO_BAR``."""
    return environ.get("PET_" + option.upper().replace("-", "_"), default)


def env_flag(environ: Mapping[str, str], option: str) -> bool:
    value = environ.get("PET_" + option.upper().replace("-", "_"), "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def process_environ() -> Mapping[str, str]:
    """The process environment (the only read of ``os.environ`` in the launcher)."""
    return dict(os.environ)
