"""The worker-side progress hook: what the agent sees of a worker's steps, with no script change.

Owns the progress file a worker keeps for its agent (``FLEXRUN_PROGRESS_FILE``) and its
format, and the hooks that feed it. The agent starts every Python worker with a
``sitecustomize`` (``flexrun/_hookboot``, put first on ``PYTHONPATH``; it removes itself
from ``sys.path`` and ``PYTHONPATH`` and then runs any ``sitecustomize`` of the user's)
that calls :func:`install`; a warm spare calls it when it becomes a worker. Installed, it:

- registers :mod:`faulthandler` on SIGUSR2, dumping all threads' stacks to
  ``FLEXRUN_STACK_FILE``, *before* the progress file first exists (the agent signals only
  workers whose progress file exists: SIGUSR2 kills a process without a handler);
- counts a **step** at every ``torch.optim`` optimizer step (torch's global post-step
  hook), every :func:`flexrun.train.report_progress` and every live-loop step;
- counts a **beat** (a sign of life, not a step) when ``init_process_group`` and the
  Python-level ``torch.distributed`` collectives return;
- holds the default process group from ``destroy_process_group`` to the next init or the
  exit (:func:`_hold_default_group`: a torch deadlock in the teardown otherwise).

Torch is never imported here: the hooks are attached when the script itself imports
``torch.optim.optimizer`` / ``torch.distributed.distributed_c10d`` (an import finder).
The file is rewritten in place (one ``pwrite`` of a fixed-size line), at most every
``WRITE_INTERVAL_S`` except for the first step and a checkpoint, so its mtime is the last
sign of life and its content ``"<steps> <beats>"``, then ``s<steps>`` once a checkpoint can
be resumed from (the step count its state was taken at: :func:`saved`, called by
``flexrun.train``), then ``end`` once training is over. Child processes of the worker (data loaders) do not
report. Standard library only; never raises into the script.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import IO, Any

PROGRESS_ENV = "FLEXRUN_PROGRESS_FILE"
STACK_ENV = "FLEXRUN_STACK_FILE"
OWNER_ENV = "FLEXRUN_HOOK_PID"
"""The pid of the process that installed the hook: a child (spawned data loader) that
inherits the environment sees another pid and stays silent."""
ORIG_PYTHONPATH_ENV = "FLEXRUN_ORIG_PYTHONPATH"
"""The worker's PYTHONPATH before the agent put the boot directory first ("=" + value;
absent: there was none), restored by the boot ``sitecustomize``."""
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hookboot")
WRITE_INTERVAL_S = 0.2
_LINE = 48  # bytes: the file's fixed size (one pwrite, no new block on a full disk)

COLLECTIVES = (
    "barrier",
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
    "broadcast_object_list",
    "monitored_barrier",
)


class _Progress:
    def __init__(self) -> None:
        self.fd: int | None = None
        self.steps = 0
        self.beats = 0
        self.last_write = 0.0
        self.write_errors = 0
        self.ended = False
        self.saved = -1
        self.stack_fh: IO[str] | None = None
        self.held_groups: list[Any] = []  # see _hold_default_group
        self.release_at_exit = False


_state = _Progress()


def installed() -> bool:
    return _state.fd is not None


def install(environ: dict[str, str] | None = None) -> bool:
    """Install the hook in this process if the agent asked for it (idempotent)."""
    env = os.environ if environ is None else environ
    path = env.get(PROGRESS_ENV)
    owner = env.get(OWNER_ENV)
    if not path or _state.fd is not None:
        return _state.fd is not None
    if owner and owner != str(os.getpid()):
        return False  # a child of the worker: the worker reports for it
    env[OWNER_ENV] = str(os.getpid())
    stacks = env.get(STACK_ENV)
    if stacks and hasattr(signal, "SIGUSR2") and _state.stack_fh is None:
        try:
            _state.stack_fh = open(stacks, "a")  # noqa: SIM115  (kept for the handler)
        except OSError:
            _state.stack_fh = None
        if _state.stack_fh is not None:
            faulthandler.register(signal.SIGUSR2, file=_state.stack_fh, all_threads=True)
    if _state.stack_fh is None:
        return False  # no safe way to ask for stacks: do not advertise the hook
    try:
        _state.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    except OSError:
        return False
    _write(force=True)
    sys.meta_path.insert(0, _TorchFinder())
    for name in ("torch.optim.optimizer", "torch.distributed.distributed_c10d"):
        mod = sys.modules.get(name)
        if mod is not None:  # (a warm spare imported torch before it became a worker)
            _attach(name, mod)
    return True


def adopt() -> bool:
    """A warm spare becomes a worker: undo the boot directory's place on ``sys.path`` and
    ``PYTHONPATH`` (its environment is the cold worker's) and :func:`install`."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != BOOT_DIR]
    orig = os.environ.pop(ORIG_PYTHONPATH_ENV, None)
    if orig is not None:
        os.environ["PYTHONPATH"] = orig[1:]
    elif os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] == BOOT_DIR:
        os.environ.pop("PYTHONPATH")
    return install()


