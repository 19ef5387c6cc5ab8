"""Shared by the digits pipeline's stage scripts: the model and the tensor files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

FEATURES = 64
CLASSES = 10


def build_model(hidden: int) -> torch.nn.Module:
    """A small MLP over the 8x8 digit images (flattened, scaled to [0, 1])."""
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, CLASSES),
    )


def load_split(data_dir: str | Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of ``train`` or ``val``; loaded with ``weights_only`` (no code runs)."""
    blob = torch.load(Path(data_dir) / f"{split}.pt", weights_only=True)
    return blob["x"], blob["y"]


def data_hash(data_dir: str | Path) -> str:
    """sha256 over the split files, in a fixed order: the model card's data identity."""
    h = hashlib.sha256()
    for split in ("train", "val"):
        h.update((Path(data_dir) / f"{split}.pt").read_bytes())
    return h.hexdigest()
