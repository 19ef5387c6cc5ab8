"""The local pipeline runner: dependency order, cache, resume, clean stops.

Owns one run of a :class:`~flexrun.pipeline.spec.Pipeline` in a run directory: the checks
before anything runs (every written path strictly below the run directory, every
external input present), which stages are skipped (same cache key, outputs present),
which run (in parallel when independent), retries and the state after every change (the
state file, ``state``), so a runner killed with SIGKILL loses nothing but the stage in
flight; the next run stops what that runner left behind and resumes at the first
incomplete stage. Each attempt runs as a process session (``attempt``: console and log
streaming, timeouts, stopping the whole tree). The train stage runs ``flexrun run
--standalone``; its checkpoint directory survives a resume and is removed (through
``paths.remove_below``, never outside the run directory) when the stage's key changes.
That stale-checkpoint wipe is for ``checkpointDir`` only: a ``checkpointUrl`` is handed to
the stage as ``FLEXRUN_CHECKPOINT_DIR`` (its ``storageOptions`` as JSON in
``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS``) and the runner never removes anything under it
(an object store's lifecycle is its owner's; the URL is part of the stage's key).

Exit status of :meth:`Runner.run`: 0 all stages succeeded; 1 a stage failed; 128+N when
stopped by signal N.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from flexrun.errors import ConfigError, SpecError
from flexrun.pipeline import _proc
from flexrun.pipeline.attempt import Attempts, Console
from flexrun.pipeline.paths import remove_below, resolve_below
from flexrun.pipeline.spec import Pipeline, Stage, TrainSpec, substitute
from flexrun.pipeline.state import StateFile, hash_path, stage_key, summarize
from flexrun.storage_options import CHECKPOINT_DIR_ENV, STORAGE_OPTIONS_ENV, storage_options_json

LOCK_FILE = ".pipeline.lock"


def checkpoint_env(train: TrainSpec | None) -> dict[str, str]:
    """What a train stage with a ``checkpointUrl`` gets in its environment (else nothing):
    the URL and (when given) its storage options as compact JSON with sorted keys."""
    if train is None or train.checkpoint_url is None:
        return {}
    env = {CHECKPOINT_DIR_ENV: train.checkpoint_url}
    if train.storage_options:
        env[STORAGE_OPTIONS_ENV] = storage_options_json(train.storage_options)
    return env


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """How one local run behaves."""

    run_dir: Path
    """Where stages run (their working directory), and where state and logs live."""
    max_parallel: int = 0
    """Most stages running at once; 0: as many as are ready."""
    stop_grace_s: float = 30.0
    """SIGTERM to SIGKILL for a stage being stopped (a train stage checkpoints meanwhile)."""
    python: str = sys.executable
    """Interpreter for ``{python}`` and for the train stage's ``flexrun run``."""

    def __post_init__(self) -> None:
        if self.max_parallel < 0:
            raise ConfigError(f"--max-parallel must be >= 0 (got {self.max_parallel})")
        if self.stop_grace_s < 0:
            raise ConfigError(f"--stop-grace must be >= 0 (got {self.stop_grace_s})")


def stage_argv(
    pipeline: Pipeline, stage: Stage, values: Mapping[str, str], run_dir: Path
) -> list[str]:
    """The argv a stage runs locally (the train stage: ``flexrun run --standalone``)."""
    where = f"stages.{stage.name}"
    if stage.command is not None:
        return [substitute(a, values, f"{where}.command") for a in stage.command]
    train = stage.train
    assert train is not None  # Stage.__post_init__: exactly one of command and train
    return [
        values["python"],
        "-m",
        "flexrun",
        "run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        train.nproc_per_node,
        "--max-restarts",
        str(train.max_restarts),
        "--rdzv-id",
        f"{pipeline.name}-{stage.name}",
        "--run-dir",
        str(run_dir / "flexrun" / stage.name),
        substitute(train.script, values, f"{where}.train.script"),
        *(substitute(a, values, f"{where}.train.args") for a in train.args),
    ]


