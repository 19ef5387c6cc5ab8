"""The compat suite's session runner (helpers live in ``compat_support.py``)."""

from __future__ import annotations

import pytest
from compat_support import Runner


@pytest.fixture(scope="session")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    return Runner(tmp_path_factory.mktemp("compat"))
