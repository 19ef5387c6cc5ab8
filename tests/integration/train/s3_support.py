"""A real S3 API server for the checkpoint tests: moto's server mode on 127.0.0.1.

One server per test session (started on first use, stopped at the end), a fresh bucket
per test. Credentials are dummies in the environment (never in storage options), as a
real job would get them from its credential chain; the endpoint goes in storage options.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from flexrun.testing.ports import free_port

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
PART_BYTES = 5 << 20
"""S3's smallest multipart part: big enough files really go multipart in tests."""


@dataclass
class S3:
    endpoint: str
    bucket: str
    client: Any = field(repr=False)

    @property
    def options(self) -> dict[str, Any]:
        """What a script passes as ``storage_options`` (no credential in it)."""
        return {
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
            "default_block_size": PART_BYTES,
        }

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def env(self) -> dict[str, str]:
        """Environment for a worker process: credentials and the storage options."""
        return {**CREDENTIALS, "FLEXRUN_CHECKPOINT_STORAGE_OPTIONS": json.dumps(self.options)}

    def keys(self, prefix: str = "") -> list[str]:
        out: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)

    def uploads(self, prefix: str = "") -> list[dict[str, Any]]:
        """Incomplete multipart uploads below ``prefix``."""
        resp = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
        return list(resp.get("Uploads") or [])

    def read(self, key: str) -> bytes:
        return bytes(self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def write(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise

    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3(s3_endpoint: str) -> S3:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    bucket = f"ck-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return S3(endpoint=s3_endpoint, bucket=bucket, client=client)
