"""What a warm pool of N spares costs: fresh interpreters against forks of one zygote.

For each kind, starts a :class:`flexrun.spares.pool.WarmPool` of ``--spares`` (default 4)
spares, waits until all are ready, and reports the wall time until then, the CPU time
its processes used (the zygote's included), and each spare's memory from
``/proc/PID/smaps_rollup`` (RSS, PSS, USS = private pages), the pool's total PSS; for the
fork server, also how long a refill of all of them takes once they were taken. Idle
spares only: a forked spare that becomes a worker makes private the pages it writes.
With ``--preload a,b`` it measures pools without and with ``--spare-preload a,b``.

    python bench/bench_spares_memory.py [--spares 4] [--preload transformers,lightning]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from flexrun.spares.pool import WarmPool
from flexrun.spares.protocol import PRELOAD_ENV


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int) -> dict[str, float]:
    kb: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value, *_ = line.split()
        kb[key.rstrip(":")] = int(value)
    uss = kb["Private_Clean"] + kb["Private_Dirty"]
    return {"rss": kb["Rss"] / 1024, "pss": kb["Pss"] / 1024, "uss": uss / 1024}


def measure(n: int, fork: bool, root: Path, preload: str = "") -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != PRELOAD_ENV}
    if preload:
        env[PRELOAD_ENV] = preload
    pool = WarmPool(n, env, root, fork_server=fork, max_booting=n)
    try:
        t0 = time.monotonic()
        while True:
            pool.fill()
            if len(pool.spares) == n and all(r.exists() for _, r in pool.spares):
                break
            time.sleep(0.02)
        wall = time.monotonic() - t0
        time.sleep(1.0)  # (settled)
        pids = [w.proc.pid for w, _ in pool.spares]
        zygote = pool._zygote.worker.proc.pid if pool._zygote and pool._zygote.worker else None
        everyone = pids + ([zygote] if zygote else [])
        mem = [memory_mib(p) for p in pids]
        avg = {k: sum(m[k] for m in mem) / n for k in ("rss", "pss", "uss")}
        total = sum(memory_mib(p)["pss"] for p in everyone)
        kind = "forked from a zygote" if fork else "fresh interpreters"
        kind += f", preloading {preload}" if preload else ""
        out = [
            f"{kind}: {n} spares ready in {wall:.2f} s, {sum(cpu_s(p) for p in everyone):.2f} s "
            f"of CPU; per spare RSS {avg['rss']:.0f} MiB, PSS {avg['pss']:.0f}, USS "
            f"{avg['uss']:.1f}; the pool's PSS in all {total:.0f} MiB"
        ]
        if zygote:
            z = memory_mib(zygote)
            out.append(
                f"  the zygote: RSS {z['rss']:.0f} MiB, PSS {z['pss']:.0f}, USS {z['uss']:.1f}"
            )
            for _ in range(n):
                w = pool.take()
                assert w is not None and w.proc.stdin is not None
                w.proc.stdin.close()  # (end of input: an idle spare exits 0)
                w.proc.wait(10)
            t0 = time.monotonic()
            pool.fill()
            while not all(r.exists() for _, r in pool.spares):
                time.sleep(0.002)
            out.append(f"  a refill of all {n} by fork: ready in {time.monotonic() - t0:.3f} s")
        return out
    finally:
        pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spares", type=int, default=4)
    ap.add_argument("--preload", default="", help="also measure with these modules preloaded")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="flexrun-spares-mem-"))
    try:
        for preload in [""] + ([a.preload] if a.preload else []):
            for fork in (False, True):
                root = work / f"{'fork' if fork else 'fresh'}{'-pre' if preload else ''}"
                for line in measure(a.spares, fork, root, preload):
                    print(line, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
