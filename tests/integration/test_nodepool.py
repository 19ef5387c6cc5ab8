"""`flexrun spares`: a node's warm interpreters, taken by agents started later.

Real daemon, real agents, real signals: the workers are the daemon's processes (same
PIDs), exit codes reach the agent through the daemon (or the spare itself when the daemon
is gone), a worker dies with the agent that took it, and the daemon survives its agents.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import site
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live_support import start_live_node, step_rows, wait_step
from squatter_support import chown_nobody, need_root_and_nobody, squatter
from support import Procs, alive_pids, read_events, wait_for

SCRIPT = """
import json, os, sys, time
import helper_mod  # only on the agent's PYTHONPATH, not the daemon's
out = sys.argv[1]
rank = os.environ["RANK"]
with open(f"{out}.{rank}.json.tmp", "w") as fh:  # (renamed: the test never reads half)
    json.dump({"pid": os.getpid(), "cwd": os.getcwd(), "rank": rank,
               "world": os.environ["WORLD_SIZE"], "helper": helper_mod.VALUE}, fh)
os.replace(f"{out}.{rank}.json.tmp", f"{out}.{rank}.json")
time.sleep(float(os.environ.get("SLEEP", "0")))
sys.exit(int(os.environ.get("CODE_RANK_" + rank, "0")))
"""


def start_spares(procs: Procs, root: Path, count: int, agents: int = 0) -> subprocess.Popen[str]:
    d = procs.start(
        ["spares", "--dir", str(root), "--count", str(count), "--refill-delay", "0"]
        + ["--agents", str(agents)],
        name="spares",
    )
    wait_for(lambda: len(ready_pids(root)) >= count, 90, f"{count} spares ready")
    if agents:
        wait_for(lambda: status(root)["agents_ready"] == agents, 90, "warm agents")
    return d


def ready_pids(root: Path, kind: str = "w") -> set[int]:
    """PIDs of the daemon's idle worker spares (``kind="a"``: agents) that finished
    importing (each writes its ready file)."""
    out = set()
    for f in (root / "spares").glob(f"{kind}*.ready"):
        try:
            out.add(int(f.read_text()))
        except (FileNotFoundError, ValueError):
            continue  # being written or just taken
    return out


def status(root: Path) -> dict:
    res = subprocess.run(
        [sys.executable, "-m", "flexrun", "spares", "--dir", str(root), "--status"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def job(procs: Procs, tmp: Path, name: str, root: Path, nproc: int, **env: str):  # type: ignore[no-untyped-def]
    script = tmp / "w.py"
    script.write_text(SCRIPT)
    lib = tmp / "lib"
    lib.mkdir(exist_ok=True)
    (lib / "helper_mod.py").write_text("VALUE = 42\n")
    work = tmp / f"cwd-{name}"
    work.mkdir()
    args = [
        "run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--spares-dir",
        str(root),
        "--run-dir",
        str(tmp / f"run-{name}"),
        str(script),
        str(tmp / f"out-{name}"),
    ]
    full = {"PYTHONPATH": str(lib), **env}
    p = subprocess.Popen(
        [sys.executable, "-m", "flexrun", *args],
        cwd=work,
        env={**os.environ, **full},
        stdout=open(tmp / f"{name}.out", "w"),  # noqa: SIM115
        stderr=open(tmp / f"{name}.err", "w"),  # noqa: SIM115
        start_new_session=True,
    )
    procs.procs.append(p)  # type: ignore[arg-type]
    return p, work


def outputs(tmp: Path, name: str) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(tmp.glob(f"out-{name}.*.json"))]


@pytest.mark.timeout(240)
def test_an_agent_takes_the_nodes_warm_spares_as_its_workers(procs: Procs) -> None:
    root = procs.tmp / "spares"
    start_spares(procs, root, 2)
    warm = ready_pids(root)
    agent, work = job(procs, procs.tmp, "a", root, 2)
    assert agent.wait(timeout=120) == 0, (procs.tmp / "a.err").read_text()[-3000:]
    outs = outputs(procs.tmp, "a")
    assert {o["pid"] for o in outs} == warm, "the workers are not the daemon's spares"
    assert {o["rank"] for o in outs} == {"0", "1"}
    assert all(o["cwd"] == str(work) and o["world"] == "2" and o["helper"] == 42 for o in outs)
    # Their output went to the rank logs of this run, as a fresh worker's would.
    logs = list((procs.tmp / "run-a").rglob("rank_*/stdout.log"))
    assert len(logs) == 2
    # The daemon refills (--refill-delay 0) and keeps serving.
    wait_for(lambda: status(root)["ready"] == 2, 90, "the daemon to refill")
    assert not ready_pids(root) & warm


@pytest.mark.timeout(240)
def test_exit_codes_and_kill_9_of_a_taken_spare_reach_the_agent(procs: Procs) -> None:
    root = procs.tmp / "spares"
    start_spares(procs, root, 1)
    agent, _ = job(procs, procs.tmp, "code", root, 1, CODE_RANK_0="3")
    assert agent.wait(timeout=120) != 0
    failures = [e for e in read_events(procs.tmp / "run-code") if e["event"] == "failure"]
    assert failures and failures[0]["exit_code"] == 3, failures

    wait_for(lambda: ready_pids(root), 90, "the daemon to refill")
    agent, _ = job(procs, procs.tmp, "kill", root, 1, SLEEP="60")
    (out,) = wait_for(lambda: outputs(procs.tmp, "kill") or None, 60, "the worker to start")
    os.kill(out["pid"], signal.SIGKILL)
    assert agent.wait(timeout=60) != 0
    failures = [e for e in read_events(procs.tmp / "run-kill") if e["event"] == "failure"]
    assert failures and failures[0]["signal"] == "SIGKILL", failures


@pytest.mark.timeout(240)
def test_a_taken_spare_dies_with_its_agent_and_the_daemon_lives_on(procs: Procs) -> None:
    root = procs.tmp / "spares"
    daemon = start_spares(procs, root, 1)
    agent, _ = job(procs, procs.tmp, "a", root, 1, SLEEP="120")
    (out,) = wait_for(lambda: outputs(procs.tmp, "a") or None, 60, "the worker to start")
    os.killpg(agent.pid, signal.SIGKILL)
    agent.wait(timeout=10)
    wait_for(lambda: not alive_pids([out["pid"]]), 20, "the worker to die with its agent")
    assert daemon.poll() is None
    wait_for(lambda: status(root)["ready"] == 1, 90, "the daemon to refill")


@pytest.mark.timeout(240)
def test_workers_outlive_the_daemon_and_keep_their_exit_codes(procs: Procs) -> None:
    root = procs.tmp / "spares"
    daemon = start_spares(procs, root, 2)
    agent, _ = job(procs, procs.tmp, "a", root, 2, SLEEP="4")
    outs = wait_for(
        lambda: len(outputs(procs.tmp, "a")) == 2 and outputs(procs.tmp, "a"), 60, "workers"
    )
    os.killpg(daemon.pid, signal.SIGKILL)  # the daemon and its idle spares (none left idle)
    daemon.wait(timeout=10)
    assert alive_pids([o["pid"] for o in outs]), "the workers died with the daemon"
    assert agent.wait(timeout=60) == 0, (procs.tmp / "a.err").read_text()[-3000:]
    # A job started while no daemon serves the directory starts its workers itself.
    agent, _ = job(procs, procs.tmp, "cold", root, 1)
    assert agent.wait(timeout=120) == 0, (procs.tmp / "cold.err").read_text()[-3000:]


def _flexrun(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flexrun", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def _hostile(root: Path, data: bytes, *, close: bool = True) -> socket.socket | dict:
    """Send ``data`` to the daemon: its answer (``close=False``: the open connection)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(root / "pool.sock"))
    s.sendall(data)
    if not close:
        return s
    with s:
        if not data.endswith(b"\n"):
            s.shutdown(socket.SHUT_WR)
        return dict(json.loads(s.makefile("rb").readline()))


