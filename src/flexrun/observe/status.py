"""``flexrun status``: what a running job looks like in its store, read-only.

Owns reading a job's rendezvous state (round, members, registered nodes, keep-alives)
into a :class:`JobStatus` and rendering it as a table (rich) or JSON. It never writes to
the store and never joins the job. It does not decide anything about membership
(``flexrun.rendezvous`` does).

Heartbeat age. Keep-alive keys carry no timestamp (the tcp store judges freshness by each
reader's own clock, which needs no clock agreement between hosts), so status watches the
keep-alives for a short window (``observe_s``, a little over one heartbeat interval) and
reports, per node, the time since its keep-alive last changed: exact when it changed in
the window, a lower bound (``heartbeat_exact: false``) when it did not.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import ConfigError, RendezvousError
from flexrun.rendezvous.state import Keys, MasterRecord, NodeRecord, RoundRecord, with_loader
from flexrun.store.api import Store
from flexrun.store.signed import MAGIC, is_signed


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """A node registered with the job, member of the current round or waiting."""

    node_id: str
    addr: str
    nproc: int
    pid: int = 0
    group_rank: int | None = None
    """Position in the current round; None for a waiting node."""
    ranks: tuple[int, int] | None = None
    """First and last global rank of its workers in the current round."""
    heartbeat: bool = False
    """Its keep-alive key is present."""
    heartbeat_age_s: float | None = None
    heartbeat_exact: bool = False
    """The keep-alive changed while status watched (else the age is a lower bound)."""
    registered: bool = True
    """Its node record exists (a member whose record is gone has left or been lost)."""


@dataclass(frozen=True, slots=True)
class JobStatus:
    run_id: str
    round: int | None
    state: str
    reason: str = ""
    restarts: int = 0
    world_size: int = 0
    master: str | None = None
    members: tuple[NodeStatus, ...] = ()
    waiting: tuple[NodeStatus, ...] = ()
    root_cause: dict[str, Any] = field(default_factory=dict)
    observed_s: float = 0.0
    skipped_records: int = 0
    """Node records in the job's keys that did not decode (damaged, or not flexrun's),
    left out of the table."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for group in ("members", "waiting"):
            for n in d[group]:
                if n["ranks"] is not None:
                    n["ranks"] = list(n["ranks"])
        return d


def known_run_ids(store: Store) -> list[str]:
    """Job ids that have state in this store (for a helpful 'not found' message)."""
    ids = set()
    for key in store.get_prefix("flexrun/"):
        parts = key.split("/")
        if len(parts) > 2 and parts[2] in ("s", "hb"):
            ids.add(parts[1])
    return sorted(ids)


def read_status(
    store: Store, run_id: str, *, observe_s: float = 1.2, clock: Clock = SYSTEM_CLOCK
) -> JobStatus:
    """Read job ``run_id``'s state, watching keep-alives for ``observe_s`` seconds.

    Raises:
        ConfigError: the store holds no job with this id (message lists the ones it has).
        StoreUnavailable: the store cannot be reached.
        RendezvousError: a record is corrupt or from another flexrun version.
    """
    keys = Keys(run_id)
    hb_changed: dict[str, float] = {}
    t0 = clock.monotonic()
    first = _heartbeats(store, keys)
    last = first
    deadline = t0 + max(observe_s, 0.0)
    while clock.monotonic() < deadline:
        clock.sleep(min(0.1, max(deadline - clock.monotonic(), 0.0)))
        now_hb = _heartbeats(store, keys)
        now = clock.monotonic()
        for node, rev in now_hb.items():
            if last.get(node) != rev:
                hb_changed[node] = now
        last = now_hb
    end = clock.monotonic()
    observed = end - t0

    round_entry = store.get(keys.round)
    node_entries = store.get_prefix(keys.nodes)
    if round_entry is None and not node_entries and not last:
        ids = known_run_ids(store)
        where = f"; jobs in this store: {', '.join(ids)}" if ids else "; the store holds no jobs"
        raise ConfigError(f"--rdzv-id {run_id!r}: no such job in the store{where}")
    if round_entry is not None and round_entry.value.startswith(MAGIC) and not is_signed(store):
        raise ConfigError(
            f"job {run_id!r} authenticates its store records: give status the job's secret "
            "(--rdzv-conf secret_file=PATH or FLEXRUN_JOB_SECRET_FILE)"
        )
    rnd = (
        with_loader(store, keys, RoundRecord.decode(round_entry.value))
        if round_entry is not None
        else None
    )  # (the member list is read from its chunks: status is the one reader that needs it)
    records: dict[str, NodeRecord] = {}
    skipped = 0
    for entry in node_entries.values():
        try:
            rec = NodeRecord.decode(entry.value)
        except RendezvousError:
            skipped += 1  # one bad record must not hide the job's state
            continue
        records[rec.node_id] = rec

    def node_status(node_id: str, addr: str, nproc: int, **kw: Any) -> NodeStatus:
        present = node_id in last
        changed = hb_changed.get(node_id)
        if not present:
            age, exact = None, False
        elif changed is not None:
            age, exact = end - changed, True
        else:
            age, exact = observed, False
        rec = records.get(node_id)
        return NodeStatus(
            node_id=node_id,
            addr=addr,
            nproc=nproc,
            pid=rec.pid if rec is not None else 0,
            heartbeat=present,
            heartbeat_age_s=None if age is None else round(age, 3),
            heartbeat_exact=exact,
            registered=rec is not None,
            **kw,
        )

    members: list[NodeStatus] = []
    master = None
    if rnd is not None:
        base = 0
        for i, m in enumerate(rnd.members):
            members.append(
                node_status(
                    m.node_id, m.addr, m.nproc, group_rank=i, ranks=(base, base + m.nproc - 1)
                )
            )
            base += m.nproc
        master_entry = store.get(keys.master(rnd.number))
        if master_entry is not None:
            try:
                mr = MasterRecord.decode(master_entry.value)
                master = f"{mr.addr}:{mr.port}"
            except RendezvousError:
                master = None
    in_round = set(rnd.member_ids) if rnd is not None else set()
    waiting = [
        node_status(r.node_id, r.addr, r.nproc)
        for node_id, r in sorted(records.items())
        if node_id not in in_round
    ]
    return JobStatus(
        run_id=run_id,
        round=rnd.number if rnd is not None else None,
        state=rnd.state if rnd is not None else "forming",
        reason=rnd.reason if rnd is not None else "",
        restarts=rnd.restarts if rnd is not None else 0,
        world_size=rnd.world_size() if rnd is not None else 0,
        master=master,
        members=tuple(members),
        waiting=tuple(waiting),
        root_cause=rnd.root_cause.to_dict() if rnd is not None and rnd.root_cause else {},
        observed_s=round(observed, 3),
        skipped_records=skipped,
    )


