"""The worker-side progress hook in a real interpreter: steps seen with no script change,
the script's sys.path and PYTHONPATH untouched, a user's sitecustomize still run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexrun import worker_hook

SCRIPT = """
import json, os, sys
import torch
m = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad(); m(torch.ones(2)).sum().backward(); opt.step()
print(json.dumps({
    "path": sys.path, "pp": os.environ.get("PYTHONPATH"),
    "user_site": bool(sys.modules.get("sitecustomize")
                      and getattr(sys.modules["sitecustomize"], "USER", False)),
}))
"""


@pytest.mark.timeout(120)
def test_a_plain_script_is_hooked_and_sees_torchruns_path(tmp_path: Path) -> None:
    import json

    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("USER = True\n")
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(user), str(Path(worker_hook.__file__).parents[1])])
    before = env["PYTHONPATH"]
    worker_hook.worker_env(env, str(tmp_path / "progress"), str(tmp_path / "stacks"))
    r = subprocess.run(
        [sys.executable, "-u", str(script)], env=env, capture_output=True, text=True, timeout=100
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["pp"] == before and out["user_site"]
    assert not any("_hookboot" in p for p in out["path"])
    assert out["path"][0] == str(tmp_path)
    got = worker_hook.read(tmp_path / "progress")
    assert got is not None and got[0] >= 1  # the first step is always written