def check_paths(pipeline: Pipeline, run_dir: Path, values: Mapping[str, str]) -> None:
    """Every path the runner writes or removes resolves strictly below the run directory.

    Raises:
        SpecError: an output, checkpoint directory or relative input escapes it.
    """
    src = pipeline.source
    for stage in pipeline.stages:
        where = f"{src}: stages.{stage.name}"
        for i, out in enumerate(stage.outputs):
            resolve_below(run_dir, out, f"{where}.outputs[{i}]")
        for i, raw in enumerate(stage.inputs):
            path = substitute(raw, values, f"stages.{stage.name}.inputs[{i}]")
            if not Path(path).is_absolute():
                resolve_below(run_dir, path, f"{where}.inputs[{i}]")
        if stage.train is not None and stage.train.checkpoint_dir is not None:
            resolve_below(run_dir, stage.train.checkpoint_dir, f"{where}.train.checkpointDir")


def check_external_inputs(pipeline: Pipeline, run_dir: Path, values: Mapping[str, str]) -> None:
    """Raises SpecError naming an input that neither exists nor is produced by a stage."""
    produced = {Path(o) for s in pipeline.stages for o in s.outputs}
    for stage in pipeline.stages:
        for i, raw in enumerate(stage.inputs):
            path = Path(substitute(raw, values, f"stages.{stage.name}.inputs[{i}]"))
            if any(p in produced for p in (path, *path.parents)):
                continue
            full = path if path.is_absolute() else run_dir / path
            if not full.exists():
                raise SpecError(
                    f"{pipeline.source}: stages.{stage.name}.inputs[{i}]: {raw!r} "
                    f"({full}) does not exist and no stage produces it"
                )


def reap_leftovers(
    pipeline: Pipeline, state: StateFile, grace_s: float, say: Callable[[str], None]
) -> None:
    """Stop what a killed runner left running (same pid and start time) and mark it."""
    for stage in pipeline.stages:
        rec = state.stage(stage.name)
        if rec.get("status") != "running":
            continue
        pid, created = rec.get("pid"), rec.get("pid_created")
        if (
            isinstance(pid, int)
            and isinstance(created, int | float)
            and _proc.stop_leftover(pid, float(created), grace_s)
        ):
            say(f"{stage.name}: stopped process {pid} left by a killed runner")
        with state.edit(stage.name) as r:
            r.update(status="interrupted", message="the runner was killed", pid=None)