@pytest.mark.timeout(180)
def test_bad_input_is_one_line_and_a_second_daemon_is_refused(procs: Procs) -> None:
    root = procs.tmp / "spares"
    afile = procs.tmp / "afile"
    afile.write_text("")
    wide = procs.tmp / "wide"
    wide.mkdir()
    os.chmod(wide, 0o755)
    link = procs.tmp / "link"
    link.symlink_to(wide)
    for args, needle in (
        (["spares", "--dir", str(root), "--count", "0"], "--count 0"),
        (["spares", "--dir", str(root), "--refill-delay", "-1"], "--refill-delay"),
        (["spares", "--dir", str(root), "--refill-delay", "nan"], "--refill-delay"),
        (["spares", "--dir", str(root), "--status"], "no `flexrun spares` serves"),
        (["spares", "--dir", str(afile)], "is not a directory"),
        (["spares", "--dir", str(afile), "--status"], "is not a directory"),
        (["spares", "--dir", str(wide)], "has mode 0755: it must be 0700 (chmod 700"),
        (["spares", "--dir", str(link)], "is a symlink"),
    ):
        res = _flexrun(*args)
        assert res.returncode == 2 and needle in res.stderr, res.stderr
        assert res.stderr.count("\n") == 1, res.stderr
    assert not list(wide.iterdir())  # refused, not "fixed" nor used
    start_spares(procs, root, 1)
    res = _flexrun("spares", "--dir", str(root))
    assert res.returncode == 2 and "already serves" in res.stderr, res.stderr
    assert status(root)["ready"] == 1  # the first daemon is untouched


