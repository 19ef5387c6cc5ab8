"""Pipeline stage 1: scikit-learn's digits (bundled, no download) -> train/val tensors.

Writes ``<out>/train.pt`` and ``<out>/val.pt`` (``{"x": float32 [N, 64] in [0, 1],
"y": int64 [N]}``) and ``<out>/meta.json``; a stratified split with a fixed seed, so the
same command produces the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from common import data_hash


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data", help="output directory")
    p.add_argument("--val-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.data.astype("float32") / 16.0
    y = digits.target.astype("int64")
    x_tr, x_va, y_tr, y_va = train_test_split(
        x, y, test_size=args.val_fraction, random_state=args.seed, stratify=y
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, xs, ys in (("train", x_tr, y_tr), ("val", x_va, y_va)):
        tmp = out / f".{split}.pt.tmp"
        torch.save({"x": torch.from_numpy(xs), "y": torch.from_numpy(ys)}, tmp)
        os.replace(tmp, out / f"{split}.pt")
    meta = {
        "dataset": "sklearn.datasets.load_digits",
        "train": len(y_tr),
        "val": len(y_va),
        "val_fraction": args.val_fraction,
        "seed": args.seed,
        "data_sha256": data_hash(out),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"preprocess: {len(y_tr)} train / {len(y_va)} val samples -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
