"""The ``flexrun run`` options: torchrun 2.13's parser option for option, then flexrun's own.

Owns the option table: every option of ``torch.distributed.run.get_args_parser()`` with the
same spellings (dash and underscore forms, ``-m``, ``-r``, ``-t``), destination, default,
type, choices and ``PET_<DEST>`` fallback (torchrun's ``env``/``check_env`` rules, applied to
the environment mapping the CLI captured), so a torchrun command line parses to the same
values (``tests/unit/test_cli_parser.py`` compares them with torch's own parser). Values
are checked and combined by :mod:`flexrun.config`; nothing here decides.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flexrun.config import DEFAULT_SIGNALS, START_METHODS
from flexrun.config.numa import MODES as NUMA_MODES
from flexrun.config.parsing import env_flag, pet_name
from flexrun.errors import ConfigError

SIGNALS_DEFAULT = ",".join(DEFAULT_SIGNALS)


def comma_separated_list(value: str) -> list[str]:
    """torchrun's list type: ``a,b`` -> [a, b]; ``,,`` is a literal comma."""
    placeholder = "\0"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]


def _mark(namespace: argparse.Namespace, dest: str) -> None:
    explicit = getattr(namespace, "explicit", None)
    if explicit is None:
        explicit = set()
        namespace.explicit = explicit
    explicit.add(dest)


