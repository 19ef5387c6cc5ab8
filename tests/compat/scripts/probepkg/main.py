"""``python -m probepkg.main``: the probe, run as a module."""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parents[1] / "probe.py"), run_name="__main__")
