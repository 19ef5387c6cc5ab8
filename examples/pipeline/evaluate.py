"""Pipeline stage 3: validation accuracy as JSON; fails the pipeline below a threshold."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from common import build_model, load_split


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data")
    p.add_argument("--model", default="model")
    p.add_argument("--out", default="metrics.json")
    p.add_argument("--threshold", type=float, default=0.85, help="minimum accuracy to pass")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    config = json.loads((Path(args.model) / "config.json").read_text())
    model = build_model(config["hidden"])
    model.load_state_dict(torch.load(Path(args.model) / "weights.pt", weights_only=True))
    model.eval()
    xs, ys = load_split(args.data, "val")
    with torch.no_grad():
        pred = model(xs).argmax(dim=1)
    accuracy = float((pred == ys).float().mean())
    metrics = {
        "accuracy": round(accuracy, 6),
        "val_samples": len(ys),
        "threshold": args.threshold,
        "passed": accuracy >= args.threshold,
        "train_steps": config.get("steps"),
    }
    Path(args.out).write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"evaluate: accuracy {accuracy:.4f} on {len(ys)} validation samples", flush=True)
    if accuracy < args.threshold:
        print(
            f"evaluate: accuracy {accuracy:.4f} is below the threshold {args.threshold}; "
            "failing the pipeline (nothing is exported)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
