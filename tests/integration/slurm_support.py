"""A real Slurm on this machine, for the tests: munged, a slurmctld and compute hosts, each
host in its own network and UTS namespace (own address, host name and ``/etc/hosts``).

Everything is created per fixture with unique names (namespaces, temporary directory, munge
socket), so parallel test processes do not meet, and everything is removed at teardown:
daemons killed by pid, namespaces and their ``/etc/netns`` files deleted. ``slurm_cluster``
skips, saying why, only where the Slurm or munge binaries are missing or namespaces cannot be
created (no root).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BINARIES = (
    "slurmctld",
    "slurmd",
    "srun",
    "sbatch",
    "scontrol",
    "munged",
    "mungekey",
    "runuser",
    "ip",
    "nsenter",
    "unshare",
)
SUBNET = "10.79.0"
CTL_ADDR = f"{SUBNET}.1"

_CONF = """\
ClusterName=fx{suffix}
SlurmctldHost=ctl({ctl_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long before it starts again (default 120 s): the
# credential of its killed run must expire first, or slurmd refuses the new launch of the
# same job id ("credential revoked"; forcing starttime=now raced with it).
AuthInfo=socket={munge_socket},cred_expire=20
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdTimeout=20
SlurmctldTimeout=30
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=600
JobRequeue=1
RequeueExit=200,201
SchedulerParameters=sched_interval=1
StateSaveLocation={tmp}/ctld-state
SlurmdSpoolDir={tmp}/spool-%n
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd-%n.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
{nodes}
PartitionName=all Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


def missing() -> str | None:
    """Why a Slurm cluster cannot be made here, or None."""
    gone = [b for b in BINARIES if shutil.which(b) is None]
    if gone:
        return f"Slurm/munge not installed (missing {', '.join(gone)}; apt: slurmctld slurmd slurm-client munge)"
    if os.geteuid() != 0:
        return "creating network namespaces for the Slurm hosts needs root"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (the munge package creates it)"
    return None


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True, timeout=30)


@dataclass
class SlurmCluster:
    """One Slurm controller and its compute hosts ``n1``, ``n2`` ... on this machine."""

    tmp: Path
    ctl_ns: str
    node_ns: dict[str, str]
    conf: Path
    env: dict[str, str]
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    # -- running things ----------------------------------------------------------------------
    def client(
        self, args: Sequence[str], *, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (sbatch, scontrol, ...) in the controller's namespace."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.ctl_ns, *args],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.tmp,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: {done.returncode}\n{done.stdout}{done.stderr}")
        return done

    def in_host(self, name: str) -> list[str]:
        """The command prefix that runs something as if on host ``name``."""
        ns = self.ctl_ns if name == "ctl" else self.node_ns[name]
        return [
            "nsenter",
            f"--net=/run/netns/{ns}",
            "unshare",
            "--uts",
            "--mount",
            "sh",
            "-c",
            f'mount --bind /etc/netns/{ns}/hosts /etc/hosts && hostname {name} && exec "$@"',
            "sh",
        ]

    def sbatch(self, script: str, *args: str) -> str:
        """Submit ``script`` (its text); the job id."""
        path = self.tmp / f"job-{uuid.uuid4().hex[:6]}.sh"
        path.write_text(script)
        out = self.client(["sbatch", "--parsable", *args, str(path)]).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields."""
        out = self.client(["scontrol", "-o", "show", "job", job_id]).stdout
        fields = {}
        for item in out.split():
            key, _, value = item.partition("=")
            fields[key] = value
        return fields

    def wait_job(
        self, job_id: str, timeout: float, *, states: tuple[str, ...] = ()
    ) -> dict[str, str]:
        """Wait until the job reaches one of ``states`` (default: any final state)."""
        final = states or (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
        )
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in final:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} still {info.get('JobState')} after {timeout}s:\n{self.logs()}"
                )
            time.sleep(0.5)

    def kill_slurmd(self, name: str) -> None:
        """SIGKILL host ``name``'s slurmd and everything in its namespace (a lost node)."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.node_ns[name]], capture_output=True, text=True, check=False
        ).stdout
        for pid in (int(p) for p in out.split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def kill_matching(self, needles: Sequence[str]) -> list[int]:
        """SIGKILL the processes on the compute hosts whose command line holds one of
        ``needles`` (never an ``srun`` or a shell); their pids."""
        killed = []
        for ns in self.node_ns.values():
            out = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
            ).stdout
            for pid in (int(p) for p in out.split()):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                line = b" ".join(argv).decode(errors="replace")
                if Path(argv[0].decode(errors="replace")).name in ("srun", "sh", "bash"):
                    continue
                if any(n in line for n in needles):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
        return killed

    def host_of(self, pid: int) -> str | None:
        """The compute host process ``pid`` runs on (None: gone, or on none of them)."""
        for name, ns in self.node_ns.items():
            out = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
            ).stdout
            if str(pid) in out.split():
                return name
        return None

    def logs(self) -> str:
        parts = []
        for log in sorted(self.tmp.glob("*.log")):
            parts.append(f"--- {log.name}\n" + log.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    # -- life --------------------------------------------------------------------------------
    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            done = self.client(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
            if (
                done.returncode == 0
                and len(states) == len(self.node_ns)
                and all(s == "idle" for s in states.values())
            ):
                return
            for name, p in self.daemons.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited {p.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Slurm nodes not idle after {timeout}s: {states}\n{self.logs()}"
                )
            time.sleep(0.3)

    def stop(self) -> None:
        for p in reversed(list(self.daemons.values())):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(list(self.daemons.values())):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for ns in (*self.node_ns.values(), self.ctl_ns):
            # Whatever a job left in a host (its tasks): gone with the host.
            out = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
            ).stdout
            for pid in (int(p) for p in out.split()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def slurm_cluster(nodes: int = 2, cpus: int = 2) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and ``nodes`` slurmds; yield the cluster; remove everything."""
    why = missing()
    if why:
        pytest.skip(why)
    suffix = f"{os.getpid() % 100000}{uuid.uuid4().hex[:4]}"
    # Under /tmp, not pytest's tmp_path: munged runs as its own user and must reach its socket.
    tmp = Path(tempfile.mkdtemp(prefix=f"fxslurm{suffix}-"))
    tmp.chmod(0o755)
    ctl_ns = f"fxs{suffix}c"
    names = [f"n{i + 1}" for i in range(nodes)]
    node_ns = {n: f"fxs{suffix}{n}" for n in names}
    created: list[str] = []
    munged: subprocess.Popen[bytes] | None = None
    cluster: SlurmCluster | None = None
    try:
        try:
            _run("ip", "netns", "add", ctl_ns)
        except (subprocess.CalledProcessError, OSError) as exc:
            pytest.skip(f"cannot create network namespaces here: {exc}")
        created.append(ctl_ns)
        _run("ip", "-n", ctl_ns, "link", "set", "lo", "up")
        _run("ip", "-n", ctl_ns, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", ctl_ns, "addr", "add", f"{CTL_ADDR}/24", "dev", "br0")
        _run("ip", "-n", ctl_ns, "link", "set", "br0", "up")
        hosts = [f"{CTL_ADDR} ctl", "127.0.0.1 localhost"]
        for i, name in enumerate(names):
            ns = node_ns[name]
            _run("ip", "netns", "add", ns)
            created.append(ns)
            addr = f"{SUBNET}.{i + 2}"
            hosts.append(f"{addr} {name}")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run(
                "ip",
                "-n",
                ctl_ns,
                "link",
                "add",
                f"v{name}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _run("ip", "-n", ctl_ns, "link", "set", f"v{name}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
        for ns in created:
            d = Path("/etc/netns") / ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("\n".join(hosts) + "\n")
        # munge: its own socket, pid and seed files in this cluster's directory.
        mdir = tmp / "munge"
        mdir.mkdir()
        user = pwd.getpwnam("munge")
        os.chown(mdir, user.pw_uid, user.pw_gid)
        mdir.chmod(0o755)
        socket = mdir / "munge.socket"
        # The cluster's own key (not /etc/munge's): nothing outside the test is needed.
        key = mdir / "munge.key"
        _run("mungekey", "--create", "--force", f"--keyfile={key}")
        os.chown(key, user.pw_uid, user.pw_gid)
        key.chmod(0o400)
        munged = subprocess.Popen(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                "munged",
                "-F",
                f"--socket={socket}",
                f"--key-file={key}",
                f"--pid-file={mdir}/munged.pid",
                f"--seed-file={mdir}/munged.seed",
                f"--log-file={mdir}/munged.log",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp / "munged.err").open("wb"),
            start_new_session=True,
        )
        deadline = time.monotonic() + 20
        while not socket.exists():
            if munged.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {(tmp / 'munged.err').read_text()}")
            time.sleep(0.1)
        node_lines = "\n".join(
            f"NodeName={n} NodeAddr={SUBNET}.{i + 2} NodeHostname={n} CPUs={cpus} RealMemory=4000"
            for i, n in enumerate(names)
        )
        conf = tmp / "slurm.conf"
        conf.write_text(
            _CONF.format(
                suffix=suffix,
                ctl_addr=CTL_ADDR,
                munge_socket=socket,
                tmp=tmp,
                nodes=node_lines,
                names=",".join(names),
            )
        )
        (tmp / "ctld-state").mkdir()
        env = dict(os.environ, SLURM_CONF=str(conf))
        for var in [k for k in env if k.startswith(("SLURM_", "PET_"))]:
            if var != "SLURM_CONF":
                del env[var]
        cluster = SlurmCluster(tmp=tmp, ctl_ns=ctl_ns, node_ns=node_ns, conf=conf, env=env)
        cluster.daemons["munged"] = munged
        for name, cmd in [
            ("slurmctld", [*cluster.in_host("ctl"), "slurmctld", "-D", "-i", "-f", str(conf)]),
            *[
                (f"slurmd-{n}", [*cluster.in_host(n), "slurmd", "-D", "-f", str(conf), "-N", n])
                for n in names
            ],
        ]:
            cluster.daemons[name] = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=(tmp / f"{name}.err").open("wb"),
                start_new_session=True,
            )
        cluster._wait_idle(60)
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()
        elif munged is not None and munged.poll() is None:
            os.killpg(munged.pid, signal.SIGTERM)
            munged.wait(timeout=10)
        for ns in reversed(created):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        if os.environ.get("FLEXRUN_KEEP_SLURM_DIR"):
            print(f"Slurm cluster directory kept: {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
