"""``flexrun report``: a run's :class:`~flexrun.observe.analysis.RunAnalysis` as one
self-contained ``report.html``.

Owns rendering: the timeline and time-lost figures (matplotlib, Agg) embedded as base64 so
the page opens offline, and the HTML tables. What the numbers mean (incidents, productive
time, ETTR) is :mod:`flexrun.observe.analysis`'s.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from flexrun.errors import ConfigError
from flexrun.observe.analysis import RunAnalysis, analyze, load_events

REPORT_FILE = "report.html"
TIMELINE_PNG = "report_timeline.png"
LOST_PNG = "report_time_lost.png"

# -- figures ------------------------------------------------------------------------------
_MARK_STYLE = {
    "failure": ("x", "tab:red"),
    "restart": ("|", "tab:orange"),
    "join": ("^", "tab:green"),
    "checkpoint": (".", "tab:blue"),
    "preempted": ("v", "tab:purple"),
    "node_lost": ("X", "tab:brown"),
    "hang_detected": ("s", "tab:pink"),
}


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def throughput_segments(
    points: list[tuple[float, float]], breaks: list[float], *, gap_factor: float = 5.0
) -> list[tuple[float, float]]:
    """``points`` with a NaN inserted wherever the line must not be drawn across.

    A break is an incident between two reports, or a silence longer than ``gap_factor``
    times the median interval between reports (training stopped, nothing said why).
    """
    if len(points) < 2:
        return list(points)
    gaps = sorted(b[0] - a[0] for a, b in pairwise(points))
    limit = gap_factor * gaps[len(gaps) // 2]
    out = [points[0]]
    for prev, cur in pairwise(points):
        if cur[0] - prev[0] > limit or any(prev[0] < b <= cur[0] for b in breaks):
            out.append(((prev[0] + cur[0]) / 2, math.nan))
        out.append(cur)
    return out


def plot_timeline(a: RunAnalysis) -> bytes:
    """World size and steps/s over time, incidents shaded, events marked; PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    t0 = a.start_ts
    fig = Figure(figsize=(10, 5.5))
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    # world size: the round's size while it trains, 0 while (re)forming
    xs, ys = [0.0], [0]
    for n in sorted(a.rounds):
        xs.append(a.rounds[n]["ts"] - t0)
        ys.append(a.rounds[n]["world_size"])
    for inc in a.incidents:
        if inc.cause != "store_outage":
            xs.append(inc.ts - t0)
            ys.append(0)
    pts = sorted(zip(xs, ys, strict=True))
    pts.append((a.end_ts - t0, pts[-1][1] if pts else 0))
    ax1.step([p[0] for p in pts], [p[1] for p in pts], where="post", color="tab:blue", lw=2)
    ax1.set_ylabel("world size (workers)")
    ax1.set_ylim(bottom=0, top=max([p[1] for p in pts] + [1]) * 1.25)
    ax1.grid(alpha=0.3)
    for inc in a.incidents:
        end = inc.recovered_ts if inc.recovered_ts is not None else a.end_ts
        color = "tab:gray" if inc.cause == "store_outage" else "tab:red"
        for ax in (ax1, ax2):
            ax.axvspan(inc.ts - t0, end - t0, color=color, alpha=0.15, lw=0)
        ax1.annotate(inc.cause, (inc.ts - t0, ax1.get_ylim()[1] * 0.9), fontsize=8, color=color)
    if a.throughput:
        line = throughput_segments(a.throughput, [inc.ts for inc in a.incidents])
        ax2.plot([t - t0 for t, _ in line], [v for _, v in line], color="tab:green")
    else:
        ax2.text(
            0.5,
            0.5,
            "no throughput reported (train_metrics events)",
            ha="center",
            va="center",
            transform=ax2.transAxes,
            color="gray",
        )
    ax2.set_ylabel("steps/s")
    ax2.set_xlabel("seconds since the run started")
    ax2.grid(alpha=0.3)
    seen: set[str] = set()
    top = max([v for _, v in a.throughput] + [1.0])
    for ts, kind, _label in a.marks:
        marker, color = _MARK_STYLE.get(kind, ("o", "black"))
        ax2.scatter(
            [ts - t0],
            [top * 1.08],
            marker=marker,
            color=color,
            s=40,
            label=kind if kind not in seen else None,
            zorder=3,
        )
        seen.add(kind)
    ax2.set_ylim(bottom=0, top=top * 1.2)
    if seen:
        ax2.legend(loc="lower right", fontsize=8, ncols=min(len(seen), 4))
    ax1.set_title(f"run {', '.join(a.run_ids)}: world size and throughput")
    return _png(fig)