def worker_env(env: dict[str, str], progress_file: str, stack_file: str) -> None:
    """Ask for the hook in a worker started with ``env`` (the agent's side)."""
    env[PROGRESS_ENV] = progress_file
    env[STACK_ENV] = stack_file
    env.pop(OWNER_ENV, None)
    orig = env.get("PYTHONPATH")
    if orig is not None:
        env[ORIG_PYTHONPATH_ENV] = "=" + orig
    env["PYTHONPATH"] = BOOT_DIR + (os.pathsep + orig if orig else "")


def stack_file() -> IO[str] | None:
    """The file SIGUSR2 dumps stacks to, when the hook installed it."""
    return _state.stack_fh


def step(n: int = 1) -> None:
    """Count ``n`` completed training steps."""
    if _state.fd is None:
        return
    first = _state.steps == 0
    _state.steps += n
    _write(force=first)


def counted() -> int:
    """The steps counted so far (0 without the hook)."""
    return _state.steps


def saved(steps: int) -> None:
    """A checkpoint of the state taken after ``steps`` counted steps (:func:`counted` then)
    can now be resumed from: the work up to it survives a failure (the agent's ETTR). Any
    thread (a background persist)."""
    if _state.fd is None or steps <= _state.saved:
        return
    _state.saved = steps
    _write(force=True)


def beat() -> None:
    """Count a sign of life that is not a step (a collective returned)."""
    if _state.fd is None:
        return
    _state.beats += 1
    _write(force=False)


def end() -> None:
    """The training is over (``destroy_process_group`` was called): what follows is
    teardown, which the agent does not judge as a hang."""
    if _state.fd is not None and not _state.ended:
        _state.ended = True
        _write(force=True)


def _write(*, force: bool) -> None:
    now = time.monotonic()
    if not force and now - _state.last_write < WRITE_INTERVAL_S:
        return
    _state.last_write = now
    tail = f" s{_state.saved}" if _state.saved >= 0 else ""
    tail += " end" if _state.ended else ""
    line = f"{_state.steps} {_state.beats}{tail}".ljust(_LINE - 1) + "\n"
    assert _state.fd is not None
    try:
        os.pwrite(_state.fd, line.encode(), 0)
    except OSError:
        # A full disk: the line never fit (it was created on a full disk; once written,
        # overwriting it in place needs no new block). Keep the mtime current, which
        # needs none either: the agent still sees this worker alive.
        _state.write_errors += 1
        try:
            os.utime(_state.fd)
        except OSError:
            _state.write_errors += 1


def read(path: str | os.PathLike[str]) -> tuple[int, int, float] | None:
    """(steps, beats, mtime) of a progress file, or None if it does not exist (yet);
    steps -1: unknown (the hook could never write its line: a full disk); beats -1: the
    worker ended its training (teardown follows). See :func:`read_saved` for the rest."""
    got = read_saved(path)
    return None if got is None else got[:3]