def _heartbeats(store: Store, keys: Keys) -> dict[str, int]:
    return {
        k[len(keys.heartbeats) :]: e.revision for k, e in store.get_prefix(keys.heartbeats).items()
    }


def status_json(status: JobStatus) -> str:
    return json.dumps(status.to_json(), indent=2, sort_keys=True)


def _age(n: NodeStatus) -> str:
    if not n.heartbeat or n.heartbeat_age_s is None:
        return "[red]missing[/red]"
    text = f"{n.heartbeat_age_s:.1f}s"
    return text if n.heartbeat_exact else f">{text}"


def render_table(status: JobStatus) -> Any:
    """A rich renderable: a header line and one table of members and waiting nodes."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    state_style = {"running": "green", "pending": "yellow", "failed": "red", "closed": "blue"}
    head = Text.assemble(
        ("job ", "bold"),
        (status.run_id, "bold cyan"),
        "  round ",
        (str(status.round if status.round is not None else "-"), "bold"),
        "  state ",
        (status.state, state_style.get(status.state, "")),
        f"  reason {status.reason or '-'}  world size {status.world_size}"
        f"  restarts {status.restarts}  master {status.master or '-'}",
    )
    table = Table(show_header=True, header_style="bold", expand=False)
    for col in ("node", "addr", "role", "group rank", "ranks", "nproc", "pid", "heartbeat age"):
        table.add_column(col)
    for n in status.members:
        ranks = f"{n.ranks[0]}-{n.ranks[1]}" if n.ranks else "-"
        role = "member" if n.registered else "[red]member (gone)[/red]"
        table.add_row(
            escape(n.node_id),
            escape(n.addr),
            role,
            str(n.group_rank),
            ranks,
            str(n.nproc),
            str(n.pid or "-"),
            _age(n),
        )
    for n in status.waiting:
        table.add_row(
            escape(n.node_id),
            escape(n.addr),
            "[yellow]waiting[/yellow]",
            "-",
            "-",
            str(n.nproc),
            str(n.pid or "-"),
            _age(n),
        )
    parts: list[Any] = [head, table]
    if status.skipped_records:
        parts.append(
            Text(f"{status.skipped_records} node record(s) did not decode", style="yellow")
        )
    if status.root_cause:
        rc = status.root_cause
        parts.append(
            Text(
                f"root cause: rank {rc.get('rank')} on {rc.get('node')}: "
                f"{rc.get('message') or rc.get('signal') or rc.get('exit_code')}",
                style="red",
            )
        )
    return Group(*parts)


def store_settings_from_args(
    backend: str, endpoint: str, conf_text: str = "", *, connect_timeout_s: float = 10.0
) -> Any:
    """A read-only ``StoreSettings`` (never hosts a store) from ``status``-style options.

    Raises:
        ConfigError: bad backend, endpoint or conf.
    """
    from flexrun.config import (
        StoreSettings,
        backend_named,
        parse_endpoint,
        parse_kv,
        process_environ,
        store_credentials,
    )

    backend = backend.strip().lower()
    backend_named(backend)  # (ConfigError: unknown)
    if not endpoint:
        raise ConfigError("--rdzv-endpoint is required: the store's HOST:PORT (the job's value)")
    conf: dict[str, str] = dict(parse_kv(conf_text)) if conf_text else {}
    conf, secret, password = store_credentials(conf, process_environ())
    timeout = connect_timeout_s
    if "connect_timeout" in conf:
        from flexrun.config.parsing import parse_duration

        timeout = parse_duration(
            conf.pop("connect_timeout"), "--rdzv-conf connect_timeout=", positive=True
        )
    return StoreSettings(
        backend=backend,
        endpoints=tuple(parse_endpoint(endpoint)),
        host_store=False,
        connect_timeout_s=timeout,
        conf=conf,
        secret=secret,
        password=password,
    )


def open_status_store(settings: Any) -> Store:
    """Connect to the job's store as a client only (status never hosts a store).

    Raises:
        StoreUnavailable: the endpoint does not answer within the connect timeout.
        ConfigError: the etcd backend is not installed.
    """
    from flexrun.store.factory import connect

    return connect(settings)