def plot_lost(a: RunAnalysis) -> bytes:
    """Time lost per cause next to productive time; PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    lost = a.lost_by_cause()
    labels = ["productive", *lost]
    values = [a.productive_s, *lost.values()]
    colors = ["tab:green"] + ["tab:red"] * len(lost)
    fig = Figure(figsize=(7, 3.2))
    ax = fig.subplots()
    ax.barh(labels, values, color=colors)
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.1f}s", va="center", fontsize=8)
    ettr = f"{a.ettr:.1%}" if a.ettr is not None else "n/a"
    ax.set_title(f"ETTR {ettr} of {a.wall_s:.1f}s wall time")
    ax.set_xlabel("seconds")
    ax.invert_yaxis()
    return _png(fig)


# -- HTML ---------------------------------------------------------------------------------
def _fmt_s(v: float | None) -> str:
    return "not recovered" if v is None else f"{v:.2f} s"


def _table(head: Iterable[str], rows: Iterable[Iterable[Any]]) -> str:
    h = "".join(f"<th>{html.escape(str(c))}</th>" for c in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def render_html(a: RunAnalysis, figures: Mapping[str, bytes]) -> str:
    """The report page; ``figures`` maps a caption to PNG bytes (embedded as base64)."""
    import time

    def when(ts: float) -> str:
        return f"+{ts - a.start_ts:.1f}s"

    ettr = f"{a.ettr:.1%}" if a.ettr is not None else "n/a"
    basis = (
        "Productive time is when rank 0 reported training steps."
        if a.productive_basis == "train_metrics"
        else "No training steps were reported (train_metrics), so productive time is the "
        "time every node's workers were up."
    )
    exit_codes = sorted({str(f.get("exit_code")) for f in a.node_finish.values()})
    summary = _table(
        ["job", "nodes", "started", "wall time", "productive", "ETTR", "incidents", "exit code"],
        [
            [
                ", ".join(a.run_ids),
                ", ".join(a.nodes),
                time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(a.start_ts)),
                f"{a.wall_s:.1f} s",
                f"{a.productive_s:.1f} s",
                ettr,
                len(a.incidents),
                ", ".join(exit_codes) or "still running",
            ]
        ],
    )
    incidents = (
        _table(
            ["#", "time", "cause", "detail", "round", "world size", "recovery", "time lost"],
            [
                [
                    i + 1,
                    when(inc.ts),
                    inc.cause,
                    inc.detail,
                    f"{inc.interrupted_round} -> {inc.recovered_round}"
                    if inc.recovered_round is not None
                    else str(inc.interrupted_round),
                    f"{inc.world_before} -> {inc.world_after}"
                    if inc.world_after is not None
                    else "-",
                    _fmt_s(inc.duration_s),
                    f"{inc.lost_s:.2f} s" if inc.cause != "store_outage" else "0 (kept training)",
                ]
                for i, inc in enumerate(a.incidents)
            ],
        )
        if a.incidents
        else "<p>No incidents: the job ran undisturbed.</p>"
    )
    lost = a.lost_by_cause()
    lost_rows = [
        [c, f"{v:.2f} s", f"{v / a.wall_s:.1%}" if a.wall_s else "-"] for c, v in lost.items()
    ]
    lost_table = _table(["cause", "time lost", "share of wall time"], lost_rows)
    nodes = (
        _table(
            ["node", "exit code", "wall", "productive", "ETTR (agent)", "failure ETTR (agent)"],
            [
                [
                    n,
                    f.get("exit_code"),
                    f.get("wall_s"),
                    f.get("productive_s"),
                    f.get("ettr"),
                    f.get("failure_ettr"),
                ]
                for n, f in sorted(a.node_finish.items())
            ],
        )
        if a.node_finish
        else ""
    )
    res_rows = [
        [
            n,
            s["samples"],
            f"{s['cpu_mean_ratio']:.0%}",
            f"{s['cpu_max_ratio']:.0%}",
            f"{s['mem_max_bytes'] / 2**30:.2f} / {s['mem_total_bytes'] / 2**30:.1f} GiB",
            f"{s['net_rx_bytes'] / 2**20:.1f} / {s['net_tx_bytes'] / 2**20:.1f} MiB",
            "; ".join(
                f"gpu{i}: {g['util_mean_ratio']:.0%} avg, {g['temp_max_c']:.0f} C max"
                for i, g in (s.get("gpus") or {}).items()
            )
            or "-",
        ]
        for n, s in a.resources.items()
    ]
    resources = (
        _table(
            ["node", "samples", "CPU mean", "CPU max", "memory max", "net rx / tx", "GPUs"],
            res_rows,
        )
        if res_rows
        else "<p>No resource samples in the event log.</p>"
    )
    ckpt = (
        f"<p>{len(a.checkpoints)} checkpoint(s) saved; last at step "
        f"{html.escape(str(a.checkpoints[-1].get('step')))}.</p>"
        if a.checkpoints
        else "<p>No checkpoints recorded.</p>"
    )
    figs = "".join(
        f'<figure><img alt="{html.escape(cap)}" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode()}"><figcaption>{html.escape(cap)}</figcaption></figure>'
        for cap, png in figures.items()
    )
    title = f"flexrun report: {', '.join(a.run_ids)}"
    skipped = (
        f"<p><b>{a.skipped_events} malformed event line(s) skipped</b> (not JSON, not "
        "UTF-8, or a timestamp, event name or round of the wrong type).</p>"
        if a.skipped_events
        else ""
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}}
table{{border-collapse:collapse;margin:.5em 0 1.5em}}
th,td{{border:1px solid #ccc;padding:.3em .6em;text-align:left;font-size:.9em}}
th{{background:#f3f3f3}} img{{max-width:100%}} figcaption{{color:#666;font-size:.85em}}
</style></head><body>
<h1>{html.escape(title)}</h1>
{skipped}{summary}
{figs}
<h2>Incidents</h2>
{incidents}
<h2>Time lost per cause</h2>
<p>ETTR (productive time / wall time): <b>{ettr}</b>. {basis}
Recovery: from the incident until every node of the new round had started its workers;
time lost: until training steps were reported again.</p>
{lost_table}
<h2>Nodes</h2>
{nodes}
<h2>Node resources</h2>
{resources}
<h2>Checkpoints</h2>
{ckpt}
</body></html>
"""