@pytest.mark.timeout(180)
def test_the_daemon_answers_hostile_requests_with_errors_and_serves_on(procs: Procs) -> None:
    root = procs.tmp / "spares"
    daemon = start_spares(procs, root, 1)
    silent = _hostile(root, b"", close=False)  # connects and never sends
    assert isinstance(silent, socket.socket)
    for data in (
        b"[1, 2]\n",
        b"null\n",
        b'{"op": ["take"]}\n',
        b'{"op": "take", "count": "1", "interpreter": "x"}\n',
        b'{"op": "take", "count": 1e400, "interpreter": "x"}\n',
        b"\x80\x04\x95\x00garbage\xff\n",
        b"[" * 50_000 + b"\n",
        b"z" * 100_000,
        b'{"op": "status"',
    ):
        reply = _hostile(root, data)
        assert isinstance(reply, dict) and set(reply) == {"error"}, (data[:30], reply)
        assert daemon.poll() is None
    assert status(root)["ready"] == 1  # while the silent client still holds its connection
    with silent:
        assert "no request within" in json.loads(silent.makefile("rb").readline())["error"]
    agent, _ = job(procs, procs.tmp, "a", root, 1)
    assert agent.wait(timeout=120) == 0, (procs.tmp / "a.err").read_text()[-3000:]
    assert daemon.poll() is None and "Traceback" not in procs.stderr("spares")


def _planted(procs: Procs) -> Path:
    """A spares directory of user nobody, who will plant pool.sock in it."""
    need_root_and_nobody()
    root = procs.tmp / "spares"
    root.mkdir(mode=0o700)
    chown_nobody(root)
    return root


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reclaim", [False, True], ids=["nobodys-dir", "reclaimed-dir"])
def test_a_squatted_pool_sock_is_refused_in_one_line_and_gets_nothing(
    procs: Procs, reclaim: bool
) -> None:
    root = _planted(procs)
    script = procs.tmp / "w.py"
    script.write_text("import sys; sys.exit('must not run')\n")
    with squatter(root) as sq:
        if reclaim:  # the directory is this user's again, only the socket gives it away
            os.chown(root, os.geteuid(), os.getegid())
            os.chmod(root, 0o700)
        res = _flexrun(
            "run",
            "--standalone",
            "--spares-dir",
            str(root),
            "--run-dir",
            str(procs.tmp / "run"),
            str(script),
            "--secret-arg",
        )
        stat = _flexrun("spares", "--dir", str(root), "--status")
        got = sq.received()
    needle = "is served by uid" if reclaim else "belongs to uid"
    for r in (res, stat):
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr
    # Connecting is how the squatter's uid is learnt; not a byte nor a descriptor follows.
    assert got == {"connections": 2 if reclaim else 0, "bytes": 0, "fds": 0, "data": ""}
    assert not (procs.tmp / "run").exists()  # nothing ran