class _Value(argparse.Action):
    """A value option; records that the command line gave it (``namespace.explicit``)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        _mark(namespace, self.dest)


class _Flag(argparse.Action):
    """A flag (torchrun's ``check_env``): True when given; its default comes from ``PET_*``."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
        kw.setdefault("default", False)
        super().__init__(option_strings, dest, nargs=0, const=True, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True)
        _mark(namespace, self.dest)


def _completion_shells() -> list[str]:
    try:
        import shtab
    except ImportError:
        return ["bash", "zsh", "tcsh"]  # torch's list when shtab is not installed
    return list(shtab.SUPPORTED_SHELLS)


class _PrintCompletion(argparse.Action):
    """torch 2.15's ``--print-completion SHELL``: a completion script of ``flexrun``, then exit."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        try:
            import shtab
        except ImportError:
            raise ConfigError(
                f"{option_string} requires the 'shtab' package: pip install shtab"
            ) from None
        root = getattr(parser, "flexrun_root", parser)
        root.prog = "flexrun"
        print(shtab.complete(root, shell=values))
        parser.exit()


class _Options:
    """Adds options to one parser with torchrun's ``PET_*`` defaulting."""

    def __init__(self, parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
        self.p, self.env = parser, env

    def value(
        self,
        *names: str,
        default: Any,
        help: str,
        env: bool = True,
        type: Callable[[str], Any] = str,
        **kw: Any,
    ) -> None:
        dest = _dest(names)
        if env:
            default = self.env.get(pet_name(dest), default)
        self.p.add_argument(
            *_spellings(names),
            dest=dest,
            action=_Value,
            default=default,
            type=type,
            help=help,
            **kw,
        )

    def flag(self, *names: str, help: str) -> None:
        dest = _dest(names)
        self.p.add_argument(
            *_spellings(names), dest=dest, action=_Flag, default=env_flag(self.env, dest), help=help
        )


def _dest(names: Sequence[str]) -> str:
    long = next(n for n in names if n.startswith("--"))
    return long[2:].replace("-", "_")


def _spellings(names: Sequence[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        out.append(n)
        if n.startswith("--") and "-" in n[2:]:
            out.append("--" + n[2:].replace("-", "_"))
    return out


def add_torchrun_options(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """torchrun 2.13's options, in its order (their meaning under flexrun in the help)."""
    o = _Options(p, env)
    o.value("--nnodes", default="1:1", help="number of nodes, N or MIN:MAX")
    o.value("--nproc-per-node", default="1", help="workers per node: N, auto, cpu, gpu or xpu")
    o.value(
        "--rdzv-backend",
        default="static",
        help="c10d/tcp (tcp store), static (fixed N, --master-addr/--master-port), "
        "etcd/etcd-v3 (etcd v2 users: etcd-v2 is taken as etcd)",
    )
    o.value("--rdzv-endpoint", default="", help="store HOST:PORT (etcd: a comma-separated list)")
    o.value("--rdzv-id", default="none", help="job id shared by all nodes")
    o.value(
        "--rdzv-conf",
        default="",
        help="k=v,...: join_timeout, last_call_timeout, heartbeat_interval, heartbeat_timeout, "
        "connect_timeout, is_host, and torchrun's keys (README)",
    )
    o.flag("--standalone", help="one node with a store on a free port")
    o.value(
        "--max-restarts",
        default=0,
        type=int,
        help="failures tolerated before giving up: per job in restart mode (torchrun's "
        "default); per hour in live mode, where an absent flag means 10",
    )
    o.value(
        "--monitor-interval", default=0.1, type=float, help="seconds between worker health checks"
    )
    o.value(
        "--start-method",
        default="spawn",
        choices=START_METHODS,
        help="accepted as torchrun's; flexrun always starts workers as new processes",
    )
    o.value(
        "--event-log-handler",
        default="null",
        help="torch's event handler name: null, dynamic_rendezvous, or console (events to stderr)",
    )
    o.value("--role", default="default", help="worker role name (ROLE_NAME)")
    o.flag("-m", "--module", help="run the entrypoint as a Python module (python -m)")
    o.flag("--no-python", help="run the entrypoint as an executable, not with python")
    o.flag(
        "--run-path",
        help="run the script as torchrun's runpy.run_path does (python SCRIPT); "
        "wins over --module and --no-python",
    )
    o.value("--log-dir", default=None, help="directory for per-rank logs; None: RUN_DIR/logs")
    o.value(
        "-r",
        "--redirects",
        default="0",
        help="streams kept off the console (files only): 0 none, 1 out, 2 err, 3 both; or per "
        "local rank, e.g. 0:1,1:2",
    )
    o.value(
        "-t",
        "--tee",
        default="0",
        help="streams shown on the console and written to files (see --redirects)",
    )
    o.value(
        "--local-ranks-filter",
        default="",
        help="only these local ranks reach the console, e.g. 0,1 (log files keep all)",
    )
    o.value(
        "--duplicate-stdout-filters",
        default=[],
        type=comma_separated_list,
        help="also copy stdout lines containing any of these (a,b; ,, for a comma) to a file",
    )
    o.value(
        "--duplicate-stderr-filters",
        default=[],
        type=comma_separated_list,
        help="the same for stderr",
    )
    o.value("--node-rank", default=0, type=int, help="static job: this node's rank (GROUP_RANK)")
    o.value("--master-addr", default="127.0.0.1", help="static job: node rank 0's address")
    o.value(
        "--master-port",
        default=None,
        type=int,
        help="static job: node rank 0's store port (29500 when a static job needs one)",
    )
    o.value(
        "--local-addr",
        default=None,
        help="address other nodes use to reach this one; None: this node's address on the "
        "route to the rendezvous endpoint (one-host jobs: torchrun's FQDN)",
    )
    o.value(
        "--logs-specs",
        default=None,
        env=False,
        help="a torchrun.logs_specs entry point (a LogsSpecs class) deciding the log files",
    )
    o.value(
        "--numa-binding",
        default=None,
        env=False,
        choices=NUMA_MODES,
        help="bind each worker to the CPUs near its GPU, as torch (needs CUDA devices)",
    )
    o.value(
        "--signals-to-handle",
        default=SIGNALS_DEFAULT,
        help="signals the agent catches and forwards to its workers",
    )
    o.value(
        "--shutdown-timeout",
        default=None,
        type=int,
        help="seconds between SIGTERM and SIGKILL for workers (= --stop-grace; else "
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)",
    )
    o.flag(
        "--virtual-local-rank",
        help="every worker sees LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES = its own device",
    )
    # torch 2.15's additions (a torch 2.13 user may give them too).
    o.value(
        "--log-line-prefix-template",
        default="",
        help="prefix of tee'd console lines (${role_name}, ${local_rank}, ${rank}, ${hostname}); "
        "empty: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, else [${role_name}${local_rank}]:",
    )
    p.add_argument(
        "--print-completion",
        "--print_completion",
        action=_PrintCompletion,
        choices=_completion_shells(),
        help="print a shell completion script for flexrun and exit (needs the shtab package)",
    )


def add_flexrun_options(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """flexrun's own options (each defaults from ``PET_<OPTION>`` too)."""
    o = _Options(p, env)
    o.value(
        "--stop-grace",
        default=None,
        help="seconds between SIGTERM and SIGKILL for workers (= --shutdown-timeout); None: 30",
    )
    o.value("--run-dir", default=None, help="run directory; None: ./flexrun-runs/<rdzv-id>")
    o.value("--node-id", default=None, help="unique id of this node; None: host-pid-random")
    o.value(
        "--mode",
        default="auto",
        help="recovery mode: live (survivors never restart; scripts using flexrun.train.LiveLoop), "
        "restart (torchrun semantics), auto (live if the script uses LiveLoop)",
    )
    o.value(
        "--live-shards",
        default="1",
        help="live mode: workers per replica group (consecutive local ranks; a sharded "
        "model, FSDP2 within a group, replicas across groups). A failed worker takes its "
        "group out; the other groups keep training. 1: every worker a whole replica",
    )
    o.value(
        "--hang-timeout",
        default="60",
        help="the least silence (seconds) after which a rank is hung: its stacks are "
        "captured and it is failed. The limit grows with the rank's learned step time "
        "(10x a step, 2x its longest silence, at most 1800 s) and is max(120, 5x this) "
        "before the first step. Steps are seen with no script change (torch.optim steps, "
        "report_progress, collectives). 0: off",
    )
    o.value(
        "--crash-loop-restarts",
        default="3",
        help="end the job with exit code 86 (do not requeue) when this many restarts in a "
        "row, and the failure before them, completed no training step; 0: off",
    )
    o.value("--metrics-port", default=None, help="serve Prometheus metrics on this port; None: off")
    o.value(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics server binds (0.0.0.0 to be scraped from other hosts)",
    )
    o.value(
        "--resource-interval",
        default="10",
        help="seconds between node resource samples in the event log (0: off)",
    )
    o.value(
        "--warm-spares",
        default=None,
        help="idle interpreters with torch imported, kept to replace workers; None: live mode "
        "1, restart mode nproc-per-node (a restart then skips the cold start); 0: none",
    )
    o.value(
        "--spares-dir",
        default=None,
        help="directory of this node's `flexrun spares`: take warm interpreters from it first; "
        "None: off",
    )
    o.value(
        "--accelerate-config",
        default=None,
        help="an `accelerate config` file: the workers get the ACCELERATE_*/FSDP_* variables "
        "`accelerate launch --config_file FILE` would give them (computed by the workers' "
        "accelerate); None: none",
    )
    o.value(
        "--spare-preload",
        default=None,
        help="comma-separated modules the warm spares import before they are needed (e.g. "
        "transformers,accelerate,lightning), so a restart does not pay for them; imported "
        "by name only, never the script; a module that initialises CUDA on import cannot "
        "be preloaded. None: torch and flexrun only",
    )


def add_run_parser(
    sub: argparse._SubParsersAction, env: Mapping[str, str], func: Callable[..., int]
) -> argparse.ArgumentParser:
    """``flexrun run``: torchrun's options, flexrun's, the script and its arguments."""
    p = sub.add_parser(
        "run",
        help="launch an elastic training job (torchrun's options)",
        description="Start this node's elastic agent. Options take torchrun's names and "
        "default from PET_<OPTION> as torchrun's do.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_torchrun_options(p, env)
    add_flexrun_options(p, env)
    p.add_argument("training_script", help="script (or module, or executable)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=func)
    return p
