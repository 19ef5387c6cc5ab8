"""Configuration: what a validated ``flexrun run`` is, and the one place that reads
``os.environ`` in the launcher.

Owns parsing and validating what users give flexrun (flags, ``PET_*`` variables,
``--rdzv-conf``), with precedence CLI > environment (``PET_*``) > default, as torchrun, into
frozen dataclasses that library code receives (it never reads the environment itself).
Modules: :mod:`.settings` (RunConfig, the store and rendezvous parts), :mod:`.run_parts` (the worker,
output, observe and spares parts), :mod:`.build` (flags -> RunConfig),
:mod:`.parsing` (value syntax), :mod:`.rdzv_conf` (``--rdzv-conf`` keys), :mod:`.topology`
(one host, elastic or static), :mod:`.netaddr` (the address peers reach), :mod:`.numa`,
:mod:`.plugins` (torchrun's entry points), :mod:`.credentials` (job secret, etcd password),
:mod:`.backends` (the store backends' registry: traits, keep-alive defaults). It does not act on the configuration.
"""

from flexrun.config.backends import (
    BACKENDS,
    BACKENDS_ETCD,
    BACKENDS_TCP,
    KEEPALIVES_PER_S,
    Backend,
    backend_named,
    keepalive_defaults,
)
from flexrun.config.credentials import (
    ETCD_PASSWORD_ENV,
    ETCD_PASSWORD_ENV_FILE,
    SECRET_ENV,
    SECRET_ENV_FILE,
    generated_secret,
    read_secret_file,
    store_credentials,
)
from flexrun.config.netaddr import is_this_host
from flexrun.config.parsing import (
    DEFAULT_STORE_PORT,
    env_default,
    env_flag,
    parse_endpoint,
    parse_kv,
    parse_nnodes,
    parse_nproc,
)
from flexrun.config.run_parts import (
    DEFAULT_SIGNALS,
    START_METHODS,
    ObserveSettings,
    OutputSettings,
    SpareSettings,
    StdStreams,
    WorkerSpec,
)
from flexrun.config.settings import (
    RendezvousSettings,
    RunConfig,
    StaticJob,
    StoreSettings,
    default_node_id,
    process_environ,
    resolve_mode,
    run_config_from_args,
)

__all__ = [
    "ETCD_PASSWORD_ENV",
    "ETCD_PASSWORD_ENV_FILE",
    "KEEPALIVES_PER_S",
    "SECRET_ENV",
    "SECRET_ENV_FILE",
    "generated_secret",
    "keepalive_defaults",
    "read_secret_file",
    "store_credentials",
    "BACKENDS",
    "Backend",
    "backend_named",
    "BACKENDS_ETCD",
    "BACKENDS_TCP",
    "DEFAULT_SIGNALS",
    "DEFAULT_STORE_PORT",
    "START_METHODS",
    "ObserveSettings",
    "OutputSettings",
    "RendezvousSettings",
    "RunConfig",
    "StaticJob",
    "StdStreams",
    "SpareSettings",
    "StoreSettings",
    "WorkerSpec",
    "default_node_id",
    "env_default",
    "env_flag",
    "is_this_host",
    "parse_endpoint",
    "parse_kv",
    "parse_nnodes",
    "parse_nproc",
    "process_environ",
    "resolve_mode",
    "run_config_from_args",
]
