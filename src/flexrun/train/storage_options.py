"""Checkpoint ``storage_options`` handed to a worker in its environment, and the rule that
they never carry a credential.

Owns ``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS`` (a JSON object the Kubernetes and pipeline
renderers set from a spec's ``checkpoint.storageOptions``; a script asks for it with
``Checkpointer(..., storage_options="env")``) and :func:`check_no_secrets`, which the
renderers can call too. The library reads this variable only when the script asks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

STORAGE_OPTIONS_ENV = "FLEXRUN_CHECKPOINT_STORAGE_OPTIONS"
"""Environment variable holding a worker's checkpoint ``storage_options`` as a JSON object
(set by the Kubernetes and pipeline renderers from ``checkpoint.storageOptions``)."""

_SECRET_KEYS = frozenset(
    {
        "key",
        "secret",
        "password",
        "passwd",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "secret_access_key",
        "session_token",
        "account_key",
        "sas_token",
        "client_secret",
        "connection_string",
        "credentials",
    }
)
_TOKEN_MODES = frozenset({"anon", "cloud", "google_default", "browser", "cache"})


def check_no_secrets(options: Mapping[str, Any], where: str) -> None:
    """Refuse ``storage_options`` that carry a credential (they travel in environment
    variables and rendered manifests; credentials belong in the store's own chain: an
    instance or pod identity, a profile, ``AWS_*`` variables from a Secret).

    Raises:
        ConfigError: a key names a credential (``secret``, ``password``, ``sas_token`` ...).
    """
    from flexrun.errors import ConfigError

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                name = str(k).lower()
                secret = name in _SECRET_KEYS or name.endswith(("_secret", "_password", "_key_id"))
                if name == "token" and not (isinstance(v, str) and v in _TOKEN_MODES):
                    secret = True
                if secret:
                    raise ConfigError(
                        f"{where}: {path}{k} looks like a credential; never put secrets in "
                        "storage options: use the store's credential chain (pod/instance "
                        "identity, a profile, AWS_* variables from a Kubernetes Secret)"
                    )
                walk(v, f"{path}{k}.")
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, f"{path}{i}.")

    walk(options, "")


def storage_options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``storage_options`` a launcher handed this worker in
    ``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS`` (JSON object; empty when unset).

    Raises:
        ConfigError: not a JSON object, or it carries a credential.
    """
    import json

    from flexrun.errors import ConfigError

    env = os.environ if environ is None else environ
    raw = env.get(STORAGE_OPTIONS_ENV, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{STORAGE_OPTIONS_ENV} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(
            f"{STORAGE_OPTIONS_ENV} must be a JSON object, got {type(value).__name__}"
        )
    check_no_secrets(value, STORAGE_OPTIONS_ENV)
    return value
