"""Real etcd servers for tests: one member or a small cluster on loopback.

Owns starting ``etcd`` processes on free loopback ports with their own data directories,
waiting until they serve, killing and restarting members, finding the leader, and
stopping every process it started. It does not install etcd (Debian: ``etcd-server``)
and uses only the standard library, so it works without the ``etcd`` extra.

Raft timings are shortened (50 ms heartbeat, 500 ms election timeout) so a test sees a
new leader within about a second and leases as short as one second.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from flexrun.testing.ports import free_ports

MISSING = (
    "no `etcd` binary on PATH (Debian/Ubuntu: apt-get install etcd-server; or set FLEXRUN_ETCD)"
)


BIND_ATTEMPTS = 3
"""How many sets of ports ``EtcdCluster.start`` tries before a bind failure is raised."""


def etcd_binary() -> str | None:
    """The ``etcd`` executable to use (``$FLEXRUN_ETCD`` first, then ``PATH``), or None."""
    explicit = os.environ.get("FLEXRUN_ETCD")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("etcd")


def _status(
    port: int, timeout_s: float = 1.0, tls: ssl.SSLContext | None = None
) -> dict[str, object] | None:
    scheme = "https" if tls is not None else "http"
    req = urllib.request.Request(
        f"{scheme}://127.0.0.1:{port}/v3/maintenance/status",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=tls) as resp:
            body = json.loads(resp.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None
    return body if isinstance(body, dict) else None


class EtcdCluster:
    """``size`` etcd members on 127.0.0.1; a context manager that always kills them all."""

    def __init__(
        self,
        data_root: Path,
        *,
        size: int = 1,
        binary: str | None = None,
        tls: tuple[Path, Path, Path] | None = None,
        client_cert_auth: bool = True,
    ) -> None:
        """``tls``: (CA, server cert, server key) PEM files; with ``client_cert_auth``
        clients must then present a certificate signed by that CA (``--client-cert-auth``)
        and the same files serve as the client's own for the readiness probe."""
        found = binary or etcd_binary()
        if found is None:
            raise FileNotFoundError(MISSING)
        self.binary = found
        self.size = size
        self.root = Path(data_root)
        self._pick_ports()
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size
        self.tls = tls
        self.client_cert_auth = client_cert_auth
        self._ctx: ssl.SSLContext | None = None
        if tls is not None:
            self._ctx = ssl.create_default_context(cafile=str(tls[0]))
            self._ctx.load_cert_chain(str(tls[1]), str(tls[2]))

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.client_ports]

    @property
    def endpoint_arg(self) -> str:
        """The ``--rdzv-endpoint`` value naming every member."""
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _args(self, i: int) -> list[str]:
        cluster = ",".join(f"m{j}=http://127.0.0.1:{p}" for j, p in enumerate(self.peer_ports))
        scheme = "https" if self.tls is not None else "http"
        client = f"{scheme}://127.0.0.1:{self.client_ports[i]}"
        peer = f"http://127.0.0.1:{self.peer_ports[i]}"
        tls_args: list[str] = []
        if self.tls is not None:
            ca, cert, key = (str(p) for p in self.tls)
            tls_args = [
                "--cert-file",
                cert,
                "--key-file",
                key,
                *(["--trusted-ca-file", ca, "--client-cert-auth"] if self.client_cert_auth else []),
            ]
        return [
            self.binary,
            *tls_args,
            "--name",
            f"m{i}",
            "--data-dir",
            str(self.root / f"m{i}"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            cluster,
            "--initial-cluster-state",
            "new",
            "--initial-cluster-token",
            f"flexrun-test-{self.peer_ports[0]}",
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
        ]

    def start_member(self, i: int) -> None:
        """Start member ``i`` (again, on the same ports and data directory)."""
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / f"m{i}.log", "ab")  # noqa: SIM115 (owned by the child)
        try:
            self.procs[i] = subprocess.Popen(
                self._args(i),
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()

    def _pick_ports(self) -> None:
        ports = free_ports(2 * self.size)
        self.client_ports, self.peer_ports = ports[: self.size], ports[self.size :]

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        """Start every member and wait until each serves the v3 API with a leader.

        A member that finds one of its ports taken (another process bound it after it
        was picked) makes every member start again on new ports, up to
        ``BIND_ATTEMPTS`` times; any other failure is raised at once."""
        attempt = 1
        while True:
            for i in range(self.size):
                self.start_member(i)
            try:
                self.wait_ready(timeout_s)
                return self
            except RuntimeError as err:
                if "address already in use" not in str(err) or attempt >= BIND_ATTEMPTS:
                    raise
            self.stop()
            for i in range(self.size):
                shutil.rmtree(self.root / f"m{i}", ignore_errors=True)
            self._pick_ports()
            attempt += 1

    def wait_ready(self, timeout_s: float = 30.0, members: list[int] | None = None) -> None:
        """Block until the given (default: running) members answer and agree on a leader."""
        deadline = time.monotonic() + timeout_s
        while True:
            todo = (
                members
                if members is not None
                else [i for i, p in enumerate(self.procs) if p is not None]
            )
            for i in todo:
                proc = self.procs[i]
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(
                        f"etcd member m{i} exited ({proc.returncode}): {self.log_tail(i)}"
                    )
            statuses = [_status(self.client_ports[i], tls=self._ctx) for i in todo]
            if all(s is not None and int(str(s.get("leader", 0))) for s in statuses):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"etcd did not become ready in {timeout_s:g}s: {self.log_tail(todo[0])}"
                )
            time.sleep(0.05)

    def leader(self) -> int:
        """Index of the member that is leader now."""
        for i, port in enumerate(self.client_ports):
            if self.procs[i] is None:
                continue
            s = _status(port, tls=self._ctx)
            if s is None:
                continue
            header = s.get("header")
            member_id = header.get("member_id") if isinstance(header, dict) else None
            if member_id is not None and str(member_id) == str(s.get("leader")):
                return i
        raise RuntimeError("no etcd member reports itself leader")

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` and reap it."""
        proc = self.procs[i]
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self.procs[i] = None

    def log_tail(self, i: int, chars: int = 2000) -> str:
        path = self.root / f"m{i}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self) -> None:
        """Kill every member this object started; safe to call twice."""
        for i in range(self.size):
            try:
                self.kill(i)
            except Exception:  # noqa: BLE001 (keep killing the others)
                proc = self.procs[i]
                if proc is not None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()

    def __enter__(self) -> EtcdCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


__all__ = ["MISSING", "EtcdCluster", "etcd_binary"]