@pytest.mark.timeout(300)
def test_a_live_node_joins_with_the_nodes_spare_and_the_first_node_keeps_its_pids(
    procs: Procs, store_server: tuple[str, int]
) -> None:
    host, port = store_server
    root = procs.tmp / "spares-b"

    def agent(name: str, *extra: str) -> subprocess.Popen[str]:
        return start_live_node(  # type: ignore[no-any-return]
            procs, f"{host}:{port}", name, procs.tmp / "p.jsonl", *extra, nproc=1
        )

    a = agent("a")
    wait_step(procs.tmp, 5)
    a_pids = {r["pid"] for r in step_rows(procs.tmp)}
    start_spares(procs, root, 1)
    warm = ready_pids(root)
    t_join = time.time()
    b = agent("b", "--spares-dir", str(root))

    def world_2_pids() -> set[int] | None:
        pids = {r["pid"] for r in step_rows(procs.tmp) if r["ts"] > t_join and r["world"] == 2}
        return pids if len(pids) == 2 else None

    pids = wait_for(world_2_pids, 90, "both nodes' workers to train at world 2")
    assert pids == a_pids | warm, "b's worker is not the node's spare (or a's restarted)"
    n = max(r["step"] for r in step_rows(procs.tmp))
    wait_step(procs.tmp, n + 20)  # both keep training together
    assert a.poll() is None and b.poll() is None
    joined = [
        e
        for name in ("a", "b")
        for e in read_events(procs.tmp / f"run-{name}")
        if e["event"] == "live_joined"
    ]
    by_epoch: dict[int, set[str]] = {}
    for e in joined:
        by_epoch.setdefault(e["epoch"], set()).add(e["checksum"])
    assert len(by_epoch) >= 2 and all(len(s) == 1 for s in by_epoch.values()), by_epoch
    b.send_signal(signal.SIGTERM)  # b's worker (the daemon's process) goes with its agent
    assert b.wait(timeout=60) == 143
    wait_for(lambda: not alive_pids(sorted(warm)), 30, "b's worker to exit")


@pytest.mark.timeout(240)
def test_an_agent_of_another_python_environment_does_not_take_the_spares(procs: Procs) -> None:
    venv = procs.tmp / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    # Another interpreter path that still imports this environment's packages (flexrun,
    # torch): the running environment's site directories, .pth files included, added to the
    # new venv's. (--system-site-packages would give it the base interpreter's, which a
    # fresh venv such as CI's does not install anything into.)
    py = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv / "lib" / py / "site-packages" / "parent_env.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()),
        encoding="utf-8",
    )
    root = procs.tmp / "spares"
    start_spares(procs, root, 1)
    warm = ready_pids(root)
    script = procs.tmp / "w.py"
    script.write_text("import os; print('pid', os.getpid())\n")
    res = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "flexrun", "run", "--standalone"]
        + ["--spares-dir", str(root), "--run-dir", str(procs.tmp / "run"), str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=procs.tmp,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "not taken" in res.stderr, res.stderr[-3000:]
    assert ready_pids(root) == warm  # still there, idle


@pytest.mark.timeout(240)
def test_a_stopped_daemon_does_not_hold_an_agent_back(procs: Procs) -> None:
    root = procs.tmp / "spares"
    daemon = start_spares(procs, root, 1)
    warm = ready_pids(root)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        agent, _ = job(procs, procs.tmp, "a", root, 1)
        assert agent.wait(timeout=120) == 0, (procs.tmp / "a.err").read_text()[-3000:]
        (out,) = outputs(procs.tmp, "a")
        assert out["pid"] not in warm  # started by the agent itself, after the take timed out
        assert "could not take spares" in (procs.tmp / "a.err").read_text()
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    # The daemon carries on (the late request finds its agent gone) and serves the next one.
    wait_for(lambda: status(root)["ready"] == 1, 90, "the daemon to serve again")
    fresh = ready_pids(root)
    agent, _ = job(procs, procs.tmp, "b", root, 1)
    assert agent.wait(timeout=120) == 0, (procs.tmp / "b.err").read_text()[-3000:]
    (out,) = outputs(procs.tmp, "b")
    assert out["pid"] in fresh


@pytest.mark.timeout(240)
def test_the_daemon_survives_a_full_disk(procs: Procs) -> None:
    root = procs.tmp / "spares"
    root.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(root)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        daemon = start_spares(procs, root, 1)
        agent, _ = job(procs, procs.tmp, "a", root, 1, SLEEP="3")
        wait_for(lambda: outputs(procs.tmp, "a") or None, 60, "the worker to start")
        ballast = root / "ballast"
        with open(ballast, "wb") as fh, contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * 65536)  # until ENOSPC
        # Neither the daemon nor the spare can record the exit: the agent says so and
        # reports the worker as killed; the daemon stays up.
        assert agent.wait(timeout=60) != 0
        assert "no exit status was recorded" in (procs.tmp / "a.err").read_text()
        assert daemon.poll() is None
        ballast.unlink()
        assert status(root)["handed_out"] == 0
    finally:
        procs.cleanup()
        subprocess.run(["umount", "-l", str(root)], capture_output=True, timeout=30)


