"""The etcd that ``flexrun k8s render`` produces, run for real: TLS, client certificates.

Three etcd members are started with exactly the rendered StatefulSet's command line (its
``$(POD_NAME)``/``$(POD_IP)`` expanded, the Secret's mount point a local directory holding
a job CA and a certificate made as docs/user/kubernetes.md says, and cluster DNS names rewritten to
loopback ports). Then a flexrun store client is built the way a rendered worker builds
it: the node container's ``flexrun run`` command line, parsed by flexrun's own CLI and
config, then ``store.factory.connect``. It connects, writes and reads. A client without a
certificate, one with a certificate from another CA, and a plain-http client are
refused.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_pods import (
    Dns,
    Mounts,
    container_env,
    effective_trainer_container,
    expand,
    torch_plugin_env,
)

from flexrun.errors import StoreUnavailable
from flexrun.k8s.render import render
from flexrun.k8s.spec import parse_job_spec
from flexrun.k8s.spec_types import JOB_SECRET_DIR, JOB_SECRET_KEY
from flexrun.store.etcd import EtcdStore
from flexrun.testing.etcd_server import MISSING, etcd_binary
from flexrun.testing.ports import free_ports

pytestmark = pytest.mark.timeout(180)

JOB = "tls"
SECRET_DIR = "/var/run/flexrun/etcd"


def _require_etcd() -> str:
    binary = etcd_binary()
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{MISSING}; CI must run the etcd tests")
        pytest.skip(MISSING)
    return binary


def _openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)


def _make_ca_and_cert(d: Path, sans: str) -> None:
    """A job CA and one certificate for server and client use (the recipe in docs/user/kubernetes.md)."""
    d.mkdir(parents=True)
    _openssl(d, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", f"/CN={d.name}-ca", "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    (d / "san.cnf").write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl(d, "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={d.name}",
             "-keyout", "tls.key", "-out", "tls.csr")  # fmt: skip
    _openssl(d, "x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "1", "-extfile", "san.cnf", "-out", "tls.crt")  # fmt: skip
    (d / "tls.key").chmod(0o600)


def _rendered() -> list[dict[str, Any]]:
    spec = parse_job_spec(
        {
            "metadata": {"name": JOB},
            "spec": {
                "target": "trainjob",
                "image": "local",
                "module": "flexrun.testing.chaos_workload",
                "nnodes": "1:3",
                "nprocPerNode": 1,
                "store": {"type": "etcd"},
            },
        }
    )
    return render(spec)


class _Members:
    """The rendered StatefulSet's pods, as local etcd processes."""

    def __init__(self, sts: dict[str, Any], root: Path, secret: Path, binary: str) -> None:
        self.sts, self.root, self.secret, self.binary = sts, root, secret, binary
        self.n = int(sts["spec"]["replicas"])
        name, peers = sts["metadata"]["name"], sts["spec"]["serviceName"]
        self.pods = [f"{name}-{i}" for i in range(self.n)]
        ports = free_ports(2 * self.n)
        self.client_ports, self.peer_ports = ports[: self.n], ports[self.n :]
        names: dict[tuple[str, int], tuple[str, int]] = {}
        for i, pod in enumerate(self.pods):
            names[(f"{pod}.{peers}", 2379)] = ("127.0.0.1", self.client_ports[i])
            names[(f"{pod}.{peers}", 2380)] = ("127.0.0.1", self.peer_ports[i])
        self.peer_dns = names
        self.procs: list[subprocess.Popen[bytes]] = []

    def argv(self, i: int) -> list[str]:
        (c,) = self.sts["spec"]["template"]["spec"]["containers"]
        env = container_env(c, {"metadata.name": self.pods[i], "status.podIP": "127.0.0.1"})
        # This pod's own address and ports, then the other members' DNS names.
        own = Dns({
            ("127.0.0.1", 2379): ("127.0.0.1", self.client_ports[i]),
            ("127.0.0.1", 2380): ("127.0.0.1", self.peer_ports[i]),
        })  # fmt: skip
        mounts = Mounts({SECRET_DIR: self.secret, "/var/lib/etcd": self.root / f"data-{i}"})
        argv = []
        for a in c["command"]:
            a = expand(a, env)
            a = own.rewrite(Dns(self.peer_dns).rewrite(a))
            argv.append(mounts.rewrite(a))
        assert argv[0] == "etcd"
        return [self.binary, *argv[1:]]

    def start(self) -> None:
        for i in range(self.n):
            log = open(self.root / f"m{i}.log", "wb")  # noqa: SIM115 (owned by the child)
            try:
                self.procs.append(
                    subprocess.Popen(self.argv(i), stdout=log, stderr=log, start_new_session=True)
                )
            finally:
                log.close()

    def wait_ready(self, ctx: ssl.SSLContext, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                assert p.poll() is None, (self.root / f"m{i}.log").read_text()[-3000:]
            if all(self._leader(port, ctx) for port in self.client_ports):
                return
            time.sleep(0.2)
        raise AssertionError((self.root / "m0.log").read_text()[-3000:])

    @staticmethod
    def _leader(port: int, ctx: ssl.SSLContext) -> bool:
        req = urllib.request.Request(
            f"https://127.0.0.1:{port}/v3/maintenance/status", data=b"{}", method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
                return b'"leader"' in resp.read()
        except OSError:
            return False

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


@pytest.fixture
def members(tmp_path: Path) -> Iterator[tuple[_Members, list[dict[str, Any]], Path]]:
    binary = _require_etcd()
    docs = _rendered()
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    secret = tmp_path / "etcd-secret"
    peers = sts["spec"]["serviceName"]
    try:
        _make_ca_and_cert(secret, f"DNS:{JOB}-etcd,DNS:*.{peers},DNS:localhost,IP:127.0.0.1")
        _make_ca_and_cert(tmp_path / "stranger", "DNS:localhost,IP:127.0.0.1")
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"openssl could not make test certificates: {exc}")
    m = _Members(sts, tmp_path, secret, binary)
    m.start()
    try:
        ctx = ssl.create_default_context(cafile=str(secret / "ca.crt"))
        ctx.load_cert_chain(str(secret / "tls.crt"), str(secret / "tls.key"))
        m.wait_ready(ctx)
        yield m, docs, secret
    finally:
        m.stop()


def test_rendered_etcd_admits_the_rendered_credentials_and_refuses_everyone_else(
    members: tuple[_Members, list[dict[str, Any]], Path], tmp_path: Path
) -> None:
    from flexrun.cli import build_parser
    from flexrun.config import run_config_from_args
    from flexrun.store.factory import connect

    m, docs, secret = members
    kinds = {d["kind"]: d for d in docs if d["kind"] in ("TrainingRuntime", "TrainJob")}
    container = effective_trainer_container(kinds["TrainingRuntime"], kinds["TrainJob"])
    env = {**torch_plugin_env(kinds["TrainingRuntime"], kinds["TrainJob"], 0)}
    env.update(container_env(container, {"status.podIP": "127.0.0.1"}))
    service = Dns({(f"{JOB}-etcd", 2379): ("127.0.0.1", m.client_ports[0])})
    # The job Secret (kubectl create secret ... --from-literal=secret=$(openssl rand -hex 32)),
    # mounted read-only with the rendered volume's mode.
    job_secret = tmp_path / "job-secret"
    job_secret.mkdir()
    (job_secret / JOB_SECRET_KEY).write_text(secrets.token_hex(32))
    (job_secret / JOB_SECRET_KEY).chmod(0o440)
    mounts = Mounts({SECRET_DIR: secret, JOB_SECRET_DIR: job_secret})
    env = {k: mounts.rewrite(v) for k, v in env.items()}
    argv = [mounts.rewrite(service.rewrite(expand(a, env))) for a in container["command"]]
    argv += container["args"]
    assert argv[:2] == ["flexrun", "run"]
    ns = build_parser(env).parse_args(argv[1:])
    config = run_config_from_args(ns, env)
    assert config.store.backend == "etcd-v3"
    assert config.store.conf["cert"] == str(secret / "tls.crt")
    store = connect(config.store)
    try:
        rev = store.put("rehearsal/key", b"value")
        got = store.get("rehearsal/key")
        assert got is not None and got.value == b"value" and got.revision == rev
    finally:
        store.close()

    endpoints = [("127.0.0.1", p) for p in m.client_ports]
    ca = str(secret / "ca.crt")
    stranger = tmp_path / "stranger"
    refused = {
        "no client certificate": {"cacert": ca},
        "a certificate of another CA": {
            "cacert": ca,
            "cert": str(stranger / "tls.crt"),
            "key": str(stranger / "tls.key"),
        },
        "plain http": {},
    }
    for why, kw in refused.items():
        with pytest.raises(StoreUnavailable):
            EtcdStore(endpoints, connect_timeout_s=2, request_timeout_s=2, **kw)
        print(f"refused: {why}")
