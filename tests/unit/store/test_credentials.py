"""Where the job secret and the etcd password come from (docs/operator/security.md, docs/user/stores.md),
and that ``connect`` authenticates every client built from settings."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from flexrun.config import StoreSettings, generated_secret, keepalive_defaults, store_credentials
from flexrun.errors import ConfigError
from flexrun.store.factory import connect, connect_from_env, tcp_address
from flexrun.store.signed import SignedStore
from flexrun.store.tcp import TcpStore, TcpStoreServer


def _file(tmp_path: Path, name: str, text: str, mode: int = 0o600) -> str:
    p = tmp_path / name
    p.write_text(text)
    p.chmod(mode)
    return str(p)


def test_the_secret_comes_from_the_conf_file_then_the_env_file_then_the_env_value(
    tmp_path: Path,
) -> None:
    f1 = _file(tmp_path, "a", "secret-from-the-conf-file\n")
    f2 = _file(tmp_path, "b", "secret-from-the-env-file")
    env = {"FLEXRUN_JOB_SECRET_FILE": f2, "FLEXRUN_JOB_SECRET": "secret-from-the-env-value"}
    rest, secret, _ = store_credentials({"secret_file": f1, "tls": "true"}, env)
    assert secret == b"secret-from-the-conf-file" and rest == {"tls": "true"}
    assert store_credentials({}, env)[1] == b"secret-from-the-env-file"
    assert store_credentials({}, {"FLEXRUN_JOB_SECRET": "secret-from-the-env-value"})[1] == (
        b"secret-from-the-env-value"
    )
    assert store_credentials({}, {})[1] is None
    assert len(generated_secret()) == 64 and generated_secret() != generated_secret()


def test_a_secret_or_password_on_the_command_line_is_refused_with_one_line() -> None:
    for name in ("secret", "password"):
        with pytest.raises(ConfigError, match="visible to every user") as err:
            store_credentials({name: "x" * 32}, {})
        assert "\n" not in str(err.value)


def test_a_short_empty_or_missing_secret_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 16"):
        store_credentials({"secret_file": _file(tmp_path, "s", "short")}, {})
    with pytest.raises(ConfigError, match="empty"):
        store_credentials({"secret_file": _file(tmp_path, "e", "\n")}, {})
    with pytest.raises(ConfigError, match="cannot read"):
        store_credentials({}, {"FLEXRUN_JOB_SECRET_FILE": str(tmp_path / "nope")})


def test_a_secret_file_others_can_read_is_used_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _file(tmp_path, "s", "a" * 32, mode=0o644)  # a Kubernetes Secret volume's default
    with caplog.at_level(logging.WARNING):
        assert store_credentials({"secret_file": path}, {})[1] == b"a" * 32
    assert "chmod 600" in caplog.text


def test_the_etcd_password_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    f = _file(tmp_path, "pw", "pw-from-file\n")
    assert (
        store_credentials({"password_file": f}, {"FLEXRUN_ETCD_PASSWORD": "x"})[2] == "pw-from-file"
    )
    assert store_credentials({}, {"FLEXRUN_ETCD_PASSWORD_FILE": f})[2] == "pw-from-file"
    assert store_credentials({}, {"FLEXRUN_ETCD_PASSWORD": "pw"})[2] == "pw"
    settings = StoreSettings(backend="etcd", password="pw", secret=b"s" * 16)
    assert "pw" not in repr(settings) and "sss" not in repr(settings)


def test_keep_alive_defaults_scale_with_the_job() -> None:
    assert keepalive_defaults(4) == (1.0, 5.0)
    assert keepalive_defaults(2000) == (1.0, 5.0)
    assert keepalive_defaults(4096) == (4096 / 2000, 5 * 4096 / 2000)
    assert keepalive_defaults(10_000) == (5.0, 25.0)
    # etcd expires leases itself (whole seconds): TTL/3 renewals within 500 requests/s
    assert keepalive_defaults(4, "etcd") == (5 / 3, 5.0)
    assert keepalive_defaults(1024, "etcd") == (7 / 3, 7.0)
    assert keepalive_defaults(4096, "etcd") == (25 / 3, 25.0)
    assert keepalive_defaults(10_000, "etcd") == (20.0, 60.0)
    for n in (1, 833, 1024, 4096, 10_000, 50_000):
        interval, timeout = keepalive_defaults(n, "etcd")
        assert n / interval <= 500 + 1e-9 and timeout == int(timeout) and timeout >= 5


@pytest.mark.timeout(60)
def test_connect_returns_a_signing_client_with_a_secret_and_live_workers_get_one_too(
    tmp_path: Path,
) -> None:
    server = TcpStoreServer("127.0.0.1", 0)
    try:
        ep = (("127.0.0.1", server.port),)
        plain = connect(StoreSettings(backend="c10d", endpoints=ep))
        signed = connect(StoreSettings(backend="c10d", endpoints=ep, secret=b"k" * 32))
        assert isinstance(plain, TcpStore) and isinstance(signed, SignedStore)
        assert tcp_address(signed) == tcp_address(plain) == ("127.0.0.1", server.port)
        signed.put("job/live/epoch", b"epoch 1")
        path = _file(tmp_path, "secret", "k" * 32)
        worker = connect_from_env("127.0.0.1", server.port, {"FLEXRUN_JOB_SECRET_FILE": path})
        assert isinstance(worker, SignedStore)
        assert worker.get("job/live/epoch").value == b"epoch 1"  # type: ignore[union-attr]
        assert plain.get("job/live/epoch").value != b"epoch 1"  # type: ignore[union-attr]
        assert isinstance(connect_from_env("127.0.0.1", server.port, {}), TcpStore)
        for s in (plain, signed, worker):
            s.close()
    finally:
        server.close()
