"""The status page for people (/) and its data as JSON (/debug/history).

Rendered on the server from one snapshot and one history view: the worker's verdicts (the same
bodies /health and /live serve), each endpoint's verdict, a latency chart (inline SVG), the last
canaries and the verdict changes. No JavaScript. Every dynamic value goes through ``html.escape``;
every text from the history is already scrubbed of credentials (sidecar.surface.history).
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Sequence
from typing import Any

from sidecar import __version__
from sidecar.core.snapshot import Snapshot
from sidecar.surface.history import Canary, Change, History, View, scrub
from sidecar.surface.report import health_body, iso, live_body
from sidecar.surface.view import About

# The chart's geometry, in SVG user units.
WIDTH, HEIGHT = 760, 190
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 12, 30
OK_COLOUR, FAIL_COLOUR = "#2b8a3e", "#c92a2a"
REFRESH_SECONDS = 5
ENDPOINT_HEAD = ("endpoint", "verdict", "canary", "registered", "failures in a row")
ENDPOINT_HEAD += ("last success", "reason")

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.2em 2em;color:#222;max-width:1150px}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.2em 0 .4em}
table{border-collapse:collapse;width:100%}
th,td{border-bottom:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
.ready,.live,.success{color:#2b8a3e;font-weight:600}
.notready,.notlive,.timeout,.error,.refused,.invalid{color:#c92a2a;font-weight:600}
.unknown{color:#888;font-weight:600}.muted{color:#666}
.verdict{font-size:1.3em}code{font-size:.95em}td:first-child,td:nth-child(2){white-space:nowrap}
"""


def _e(value: object) -> str:
    """Escaped for HTML text and attributes, and scrubbed of credentials (defence in depth)."""
    return html.escape(scrub("" if value is None else str(value)), quote=True)


def _clock(wall: float) -> str:
    """HH:MM:SS.mmm UTC."""
    return iso(wall)[11:23]


def _label(ready: bool | None) -> str:
    return {True: "ready", False: "notready", None: "unknown"}[ready]


def _row(cells: Iterable[str]) -> str:
    return "<tr>" + "".join(cells) + "</tr>"


def _td(value: object, cls: str = "") -> str:
    attr = f' class="{_e(cls)}"' if cls else ""
    return f"<td{attr}>{_e(value)}</td>"


def _table(head: Sequence[str], rows: list[str], empty: str, table_id: str) -> str:
    if not rows:
        return f'<p class="muted" id="{table_id}-empty">{_e(empty)}</p>'
    heads = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join(rows)
    return f'<table id="{table_id}"><thead><tr>{heads}</tr></thead><tbody>{body}</tbody></table>'


def latency_chart(canaries: Sequence[Canary], timeout: float) -> str:
    """An inline SVG: x = finish time, y = latency; failures in red; the timeout dashed."""
    points = sorted(canaries, key=lambda c: c.wall_time)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top = max([timeout * 1.15, *(c.latency for c in points), 1e-3])
    parts = [
        f'<svg id="latency-chart" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
        f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="Canary latency over time">',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="#fafafa" '
        f'stroke="#ccc"/>',
    ]

    def y_of(latency: float) -> float:
        return TOP + plot_h * (1 - min(latency, top) / top)

    for value in (0.0, top / 2, top):
        y = y_of(value)
        parts.append(
            f'<text x="{LEFT - 4}" y="{y + 4:.1f}" font-size="11" text-anchor="end" '
            f'fill="#555">{value * 1000:.0f} ms</text>'
        )
    ty = y_of(timeout)
    parts.append(
        f'<line class="timeout-line" x1="{LEFT}" y1="{ty:.1f}" x2="{LEFT + plot_w}" '
        f'y2="{ty:.1f}" stroke="{FAIL_COLOUR}" stroke-dasharray="6 4" stroke-width="1"/>'
        f'<text x="{LEFT + plot_w - 4}" y="{ty - 4:.1f}" font-size="11" text-anchor="end" '
        f'fill="{FAIL_COLOUR}">timeout {timeout:g} s</text>'
    )
    if not points:
        parts.append(
            f'<text x="{LEFT + plot_w / 2}" y="{TOP + plot_h / 2}" font-size="13" '
            f'text-anchor="middle" fill="#888">no canary yet</text></svg>'
        )
        return "".join(parts)
    first, last = points[0].wall_time, points[-1].wall_time
    span = max(last - first, 1e-6)

    def x_of(wall: float) -> float:
        return LEFT + (plot_w * (wall - first) / span if len(points) > 1 else plot_w / 2)

    line = " ".join(f"{x_of(c.wall_time):.1f},{y_of(c.latency):.1f}" for c in points)
    parts.append(f'<polyline points="{line}" fill="none" stroke="#999" stroke-width="1"/>')
    for c in points:
        colour = OK_COLOUR if c.ok else FAIL_COLOUR
        parts.append(
            f'<circle class="point {_e(c.outcome)}" cx="{x_of(c.wall_time):.1f}" '
            f'cy="{y_of(c.latency):.1f}" r="3.5" fill="{colour}">'
            f"<title>{_e(_clock(c.wall_time))} {_e(c.outcome)} "
            f"{c.latency * 1000:.1f} ms {_e(c.request_id)}</title></circle>"
        )
    base = TOP + plot_h + 16
    parts.append(
        f'<text x="{LEFT}" y="{base}" font-size="11" fill="#555">{_e(_clock(first))} UTC</text>'
        f'<text x="{LEFT + plot_w}" y="{base}" font-size="11" text-anchor="end" '
        f'fill="#555">{_e(_clock(last))} UTC</text></svg>'
    )
    return "".join(parts)


