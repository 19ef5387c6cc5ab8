"""What one request through etcd's JSON gateway costs the etcd server, by kind (issue 16).

Starts one etcd (flexrun.testing.etcd_server), sends N requests of each kind the
rendezvous makes from one client thread, and prints the server's CPU per request (from
/proc) and the client's wall time per request; then 8 client threads of ranges for the
throughput. ``python bench/etcd_request_cost.py [N]`` (default 1000), under the CPU lock.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from flexrun.store.etcd import EtcdStore
from flexrun.testing.etcd_server import EtcdCluster


def cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kinds(s: EtcdStore, lease: int, since: int) -> Iterator[tuple[str, Callable[[int], object]]]:
    yield "range", lambda i: s._range("k/a")
    yield "revision", lambda i: s.revision()
    yield "put", lambda i: s.put(f"k/p{i % 50}", b"x" * 200)
    yield "lease_keepalive", lambda i: s._call("/lease/keepalive", {"ID": lease})
    yield "put_with_lease", lambda i: s._call(
        "/kv/put", {"key": "aGIveA==", "value": "eA==", "lease": lease}
    )
    yield "txn_2ranges(get_prefix)", lambda i: s.get_prefix("k/")
    yield "cas_fail", lambda i: s.compare_and_set("k/a", b"z", expected_revision=1)
    yield "watch_open(20ms)", lambda i: s.wait_for_change("k/zz/", since, 0.02)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    with tempfile.TemporaryDirectory() as tmp, EtcdCluster(Path(tmp)) as c:
        proc = c.procs[0]
        assert proc is not None
        pid = proc.pid
        host, port = c.endpoints[0]
        s = EtcdStore([(host, port)])
        s.put("k/a", b"x" * 200)
        lease = s._grant(5)
        for name, fn in kinds(s, lease, s.revision()):
            for i in range(50):
                fn(i)
            k = n if "watch" not in name else n // 5
            c0, t0 = cpu(pid), time.perf_counter()
            for i in range(k):
                fn(i)
            dt = time.perf_counter() - t0
            print(
                f"{name:26} {1000 * (cpu(pid) - c0) / k:6.3f} ms etcd cpu/req  "
                f"{1000 * dt / k:6.2f} ms wall/req",
                flush=True,
            )

        def worker() -> None:
            st = EtcdStore([(host, port)])
            for _ in range(n // 4):
                st._range("k/a")

        c0, t0 = cpu(pid), time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
        total = 8 * (n // 4)
        print(
            f"8 threads range: {total / dt:.0f} req/s, "
            f"{1000 * (cpu(pid) - c0) / total:.3f} ms etcd cpu/req"
        )


if __name__ == "__main__":
    main()