class Runner:
    """Runs a pipeline once in a run directory. Not reusable."""

    def __init__(
        self,
        pipeline: Pipeline,
        options: RunOptions,
        *,
        environ: Mapping[str, str],
        out: TextIO | None = None,
    ) -> None:
        """
        Args:
            pipeline: the validated spec.
            options: run directory and limits.
            environ: the environment stages inherit (the spec's env is layered on top).
            out: console stream (default stdout).
        """
        self.pipeline = pipeline
        self.options = options
        self.run_dir = options.run_dir.resolve()
        self._environ = dict(environ)
        self._console = Console(out)
        self._stop = threading.Event()
        self._stop_signal = 0
        self._events: queue.Queue[tuple[str, str]] = queue.Queue()
        self._attempts = Attempts(self.run_dir, self._console, self._stop, options.stop_grace_s)
        self._values = {
            "python": options.python,
            "pipeline_dir": str(pipeline.pipeline_dir),
            "run_dir": str(self.run_dir),
        }
        self.state: StateFile | None = None

    # -- public ---------------------------------------------------------------------

    def request_stop(self, signum: int = signal.SIGINT) -> None:
        """Stop the running stages (SIGTERM, grace, SIGKILL) and start no more.

        Safe to call from a signal handler.
        """
        if not self._stop_signal:
            self._stop_signal = signum
        self._stop.set()

    def run(self) -> int:
        """Run every stage that is not up to date; see the module docstring for the result.

        Raises:
            SpecError: an input that no stage produces does not exist.
            ConfigError: the run directory is unusable or another runner holds it.
        """
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "logs").mkdir(exist_ok=True)
            lock = (self.run_dir / LOCK_FILE).open("a")
        except OSError as exc:
            raise ConfigError(f"--run-dir {self.run_dir}: unusable ({exc.strerror})") from exc
        try:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                raise ConfigError(
                    f"--run-dir {self.run_dir}: another `flexrun pipeline run` is using it"
                ) from exc
            return self._run_locked()
        finally:
            self._attempts.stop_all()
            lock.close()

    # -- the loop -------------------------------------------------------------------

    def _run_locked(self) -> int:
        self.state = state = StateFile.load(self.run_dir)
        check_paths(self.pipeline, self.run_dir, self._values)
        check_external_inputs(self.pipeline, self.run_dir, self._values)
        reap_leftovers(self.pipeline, state, self.options.stop_grace_s, self._say)
        state.set_meta(
            pipeline=self.pipeline.name,
            spec=self.pipeline.source,
            order=[s.name for s in self.pipeline.stages],
            run_started=time.time(),
            run_finished=None,
            run_status="running",
        )
        outcome: dict[str, str] = {}  # this run: succeeded | failed | interrupted | blocked
        running: set[str] = set()
        failed = False
        while True:
            if not self._stop.is_set() and not failed:
                for stage in self.pipeline.stages:
                    name = stage.name
                    if name in outcome or name in running:
                        continue
                    dep_states = [outcome.get(d) for d in stage.deps]
                    if any(s in ("failed", "blocked", "interrupted") for s in dep_states):
                        outcome[name] = "blocked"
                        self._block(stage)
                        continue
                    if not all(s == "succeeded" for s in dep_states):
                        continue
                    if self.options.max_parallel and len(running) >= self.options.max_parallel:
                        break
                    if self._try_cache(stage):
                        outcome[name] = "succeeded"
                        self._events.put((name, "succeeded"))  # wake the loop: new ready stages
                        continue
                    running.add(name)
                    threading.Thread(
                        target=self._stage_thread, args=(stage,), name=f"stage-{name}", daemon=True
                    ).start()
            if not running and (
                self._stop.is_set() or failed or len(outcome) == len(self.pipeline.stages)
            ):
                break
            try:
                name, result = self._events.get(timeout=0.2)
            except queue.Empty:
                continue
            if name in running:
                running.discard(name)
                outcome[name] = result
                if result != "succeeded":
                    failed = True
        for stage in self.pipeline.stages:
            if stage.name not in outcome:
                self._block(stage)
        if self._stop.is_set():
            code, status = 128 + (self._stop_signal or signal.SIGINT), "interrupted"
        elif failed or any(v != "succeeded" for v in outcome.values()):
            code, status = 1, "failed"
        else:
            code, status = 0, "succeeded"
        state.set_meta(run_finished=time.time(), run_status=status)
        self._say(f"pipeline {self.pipeline.name}: {status}")
        return code

    def _block(self, stage: Stage) -> None:
        assert self.state is not None
        with self.state.edit(stage.name) as r:
            r.update(status="blocked", message="an upstream stage did not succeed", cached=False)

    # -- cache ----------------------------------------------------------------------

    def _inputs(self, stage: Stage) -> dict[str, str | None]:
        out = {}
        for i, raw in enumerate(stage.inputs):
            path = substitute(raw, self._values, f"stages.{stage.name}.inputs[{i}]")
            full = Path(path) if Path(path).is_absolute() else self.run_dir / path
            out[path] = hash_path(full)
        return out

    def _env(self, stage: Stage) -> dict[str, str]:
        where = f"stages.{stage.name}.env"
        env = dict(self.pipeline.env)
        env.update(stage.env)
        out = {k: substitute(v, self._values, where) for k, v in env.items()}
        out.update(checkpoint_env(stage.train))  # the spec's own fields win over env
        return out

    def _key(self, stage: Stage, argv: list[str], inputs: Mapping[str, str | None]) -> str:
        assert self.state is not None
        upstream = {d: str(self.state.stage(d).get("key", "")) for d in stage.deps}
        return stage_key(
            command=argv,
            env=self._env(stage),
            inputs=inputs,
            upstream=upstream,
            extra={"outputs": list(stage.outputs)},
        )

    def _outputs(self, stage: Stage) -> dict[str, str | None]:
        return {o: hash_path(self.run_dir / o) for o in stage.outputs}

    def _try_cache(self, stage: Stage) -> bool:
        assert self.state is not None
        argv = stage_argv(self.pipeline, stage, self._values, self.run_dir)
        key = self._key(stage, argv, self._inputs(stage))
        rec = self.state.stage(stage.name)
        if rec.get("status") != "succeeded" or rec.get("key") != key:
            return False
        if any(h is None for h in self._outputs(stage).values()):
            return False
        with self.state.edit(stage.name) as r:
            r["cached"] = True
        self._say(f"{stage.name}: cached (inputs and command unchanged)")
        return True

    # -- one stage ------------------------------------------------------------------

    def _stage_thread(self, stage: Stage) -> None:
        result = "failed"
        try:
            result = self._run_stage(stage)
        except Exception as exc:  # a bug or an I/O error: fail this stage, keep the runner
            self._say(f"{stage.name}: runner error: {exc!r}")
            assert self.state is not None
            with contextlib.suppress(Exception), self.state.edit(stage.name) as r:
                r.update(status="failed", message=f"runner error: {exc}", pid=None)
        finally:
            self._events.put((stage.name, result))

    def _run_stage(self, stage: Stage) -> str:
        assert self.state is not None
        state = self.state
        argv = stage_argv(self.pipeline, stage, self._values, self.run_dir)
        inputs = self._inputs(stage)
        key = self._key(stage, argv, inputs)
        env = dict(self._environ)
        env.update(self._env(stage))
        env["FLEXRUN_PIPELINE_STAGE"] = stage.name
        env["FLEXRUN_PIPELINE_RUN_DIR"] = str(self.run_dir)
        prev = state.stage(stage.name)
        if stage.train is not None and stage.train.checkpoint_dir is not None:
            rel = stage.train.checkpoint_dir
            ckpt = self.run_dir / rel
            if prev.get("checkpoint_key") not in (None, key) and (
                ckpt.exists() or ckpt.is_symlink()
            ):
                self._say(
                    f"{stage.name}: inputs or command changed; removing stale checkpoints {ckpt}"
                )
                # Checked again here, not only before the run: a symlink planted since.
                remove_below(self.run_dir, rel, f"stages.{stage.name}.train.checkpointDir")
        started = time.time()
        with state.edit(stage.name) as r:
            r.update(
                status="running",
                key=key,
                command=argv,
                inputs=inputs,
                outputs={},
                started=started,
                finished=None,
                duration_s=None,
                attempts=0,
                exit_code=None,
                cached=False,
                message=None,
            )
            if stage.train is not None and stage.train.checkpoint_dir is not None:
                r["checkpoint_key"] = key
        attempts = stage.retries + 1
        status, message, code = "failed", "", None
        for attempt in range(1, attempts + 1):
            if self._stop.is_set():
                status, message = "interrupted", "stopped before it started"
                break
            self._say(f"{stage.name}: attempt {attempt}/{attempts}: {' '.join(argv)}")
            code, how = self._attempts.run(
                stage.name,
                argv,
                env,
                attempt=attempt,
                timeout_s=stage.timeout_s,
                on_start=functools.partial(self._started, stage, attempt=attempt),
            )
            if how == "interrupted":
                status, message = "interrupted", f"stopped by signal (exit {code})"
                break
            if how == "timeout":
                message = f"timed out after {stage.timeout_s:g}s"
            elif code != 0:
                message = f"exit code {code}"
            else:
                missing = [o for o, h in self._outputs(stage).items() if h is None]
                if not missing:
                    status, message = "succeeded", ""
                    break
                message = f"exited 0 but did not write declared output(s): {', '.join(missing)}"
            self._say(f"{stage.name}: attempt {attempt} failed: {message}")
        finished = time.time()
        with state.edit(stage.name) as r:
            r.update(
                status=status,
                exit_code=code,
                finished=finished,
                duration_s=round(finished - started, 3),
                message=message or None,
                pid=None,
                outputs=self._outputs(stage),
            )
        verb = {"succeeded": "succeeded", "interrupted": "interrupted", "failed": "FAILED"}
        tail = f": {message}" if message else ""
        self._say(f"{stage.name}: {verb[status]} in {finished - started:.1f}s{tail}")
        return status

    def _started(self, stage: Stage, pid: int, created: float, *, attempt: int) -> None:
        assert self.state is not None
        with self.state.edit(stage.name) as r:
            r.update(pid=pid, pid_created=created, attempts=attempt)

    def _say(self, message: str) -> None:
        self._console.say(message)


__all__ = [
    "LOCK_FILE",
    "RunOptions",
    "Runner",
    "check_external_inputs",
    "check_paths",
    "reap_leftovers",
    "stage_argv",
    "summarize",
]
