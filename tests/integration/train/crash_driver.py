"""Crash-consistency driver: forks writer processes and kill -9s them during saves.

Run by test_train_crash.py as a subprocess (torch is imported once; each writer is a
forked child, so every kill is a real SIGKILL of a real process). Modes:

- ``stages DIR``: for each commit stage, a child saves step 1, then SIGKILLs itself at that
  stage while saving step 2.
- ``random DIR N SEED [MIN_S MAX_S]``: N children each load the newest checkpoint, then save
  in a loop, and are killed by the driver a random delay (default 0.3-1.2 s) after the first
  save handed its persist to the background: the delay is measured from there, not from the
  fork, so how long start-up takes on a loaded machine does not decide whether a kill lands
  in a save. ``DIR`` may be a URL
  (``s3://bucket/prefix``): storage options then come from
  ``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS``, and each result also says whether the kill left
  objects no manifest names or an incomplete multipart upload (all removed by the next
  writer's claim).

After every kill the driver loads with a fresh Checkpointer and checks that the result is
complete and verified: the loaded weights equal the value written at the loaded step, no
checkpoint was skipped as corrupt. Prints one JSON line with what it saw.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import sys
import time

import torch

from flexrun.train import Checkpointer
from flexrun.train.commit import COMMIT_STAGES
from flexrun.train.context import single_process_context

READY_S = 60.0  # a loaded 2-core machine loads a checkpoint in a few seconds


class Blob:
    """A stateful object whose every tensor holds the step it was saved at."""

    def __init__(self, n: int) -> None:
        self.w = torch.zeros(n)
        self.b = torch.zeros(n // 2, dtype=torch.float64)

    def set(self, step: int) -> None:
        self.w.fill_(step)
        self.b.fill_(step)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"w": self.w, "b": self.b}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.w.copy_(state["w"])
        self.b.copy_(state["b"])


def writer_stage(root: str, stage: str) -> None:
    blob = Blob(50_000)
    c = Checkpointer(root, ctx=single_process_context(), keep_last=2)
    c.register("blob", blob)
    blob.set(1)
    c.save(1, blocking=True)

    def hook(s: str) -> None:
        if s == stage:
            os.kill(os.getpid(), signal.SIGKILL)

    c._p._fault_hook = hook
    blob.set(2)
    c.save(2, blocking=True)
    os._exit(3)  # unreachable when the hook fires


def _checkpointer(root: str, **kw: object) -> Checkpointer:
    options = "env" if "://" in root else None
    return Checkpointer(root, ctx=single_process_context(), storage_options=options, **kw)  # type: ignore[arg-type]


def writer_loop(root: str, ready: int) -> None:
    blob = Blob(1_000_000)
    c = _checkpointer(root, keep_last=2)
    c.register("blob", blob)
    loaded = c.load()
    step = loaded.step if loaded else 0
    while True:
        step += 1
        blob.set(step)
        c.save(step)
        if ready >= 0:  # the first persist is under way: the driver's clock for the kill starts
            os.write(ready, b"r")
            os.close(ready)
            ready = -1


def verify(root: str) -> tuple[int | None, tuple[int, ...]]:
    blob = Blob(1)
    c = _checkpointer(root, keep_last=2)
    blob.w, blob.b = torch.empty(0), torch.empty(0, dtype=torch.float64)

    class Loose:
        def state_dict(self) -> dict[str, torch.Tensor]:
            return {}

        def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
            blob.w, blob.b = state["w"], state["b"]

    c.register("blob", Loose())
    loaded = c.load()
    if loaded is None:
        return None, ()
    assert bool((blob.w == loaded.step).all()) and bool((blob.b == loaded.step).all()), "torn state"
    return loaded.step, loaded.skipped


def leftovers(root: str) -> tuple[bool, bool]:
    """(objects no manifest names, incomplete uploads) below an object-store root."""
    from flexrun.storage_options import storage_options_from_env
    from flexrun.train.commit_object import open_commit

    proto = open_commit(root, storage_options=storage_options_from_env())
    store = proto.store  # type: ignore[attr-defined]
    named = set()
    for step in proto.steps():
        m = proto.read_manifest(step)
        named |= {f"step_{step}/{m.data_dir}/{n}" for n in m.files}
    keys = [
        k for k in store.listing(proto.root) if k.startswith("step_") and "/manifest.json" not in k
    ]
    return any(k not in named for k in keys), bool(store.incomplete_uploads(proto.root))


def in_child(target: object, *args: object) -> object:
    """Run ``target`` in a forked child (the parent never opens the object store, so
    every child starts with fresh connections); its JSON-able result comes back."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = json.dumps({"ok": target(*args)})  # type: ignore[operator]
        except BaseException as exc:
            out = json.dumps({"error": repr(exc)})
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        data = json.loads(fh.read() or '{"error": "no result"}')
    os.waitpid(pid, 0)
    if "error" in data:
        raise RuntimeError(data["error"])
    return data["ok"]


def fork(target: object, *args: object) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            target(*args)  # type: ignore[operator]
        finally:
            os._exit(4)
    return pid


def start_writer(root: str) -> int:
    """Fork a looping writer and return its pid once its first persist is under way."""
    r, w = os.pipe()
    pid = fork(writer_loop, root, w)
    os.close(w)
    ready, _, _ = select.select([r], [], [], READY_S)
    got = os.read(r, 1) if ready else b""
    os.close(r)
    if got != b"r":
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        sys.exit(f"writer {pid} did not reach its first save in {READY_S:.0f} s (status {status})")
    return pid


def main() -> None:
    torch.set_num_threads(1)  # no OpenMP pool in the parent: forked children must not deadlock
    mode, root = sys.argv[1], sys.argv[2]
    report: dict[str, object] = {"mode": mode, "results": []}
    results: list[dict[str, object]] = report["results"]  # type: ignore[assignment]
    if mode == "stages":
        for stage in COMMIT_STAGES:
            d = os.path.join(root, stage)
            pid = fork(writer_stage, d, stage)
            _, status = os.waitpid(pid, 0)
            step, skipped = verify(d)
            results.append(
                {
                    "stage": stage,
                    "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                    "step": step,
                    "skipped": list(skipped),
                }
            )
    elif "://" in root:
        n, rng = int(sys.argv[3]), random.Random(int(sys.argv[4]))
        lo, hi = (float(sys.argv[5]), float(sys.argv[6])) if len(sys.argv) > 6 else (0.3, 1.2)
        for _ in range(n):
            pid = start_writer(root)
            delay = rng.uniform(lo, hi)
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            orphans, uploads = in_child(leftovers, root)  # type: ignore[misc]
            step, skipped = in_child(verify, root)  # type: ignore[misc]
            results.append(
                {
                    "delay": round(delay, 3),
                    "step": step,
                    "skipped": list(skipped),
                    "mid_save": bool(orphans or uploads),
                    "incomplete_upload": bool(uploads),
                }
            )
    else:
        n, rng = int(sys.argv[3]), random.Random(int(sys.argv[4]))
        for _ in range(n):
            pid = start_writer(root)
            delay = rng.uniform(0.3, 1.2)
            time.sleep(delay)
            staging = (
                [x for x in os.listdir(root) if x.startswith(".tmp")] if os.path.isdir(root) else []
            )
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            mid_save = bool(staging) or any(x.startswith(".tmp") for x in os.listdir(root))
            step, skipped = verify(root)
            results.append(
                {
                    "delay": round(delay, 3),
                    "step": step,
                    "skipped": list(skipped),
                    "mid_save": mid_save,
                }
            )
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