def _canary_rows(canaries: Sequence[Canary]) -> list[str]:
    return [
        _row(
            (
                _td(_clock(c.wall_time)),
                _td(c.endpoint),
                f"<td><code>{_e(c.request_id)}</code></td>",
                _td(c.outcome, c.outcome),
                f'<td class="num">{c.latency * 1000:.1f}</td>',
                _td(c.status_code if c.status_code is not None else "-", "num"),
                _td(c.reason),
            )
        )
        for c in canaries
    ]


def _change_rows(changes: Sequence[Change]) -> list[str]:
    return [
        _row(
            (
                _td(_clock(c.wall_time)),
                _td(f"{c.scope} {c.name}"),
                _td(c.to, c.to),
                _td(c.rule or ""),
                _td(c.reason),
            )
        )
        for c in changes
    ]


def render(
    about: About, snap: Snapshot, view: View, started: float, now: float, wall: float
) -> str:
    """The whole page, from one snapshot and one history view."""
    limits = view.limits
    ready, body = health_body(snap, started, now)
    live, lbody = live_body(snap, started, now)
    status, live_status = body["status"], lbody["status"]
    endpoint_rows = []
    for name, verdict in snap.verdicts.items():
        check = body["checks"][name]
        label = _label(verdict.ready)
        endpoint_rows.append(
            _row(
                (
                    _td(name),
                    _td(label, label),
                    _td(check["canary"]),
                    _td("yes" if check["registered"] else "no"),
                    _td(check["consecutive_failures"], "num"),
                    _td(check["last_success_time"] or "never"),
                    _td(verdict.reason),
                )
            )
        )
    endpoints = _table(
        ENDPOINT_HEAD,
        endpoint_rows,
        "no endpoint",
        "endpoints",
    )
    canaries = _table(
        ("time (UTC)", "endpoint", "request id", "outcome", "latency (ms)", "HTTP", "reason"),
        _canary_rows(view.canaries),
        "no canary yet",
        "canaries",
    )
    changes = _table(
        ("time (UTC)", "what", "to", "rule", "reason"),
        _change_rows(view.changes),
        "no change yet",
        "changes",
    )
    links = " · ".join(
        f'<a href="{_e(path)}">{_e(path)}</a>'
        for path in (about.health_path, about.live_path, "/metrics", "/debug/history")
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{REFRESH_SECONDS}">
<title>health-sidecar: {_e(status)}</title>
<style>{CSS}</style></head>
<body>
<h1>health-sidecar <span class="muted">{_e(__version__)}</span></h1>
<p class="muted">{_e(about.backend)}, {_e(about.mode)};
engine <code>{_e(about.engine_url)}</code>; page rendered {_e(iso(wall))}</p>
<h2>Worker</h2>
<p class="verdict">Readiness: <strong id="readiness" class="{_e(status)}">{_e(status)}</strong>
<span class="muted">(HTTP {200 if ready else 503} on {_e(about.health_path)})</span></p>
<p>Rule <code id="rule">{_e(body["rule"])}</code>: {_e(body["rule_text"])}</p>
<p>Reason: <span id="reason">{_e(body["reason"])}</span></p>
<p class="verdict">Liveness:
<strong id="liveness" class="{_e(live_status)}">{_e(live_status)}</strong>
<span class="muted">(HTTP {200 if live else 503} on {_e(about.live_path)})</span></p>
<p>Reason: <span id="live-reason">{_e(lbody["reason"])}</span></p>
<h2>Endpoints</h2>
{endpoints}
<h2>Canary latency</h2>
{latency_chart(view.canaries, snap.policy.timeout)}
<h2>Verdict changes</h2>
{changes}
<h2>Recent canaries</h2>
<p class="muted">Newest first: {view.successes_kept} successes and {view.failures_kept}
failures (the last {limits["successes"]} successes and the last {limits["failures"]} failures
are kept, apart: a run of successes never pushes a failure out).</p>
{canaries}
<p class="muted">{links}</p>
</body></html>
"""


def history_body(snap: Snapshot, history: History, started: float, now: float) -> dict[str, Any]:
    """/debug/history: what the page shows, as JSON."""
    view = history.view()
    _, body = health_body(snap, started, now)
    _, lbody = live_body(snap, started, now)
    return {
        "status": body["status"],
        "rule": body["rule"],
        "reason": scrub(body["reason"]),
        "live": lbody["status"],
        "live_reason": scrub(lbody["reason"]),
        "endpoints": {
            name: {"status": _label(v.ready), "reason": scrub(v.reason)}
            for name, v in snap.verdicts.items()
        },
        "timeout_seconds": snap.policy.timeout,
        "limits": view.limits,
        "kept": {
            "successes": view.successes_kept,
            "failures": view.failures_kept,
            "changes": view.changes_kept,
        },
        "canaries": [
            {
                "time": iso(c.wall_time),
                "unix_time": round(c.wall_time, 3),
                "endpoint": c.endpoint,
                "request_id": c.request_id,
                "outcome": c.outcome,
                "latency_seconds": round(c.latency, 6),
                "status_code": c.status_code,
                "reason": c.reason,
            }
            for c in view.canaries
        ],
        "changes": [
            {
                "time": iso(c.wall_time),
                "unix_time": round(c.wall_time, 3),
                "scope": c.scope,
                "name": c.name,
                "to": c.to,
                "rule": c.rule,
                "reason": c.reason,
            }
            for c in view.changes
        ],
    }


def page(about: About, snap: Snapshot, history: History, started: float, now: float) -> str:
    return render(about, snap, history.view(), started, now, time.time())
