"""The one list of differences from torchrun the compat suite allows, each with its reason.

The table in docs/user/torchrun.md ("Differences from torchrun") is checked against this dict
(``test_compat_readme.py``), and every check that tolerates a difference names its key
here (``allow(key)`` fails for a key that is not listed), so the two cannot drift.
"""

from __future__ import annotations

ALLOWED: dict[str, str] = {
    "exit-code": (
        "A failed job exits with the failing worker's own code (1..127), or 128+N when it "
        "stopped on signal N; torchrun exits 1 for any worker failure. Kubeflow's ExitCode "
        "policy and pod failure policies can then tell a script bug (permanent) from a "
        "preemption (retryable)."
    ),
    "bad-input-exit": (
        "Bad input that torchrun reports with a Python traceback and exit 1 (a ValueError or "
        "AssertionError at start-up: --module with --no-python, --nproc-per-node gpu without "
        "CUDA, --numa-binding without CUDA) is one line on stderr and exit 2. Errors of "
        "argparse itself exit 2 in both."
    ),
    "launcher-log-lines": (
        "The launcher's own lines on stderr differ (flexrun's start with [flexrun] or "
        "flexrun:; torchrun's are its logger's, its OMP_NUM_THREADS banner, c10d warnings). "
        "The suite compares the workers' lines."
    ),
    "failure-report": (
        "The failure summary on stderr: flexrun prints the root cause (rank, node, exit code, "
        "the error file's message), the failing rank's traceback and its log directory; "
        "torchrun prints a ChildFailedError table."
    ),
    "error-file-path": (
        "A worker's TORCHELASTIC_ERROR_FILE is RUN_DIR/logs/round_N/rank_R/error.json "
        "(torchrun: a file in a temporary directory); what @record writes there is torch's "
        "format in both."
    ),
    "log-dir-layout": (
        "--log-dir holds round_N/rank_R/{stdout,stderr}.log (torchrun: "
        "RUNID_RANDOM/attempt_N/LOCALRANK/{stdout,stderr}.log): rounds and global "
        "ranks, as in flexrun's event log. The files' contents are the same."
    ),
    "log-files-always": (
        "Every worker's stdout and stderr are kept in log files even when nothing is "
        "redirected or tee'd (torchrun writes only the redirected and tee'd streams): the "
        "root cause of a failure is always on disk."
    ),
    "flexrun-variables": (
        "Workers also see FLEXRUN_ROUND, FLEXRUN_RUN_DIR, FLEXRUN_RUN_ID and FLEXRUN_NODE "
        "(restart mode also FLEXRUN_MEMORY_DIR, and live mode its own FLEXRUN variables)."
    ),
    "random-run-id": (
        "Without --rdzv-id, a one-host job's TORCHELASTIC_RUN_ID is standalone-HEX or "
        "local-HEX (torchrun: a uuid4); it names the run directory. An explicit --rdzv-id "
        "is used as given (torchrun ignores it with --standalone)."
    ),
    "socket-ifname": (
        "On a multi-host job workers get GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (=name) "
        "of the interface that reaches the store, unless already set; torchrun leaves gloo on "
        "the host name's address, which hangs where that resolves to a loopback address."
    ),
    "endpoint-means-elastic": (
        "--rdzv-endpoint without --rdzv-backend runs the elastic c10d rendezvous over that "
        "store (torchrun's default backend, static, would take the endpoint as the master of "
        "a static job); --rdzv-backend static keeps torchrun's meaning."
    ),
    "one-host-store-port": (
        "A one-host job without an endpoint hosts its store on a free port (torchrun's c10d "
        "backend without an endpoint takes localhost:29400), so two such jobs never collide."
    ),
    "rdzv-timing-defaults": (
        "last_call_timeout defaults to 1 s (torchrun 30 s), a keep-alive goes every 1 s and a "
        "node is lost after 5 s (torchrun 5 s x 3); heartbeat_timeout is the age after which "
        "a node is lost (torch: one keep-alive write's timeout)."
    ),
    "unknown-rdzv-conf-warns": (
        "An unknown --rdzv-conf key is warned about once, naming it (torchrun ignores it silently)."
    ),
}


def allow(key: str) -> str:
    """The reason for difference ``key`` (a KeyError for a difference nobody documented)."""
    return ALLOWED[key]