def read_saved(path: str | os.PathLike[str]) -> tuple[int, int, float, int] | None:
    """:func:`read`'s (steps, beats, mtime) and the step count of the newest checkpoint
    that can be resumed from (-1: none said)."""
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            raw = fh.read(_LINE)
    except FileNotFoundError:
        return None
    parts = raw.split()
    if not parts:
        return -1, 0, st.st_mtime, -1
    saved = -1
    try:
        steps = int(parts[0])
        beats = int(parts[1]) if len(parts) > 1 else 0
        for part in parts[2:]:
            if part == b"end":
                beats = -1
            elif part.startswith(b"s"):
                saved = int(part[1:])
    except ValueError:
        steps, beats = 1, 0  # an older report_progress format (the step number)
    return steps, beats, st.st_mtime, saved


# -- attaching to torch -------------------------------------------------------------------------
def _attach(name: str, mod: ModuleType) -> None:
    if name == "torch.optim.optimizer":
        register = getattr(mod, "register_optimizer_step_post_hook", None)
        if register is not None:
            register(lambda *_a: step())
    elif name == "torch.distributed.distributed_c10d":
        for fn in ("init_process_group", "destroy_process_group", *COLLECTIVES):
            orig = getattr(mod, fn, None)
            if callable(orig) and not getattr(orig, "_flexrun_beat", False):
                wrapped = _beating(
                    orig,
                    ends=fn == "destroy_process_group",
                    starts=fn == "init_process_group",
                )
                setattr(mod, fn, wrapped)
        dist = sys.modules.get("torch.distributed")
        if dist is not None:  # (already imported from the module: rebind there too)
            for fn in ("init_process_group", "destroy_process_group", *COLLECTIVES):
                if hasattr(dist, fn) and hasattr(mod, fn):
                    setattr(dist, fn, getattr(mod, fn))


def _beating(
    fn: Callable[..., Any], *, ends: bool = False, starts: bool = False
) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if ends and not args and not kwargs.get("group"):
            end()  # (the default group: the training's end)
            _hold_default_group()
        elif starts:
            _release_held_groups()
        out = fn(*args, **kwargs)
        beat()
        return out

    wrapper._flexrun_beat = True  # type: ignore[attr-defined]
    return wrapper


def _hold_default_group() -> None:
    """Keep the default process group referenced from here past ``destroy_process_group``,
    until the next ``init_process_group`` or the interpreter's exit (an ``atexit`` handler,
    interpreter still whole), so that its last reference is dropped from Python.

    Why: torch frees a DDP model's reducer with the GIL held. When the reducer holds the
    last reference to a gloo process group, the group's destructor joins its run loop, which
    may still be freeing the tensors of the last collective and waits for that GIL: the
    worker hangs for good after its training ended (pytorch/pytorch#56297), the typical
    ``main()`` that returns right after ``destroy_process_group`` included, under torchrun
    as here. Dropped from Python, the group's binding releases the GIL before destroying it
    (measured in bench/results/teardown.txt)."""
    try:
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        group = getattr(getattr(c10d, "group", None), "WORLD", None)
        if group is None:
            return
        if not _state.release_at_exit:
            import atexit

            atexit.register(_release_held_groups)
            _state.release_at_exit = True
        _state.held_groups.append(group)
    except Exception as exc:  # (a torch whose API moved: the hook is best effort)
        print(f"flexrun: progress hook could not hold the process group: {exc}", file=sys.stderr)


def _release_held_groups() -> None:
    _state.held_groups.clear()


class _AttachingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self.inner = inner
        self.name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        try:
            _attach(self.name, module)
        except Exception as exc:  # (a torch whose API moved: the hook is best effort)
            print(f"flexrun: progress hook not attached to {self.name}: {exc}", file=sys.stderr)


class _TorchFinder(importlib.abc.MetaPathFinder):
    TARGETS = frozenset({"torch.optim.optimizer", "torch.distributed.distributed_c10d"})

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _AttachingLoader(spec.loader, fullname)
        return spec
