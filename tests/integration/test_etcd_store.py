"""The etcd store client against real etcd servers: fail-over, unreachable, auth, TLS (issue #4)."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from flexrun.config import StoreSettings, store_credentials
from flexrun.errors import ConfigError, StoreError, StoreUnavailable
from flexrun.store.etcd import EtcdStore
from flexrun.store.factory import connect
from flexrun.store.signed import SignedStore
from flexrun.testing.etcd_server import MISSING, EtcdCluster, etcd_binary
from flexrun.testing.ports import free_ports

pytestmark = pytest.mark.timeout(120)


def _require_etcd() -> None:
    if etcd_binary() is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{MISSING}; CI must run the etcd tests")
        pytest.skip(MISSING)


@pytest.fixture
def etcd1(tmp_path: Path) -> Iterator[EtcdCluster]:
    _require_etcd()
    with EtcdCluster(tmp_path / "etcd") as cluster:
        yield cluster


def test_a_client_fails_over_when_its_etcd_member_dies_mid_watch(tmp_path: Path) -> None:
    _require_etcd()
    with EtcdCluster(tmp_path / "etcd", size=3) as cluster:
        leader = cluster.leader()
        eps = cluster.endpoints[leader:] + cluster.endpoints[:leader]  # talk to the leader first
        store = EtcdStore(eps, connect_timeout_s=10, request_timeout_s=10)
        try:
            store.put("hb/me", b"1", ttl_s=5)
            since = store.revision()
            result: list[tuple[bool, int]] = []
            waiter = threading.Thread(
                target=lambda: result.append(store.wait_for_change("w/", since, 30))
            )
            waiter.start()
            cluster.kill(leader)
            rev = store.put("w/x", b"after")
            waiter.join(timeout=40)
            assert result and result[0][0], "the watch did not survive its member's death"
            assert store.get("w/x") is not None and store.get("w/x").revision == rev  # type: ignore[union-attr]
            assert "hb/me" in store.get_prefix("hb/")
            ok, _ = store.compare_and_set("w/x", b"cas", expected_revision=rev)
            assert ok
        finally:
            store.close()


def test_a_cluster_whose_picked_port_was_taken_starts_on_new_ports(tmp_path: Path) -> None:
    """Another process binding a picked port before etcd does (CI once saw a member's
    client and peer port collide) costs a retry on new ports, not the test."""
    _require_etcd()
    cluster = EtcdCluster(tmp_path / "etcd", size=2)
    squat = socket.socket()
    squat.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        taken = cluster.peer_ports[1]
        squat.bind(("127.0.0.1", taken))
        squat.listen()
        with cluster:
            assert taken not in cluster.peer_ports + cluster.client_ports
            assert "address already in use" in (tmp_path / "etcd" / "m1.log").read_text()
            store = EtcdStore(cluster.endpoints, connect_timeout_s=10)
            try:
                store.put("k", b"v")
                assert store.get("k") is not None
            finally:
                store.close()
    finally:
        squat.close()


def test_closing_the_store_ends_a_watch_in_flight_with_a_store_error(etcd1: EtcdCluster) -> None:
    """An agent closes its store at the end while its watch thread is in a read: that read
    ends with a StoreError (the watch thread's "the store is gone"), never with http.client's
    AttributeError on the closed response, nor with new connections to etcd (a rehearsal's
    agent printed that traceback as its job ended)."""
    for _ in range(5):
        store = EtcdStore(etcd1.endpoints, connect_timeout_s=10, request_timeout_s=10)
        store.put("w/x", b"1")
        since = store.revision()
        raised: list[BaseException] = []

        def watch(
            s: EtcdStore = store, rev: int = since, out: list[BaseException] = raised
        ) -> None:
            try:
                s.wait_for_change("w/", rev, 30)
            except BaseException as exc:  # noqa: BLE001 (the test looks at what it was)
                out.append(exc)

        waiter = threading.Thread(target=watch)
        waiter.start()
        time.sleep(0.5)  # (the watch stream is open and its read waits for an event)
        t_close = time.monotonic()
        store.close()
        waiter.join(timeout=15)
        assert not waiter.is_alive(), "the watch outlived its store by 15 s"
        assert time.monotonic() - t_close < 5
        assert len(raised) == 1 and isinstance(raised[0], StoreError), raised


def test_unreachable_endpoints_raise_store_unavailable_naming_every_endpoint() -> None:
    ports = free_ports(2)
    with pytest.raises(StoreUnavailable) as err:
        EtcdStore([("127.0.0.1", p) for p in ports], connect_timeout_s=0.5)
    assert all(f"127.0.0.1:{p}" in str(err.value) for p in ports)


def test_unknown_or_inconsistent_options_are_config_errors() -> None:
    def settings(**conf: str) -> StoreSettings:
        return StoreSettings(
            backend="etcd-v3", endpoints=(("127.0.0.1", 1),), conf=conf, connect_timeout_s=0.1
        )

    with pytest.raises(ConfigError, match="cacertt"):
        EtcdStore.from_settings(settings(cacertt="/x"))
    with pytest.raises(ConfigError, match="needs a password"):
        EtcdStore.from_settings(settings(user="root"))
    with pytest.raises(ConfigError, match="together"):
        EtcdStore.from_settings(settings(cert="/x"))
    with pytest.raises(ConfigError, match="no such file"):
        EtcdStore.from_settings(settings(cacert="/nonexistent/ca.pem"))


def _gw(
    port: int,
    path: str,
    body: dict[str, object],
    token: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> dict[str, object]:
    headers = {"Content-Type": "application/json", **({"Authorization": token} if token else {})}
    req = urllib.request.Request(
        f"{'https' if tls else 'http'}://127.0.0.1:{port}/v3/{path}",
        data=json.dumps(body).encode(),
        headers=headers,
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10, context=tls) as resp:
        out = json.loads(resp.read())
    assert isinstance(out, dict)
    return out


def test_user_password_auth_is_used_and_bad_credentials_are_config_errors(
    etcd1: EtcdCluster,
) -> None:
    port = etcd1.client_ports[0]
    _gw(port, "auth/role/add", {"name": "root"})
    _gw(port, "auth/user/add", {"name": "root", "password": "s3cret"})
    _gw(port, "auth/user/grant", {"user": "root", "role": "root"})
    _gw(port, "auth/enable", {})
    store = EtcdStore.from_settings(
        StoreSettings(
            backend="etcd",
            endpoints=tuple(etcd1.endpoints),
            conf={"user": "root"},
            password="s3cret",
        )
    )
    try:
        rev = store.put("k", b"v", ttl_s=3)
        assert store.get("k") is not None and store.get("k").revision == rev  # type: ignore[union-attr]
        assert store.wait_for_change("k", rev - 1, 5)[0]
        store.put("kept", b"v")  # (read below, maybe past k's 3 s lease on a loaded machine)
    finally:
        store.close()
    with pytest.raises(ConfigError, match="rejected user"):
        EtcdStore(etcd1.endpoints, user="root", password="wrong", connect_timeout_s=5)
    # The password from a file (first), the environment, never the command line.
    pw = etcd1.root / "pw"
    pw.write_text("s3cret\n")
    pw.chmod(0o600)
    for conf, env in (
        ({"user": "root", "password_file": str(pw)}, {"FLEXRUN_ETCD_PASSWORD": "wrong"}),
        ({"user": "root"}, {"FLEXRUN_ETCD_PASSWORD_FILE": str(pw)}),
        ({"user": "root"}, {"FLEXRUN_ETCD_PASSWORD": "s3cret"}),
    ):
        rest, _, password = store_credentials(conf, env)
        s2 = EtcdStore.from_settings(
            StoreSettings(
                backend="etcd", endpoints=tuple(etcd1.endpoints), conf=rest, password=password
            )
        )
        try:
            assert s2.get("kept") is not None
        finally:
            s2.close()
    with pytest.raises(ConfigError, match="visible to every user"):
        store_credentials({"user": "root", "password": "s3cret"}, {})
    anonymous = EtcdStore(etcd1.endpoints, connect_timeout_s=5)
    try:
        with pytest.raises(StoreError):
            anonymous.get("kept")
    finally:
        anonymous.close()


def _make_pki(d: Path) -> dict[str, Path]:
    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=flexrun-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    (d / "san.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    for name in ("server", "client"):
        ssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
        )
        ssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "san.cnf",
            "-out",
            f"{name}.pem",
        )
    return {n: d / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def test_tls_with_a_client_certificate_is_used_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    _require_etcd()
    pki = tmp_path / "pki"
    pki.mkdir()
    try:
        f = _make_pki(pki)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"openssl could not make test certificates: {exc}")
    with EtcdCluster(
        tmp_path / "etcd", tls=(f["ca.pem"], f["server.pem"], f["server.key"])
    ) as cluster:
        conf = {
            "cacert": str(f["ca.pem"]),
            "cert": str(f["client.pem"]),
            "key": str(f["client.key"]),
        }
        store = EtcdStore.from_settings(
            StoreSettings(
                backend="etcd", endpoints=tuple(cluster.endpoints), conf=conf, connect_timeout_s=10
            )
        )
        try:
            rev = store.put("k", b"v")
            assert store.wait_for_change("k", rev - 1, 5)[0]
        finally:
            store.close()
        with pytest.raises(StoreUnavailable):
            EtcdStore(cluster.endpoints, cacert=str(f["ca.pem"]), connect_timeout_s=1)


def test_tls_with_etcd_auth_from_a_password_file_and_a_job_secret_end_to_end(
    tmp_path: Path,
) -> None:
    """What a deployment uses: https to etcd, an etcd user whose password comes from a file,
    and the job secret signing every record on top. (etcd 3.4 refuses password auth from a
    client that also presents a certificate through its JSON gateway: "CommonName of client
    sending a request against gateway will be ignored"; use one or the other.)"""
    _require_etcd()
    pki = tmp_path / "pki"
    pki.mkdir()
    try:
        f = _make_pki(pki)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"openssl could not make test certificates: {exc}")
    with EtcdCluster(
        tmp_path / "etcd",
        tls=(f["ca.pem"], f["server.pem"], f["server.key"]),
        client_cert_auth=False,
    ) as cluster:
        ctx = ssl.create_default_context(cafile=str(f["ca.pem"]))
        port = cluster.client_ports[0]
        _gw(port, "auth/role/add", {"name": "root"}, tls=ctx)
        _gw(port, "auth/user/add", {"name": "root", "password": "pw-from-file"}, tls=ctx)
        _gw(port, "auth/user/grant", {"user": "root", "role": "root"}, tls=ctx)
        _gw(port, "auth/enable", {}, tls=ctx)
        (tmp_path / "pw").write_text("pw-from-file\n")
        (tmp_path / "secret").write_text("a-job-secret-of-32-bytes-or-more!\n")
        for name in ("pw", "secret"):
            (tmp_path / name).chmod(0o600)
        conf, secret, password = store_credentials(
            {
                "cacert": str(f["ca.pem"]),
                "user": "root",
                "password_file": str(tmp_path / "pw"),
                "secret_file": str(tmp_path / "secret"),
            },
            {},
        )
        signed = connect(
            StoreSettings(
                backend="etcd",
                endpoints=tuple(cluster.endpoints),
                conf=conf,
                secret=secret,
                password=password,
                connect_timeout_s=10,
            )
        )
        try:
            assert isinstance(signed, SignedStore)
            signed.put("job/x", b"payload")
            assert signed.get("job/x").value == b"payload"  # type: ignore[union-attr]
            raw = signed.inner.get("job/x")
            assert raw is not None and raw.value.startswith(b"FXS1 ")
            signed.put("job/hb/a", b"alive", ttl_s=5)  # a keep-alive over TLS with auth
            assert "job/hb/a" in signed.get_prefix("job/hb/")
        finally:
            signed.close()
        stranger = EtcdStore(cluster.endpoints, cacert=str(f["ca.pem"]), connect_timeout_s=10)
        try:  # reaching etcd without its credentials: etcd itself refuses every write
            with pytest.raises(StoreError):
                stranger.put("job/x", b"forged")
        finally:
            stranger.close()


def test_a_restarted_etcd_on_the_same_data_dir_serves_the_same_client_and_keeps_its_keys(
    etcd1: EtcdCluster,
) -> None:
    store = EtcdStore(etcd1.endpoints, connect_timeout_s=10, request_timeout_s=1)
    try:
        store.put("job/nodes/a", b"A")
        store.put("job/hb/a", b"1", ttl_s=5)
        etcd1.kill(0)
        with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{etcd1.client_ports[0]}"):
            store.put("job/hb/a", b"1", ttl_s=5)
        etcd1.start_member(0)
        etcd1.wait_ready(30)
        rev = store.put("job/hb/a", b"1", ttl_s=5)  # the same lease, kept by the restarted member
        assert set(store.get_prefix("job/")) == {"job/nodes/a", "job/hb/a"}
        assert store.get("job/hb/a").revision == rev  # type: ignore[union-attr]
    finally:
        store.close()


def test_a_prefix_range_ends_after_every_key_with_that_prefix() -> None:
    from flexrun.store.etcd import _range_end

    assert _range_end("job/") == b"job0"
    assert _range_end("a\u00ff") == "a\u00ff".encode()[:-1] + b"\xc0"
    assert _range_end("") == b"\0"  # etcd: from the key to the end of the keyspace
