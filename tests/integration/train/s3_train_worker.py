"""examples/train_elastic.py with its checkpoints on an object store: the script's
``Checkpointer`` takes ``storage_options="env"`` (FLEXRUN_CHECKPOINT_STORAGE_OPTIONS), as
a script launched from a Kubernetes or pipeline spec with ``storageOptions`` would."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import flexrun.train as ft

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import train_elastic  # noqa: E402

ft.Checkpointer = functools.partial(ft.Checkpointer, storage_options="env")  # type: ignore[misc]

if __name__ == "__main__":
    sys.exit(train_elastic.main(sys.argv[1:]))
