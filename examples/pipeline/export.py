"""Pipeline stage 4: weights as safetensors + a model card, published as the next version.

Writes ``<registry>/v<N>/model.safetensors`` and ``model_card.json`` (metrics, flexrun and
torch versions, data hash), then points ``<registry>/current`` at ``v<N>``;
``flexrun pipeline rollback <registry>`` points it back.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from common import data_hash

import flexrun
from flexrun.pipeline.versions import publish, staging_dir

MISSING_SAFETENSORS = (
    "export: the 'safetensors' package is not installed; install it with "
    "`pip install 'flexrun[pipeline]'` (or `pip install safetensors`) and re-run the pipeline"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="model")
    p.add_argument("--metrics", default="metrics.json")
    p.add_argument("--data", default="data")
    p.add_argument("--registry", default="models")
    p.add_argument("--name", default="digits-mlp")
    args = p.parse_args(argv)
    try:
        from safetensors.torch import save_file
    except ImportError:
        print(MISSING_SAFETENSORS, file=sys.stderr, flush=True)
        return 1

    state = torch.load(Path(args.model) / "weights.pt", weights_only=True)
    config = json.loads((Path(args.model) / "config.json").read_text())
    metrics = json.loads(Path(args.metrics).read_text())
    registry = Path(args.registry)
    staging = staging_dir(registry)
    weights = staging / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(weights))
    card = {
        "name": args.name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "metrics": metrics,
        "model": config,
        "flexrun_version": flexrun.__version__,
        "torch_version": torch.__version__,
        "data_sha256": data_hash(args.data),
        "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "format": "safetensors",
    }
    (staging / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    version = publish(registry, staging)
    print(
        f"export: {registry}/{version} (accuracy {metrics.get('accuracy')}); current -> {version}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