@pytest.mark.timeout(300)
def test_flexrun_run_hands_itself_to_a_warm_agent(procs: Procs) -> None:
    root = procs.tmp / "spares"
    start_spares(procs, root, 1, agents=1)
    (agent_pid,) = ready_pids(root, "a")
    client, work = job(procs, procs.tmp, "ok", root, 1)
    assert client.wait(timeout=120) == 0, (procs.tmp / "ok.err").read_text()[-3000:]
    (out,) = outputs(procs.tmp, "ok")
    assert out["cwd"] == str(work) and out["helper"] == 42  # the client's cwd and PYTHONPATH
    assert f"handed agent a{procs.procs[0].pid}" in (procs.tmp / "spares.err").read_text()
    # The agent's console output reached the client's stderr.
    assert "round 1" in (procs.tmp / "ok.err").read_text()
    assert not alive_pids([agent_pid])

    # Exit codes are the agent's own (same as a cold `flexrun run`).
    wait_for(lambda: status(root)["agents_ready"] == 1, 90, "a new warm agent")
    client, _ = job(procs, procs.tmp, "code", root, 1, CODE_RANK_0="3")
    cold = subprocess.run(
        [sys.executable, "-m", "flexrun", "run", "--standalone", str(procs.tmp / "w.py")]
        + [str(procs.tmp / "out-cold")],
        env={**os.environ, "PYTHONPATH": str(procs.tmp / "lib"), "CODE_RANK_0": "3"},
        cwd=procs.tmp,
        capture_output=True,
        timeout=120,
    )
    assert client.wait(timeout=120) == cold.returncode != 0

    # SIGTERM to the client reaches the agent (preemption: 143, workers stopped).
    wait_for(lambda: status(root)["agents_ready"] == 1, 90, "a new warm agent")
    (agent_pid,) = ready_pids(root, "a")
    client, _ = job(procs, procs.tmp, "term", root, 1, SLEEP="60")
    (out,) = wait_for(lambda: outputs(procs.tmp, "term") or None, 60, "the worker to start")
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=60) == 143
    wait_for(lambda: not alive_pids([agent_pid, out["pid"]]), 30, "agent and worker to end")

    # kill -9 of the client is kill -9 of the agent: agent and worker die.
    wait_for(lambda: status(root)["agents_ready"] == 1, 90, "a new warm agent")
    (agent_pid,) = ready_pids(root, "a")
    client, _ = job(procs, procs.tmp, "kill", root, 1, SLEEP="60")
    (out,) = wait_for(lambda: outputs(procs.tmp, "kill") or None, 60, "the worker to start")
    os.kill(client.pid, signal.SIGKILL)
    client.wait(timeout=10)
    wait_for(lambda: not alive_pids([agent_pid, out["pid"]]), 30, "agent and worker to die")