def write_report(
    paths: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Merge the logs under ``paths`` and write ``report.html`` and the PNGs; return the page.

    Raises:
        ConfigError: as :func:`build_report`.
    """
    return build_report(paths, out_dir)[0]


def build_report(
    paths: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str] | None = None
) -> tuple[Path, RunAnalysis]:
    """:func:`write_report`, also returning the analysis (its ``skipped_events`` counts the
    malformed event lines left out).

    ``out_dir`` defaults to the first path (its directory when it is a file).

    Raises:
        ConfigError: no paths, no event logs, empty logs, or an unwritable output directory.
    """
    if not paths:
        raise ConfigError("flexrun report: give at least one run directory")
    skipped: list[int] = []
    events = load_events(paths, skipped=skipped)
    bad: int = skipped[0] if skipped else 0
    if not events and bad:
        where = ", ".join(str(p) for p in paths)
        raise ConfigError(
            f"{where}: no usable event, {bad} malformed line(s) "
            "(not an event log, or a damaged one: binary, not UTF-8 or not JSON events)"
        )
    analysis = analyze(events)
    analysis.skipped_events += bad
    first = Path(paths[0])
    out = Path(out_dir) if out_dir is not None else (first if first.is_dir() else first.parent)
    figures = {
        "World size and throughput over time (red: interruptions until recovered)": plot_timeline(
            analysis
        ),
        "Productive time and time lost per cause": plot_lost(analysis),
    }
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, png in zip((TIMELINE_PNG, LOST_PNG), figures.values(), strict=True):
            (out / name).write_bytes(png)
        page = out / REPORT_FILE
        page.write_text(render_html(analysis, figures), encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{out}: cannot write the report ({exc.strerror})") from exc
    return page, analysis
