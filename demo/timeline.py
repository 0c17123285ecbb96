"""The demo's timeline picture (PNG): probe latency, completion rate, watchdog state, restart marks.

Built from the watchdog's recording (`--record`: every probe with its latency), its JSON log
events (state changes, detection, each restart step, verification) and, when given, the demo
client's own requests (completions per second and requests waiting, as a user sees them).
Drawn with matplotlib's object API on an Agg canvas (no pyplot state, no display), saved by Pillow
(a matplotlib dependency) as a small palette PNG.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from demo.logevents import LogEvent
from demo.traffic import RATE_WINDOW_SECONDS, TrafficSample, completion_rate, waiting_at
from watchdog.model import Observation, ProbeKind, Role, counter_increase

WIDTH_INCHES, HEIGHT_INCHES, DPI = 12.0, 7.0, 100  # 1200 × 700 pixels
SAMPLE_STEP_SECONDS = 0.5
LATENCY_FLOOR_SECONDS = 0.005  # a refused connection fails in ~1 ms; keep the axis readable
PALETTE_COLOURS = 64
LABEL_ROWS = 5  # marker labels above the top panel, in a staircase so neighbours never overlap

STATE_COLOURS = {
    "warming": "#c6dbef",
    "healthy": "#a1d99b",
    "overloaded": "#fdd0a2",
    "degraded": "#fdae6b",
    "stalled": "#fb6a4a",
    "restarting": "#9e9ac8",
    "verifying": "#dadaeb",
    "held": "#969696",
    "paused": "#d9d9d9",
}
MARKER_COLOURS = {
    "fault": "#d62728",
    "detected": "#e6550d",
    "evidence": "#8c564b",
    "restart": "#6a51a3",
    "operator": "#3182bd",
    "verified": "#2ca02c",
    "failed": "#000000",
}


@dataclass(frozen=True)
class ProbePoint:
    """One completion probe: when it started, how long it took, whether it passed."""

    at: float
    latency_seconds: float
    ok: bool


@dataclass(frozen=True)
class RatePoint:
    """A value of a time series (completions per second, requests waiting) at a moment."""

    at: float
    value: float


@dataclass(frozen=True)
class StateSpan:
    """The watchdog's state of the group between two state changes."""

    start: float
    end: float
    state: str


@dataclass(frozen=True)
class Marker:
    """A moment worth a vertical line: the fault, the detection, a restart step, verification.

    Markers without a label (each unit's restart) get a line only; the co-restart as a whole is
    labelled once, as the shaded span.
    """

    at: float
    label: str
    kind: str  # a key of MARKER_COLOURS


@dataclass(frozen=True)
class RestartSpan:
    """The shaded co-restart: from the first unit restart to the end of the sequence."""

    start: float
    end: float
    label: str


@dataclass(frozen=True)
class Timeline:
    """Everything the picture shows, in unix seconds (drawn relative to t0)."""

    t0: float
    end: float
    probes: tuple[ProbePoint, ...]
    rate: tuple[RatePoint, ...]
    rate_source: str  # what the completion-rate line counts
    waiting: tuple[RatePoint, ...]  # client requests waiting (empty without client traffic)
    states: tuple[StateSpan, ...]
    markers: tuple[Marker, ...]
    restart: RestartSpan | None = None
    title: str = "sglang-watchdog demo"


def probe_points(observations: Iterable[Observation]) -> tuple[ProbePoint, ...]:
    """Every completion probe the watchdog recorded."""
    return tuple(
        ProbePoint(p.started_at, p.duration_seconds, p.ok)
        for obs in observations
        for p in obs.probes
        if p.kind is ProbeKind.COMPLETION
    )


def _steps(start: float, end: float) -> list[float]:
    count = int((end - start) / SAMPLE_STEP_SECONDS) + 1
    return [start + i * SAMPLE_STEP_SECONDS for i in range(max(count, 0))]


def client_rate(
    samples: Sequence[TrafficSample], start: float, end: float
) -> tuple[RatePoint, ...]:
    """The client's completions per second (sliding window), every half second, from the first
    full window on (a partial window would draw a ramp that never happened)."""
    first = min((s.sent_at for s in samples), default=start)
    begin = max(start, first + RATE_WINDOW_SECONDS)
    return tuple(RatePoint(at, completion_rate(samples, at)) for at in _steps(begin, end))


def client_waiting(
    samples: Sequence[TrafficSample], start: float, end: float
) -> tuple[RatePoint, ...]:
    """The client's requests waiting for an answer, every half second."""
    return tuple(RatePoint(at, waiting_at(samples, at)) for at in _steps(start, end))


def served_rate(observations: Sequence[Observation]) -> tuple[RatePoint, ...]:
    """Requests finished per second by decode, from its `num_requests_total` counter (the
    fallback without client samples; it includes the router's health checks)."""
    points = []
    previous: tuple[float, float | None] | None = None
    for obs in observations:
        snap = obs.metrics_for(Role.DECODE)
        if snap is None or not snap.ok:
            continue
        if previous is not None and snap.scraped_at > previous[0]:
            grown = counter_increase(previous[1], snap.requests_total)
            points.append(RatePoint(snap.scraped_at, grown / (snap.scraped_at - previous[0])))
        previous = (snap.scraped_at, snap.requests_total)
    return tuple(points)


def state_spans(events: Sequence[LogEvent], end: float) -> tuple[StateSpan, ...]:
    """The state over time, from watchdog_started (warming) and every state_changed."""
    changes: list[tuple[float, str]] = []
    for event in events:
        if event.name == "watchdog_started" and not changes:
            changes.append((event.at, "warming"))
        elif event.name == "state_changed":
            if not changes:
                changes.append((event.at, str(event.get("old"))))
            changes.append((event.at, str(event.get("new"))))
    if not changes:
        return ()
    spans = []
    for (start, state), (nxt, _) in zip(changes, [*changes[1:], (end, "")], strict=True):
        if nxt > start:
            spans.append(StateSpan(start, nxt, state))
    return tuple(spans)


def markers_from(events: Sequence[LogEvent]) -> tuple[Marker, ...]:
    """The moments of the story, as the watchdog logged them."""
    marks = []
    for event in events:
        if event.name == "stall_detected":
            marks.append(Marker(event.at, f"stall detected: {event.get('verdict')}", "detected"))
        elif event.name == "evidence_captured" and event.get("incident"):
            marks.append(Marker(event.at, "evidence captured", "evidence"))
        elif event.name == "unit_restart_started":
            marks.append(Marker(event.at, "", "restart"))
        elif event.name == "restart_skipped_dry_run":
            marks.append(Marker(event.at, "dry run: plan logged, nothing restarted", "restart"))
        elif event.name == "verification_passed":
            marks.append(Marker(event.at, "verification passed", "verified"))
        elif event.name == "verification_failed":
            marks.append(Marker(event.at, "verification failed", "failed"))
    return tuple(marks)


def restart_span_of(events: Sequence[LogEvent]) -> RestartSpan | None:
    """The first co-restart the watchdog carried out: first unit restart → sequence finished."""
    started = [e for e in events if e.name == "unit_restart_started"]
    if not started:
        return None
    first = started[0].at
    end = next(
        (e.at for e in events if e.name == "restart_sequence_finished" and e.at >= first), None
    )
    if end is None:
        return None
    roles = [str(e.get("role")) for e in started if e.at <= end]
    return RestartSpan(first, end, f"co-restart {' → '.join(roles)} ({end - first:.1f} s)")


def build_timeline(
    observations: Sequence[Observation],
    events: Sequence[LogEvent],
    *,
    t0: float | None = None,
    end: float | None = None,
    traffic: Sequence[TrafficSample] = (),
    extra_markers: Sequence[Marker] = (),
    title: str = "sglang-watchdog demo",
) -> Timeline:
    """Gather the picture's data from a recording, log events and (optionally) client traffic."""
    times = [o.at for o in observations] + [e.at for e in events]
    times += [s.ended_at for s in traffic] + [m.at for m in extra_markers]
    if not times:
        raise ValueError("nothing to draw: no observations, log events or traffic")
    start = t0 if t0 is not None else min(times)
    stop = end if end is not None else max(times)
    if traffic:
        rate, source = client_rate(traffic, start, stop), "client completions/s"
        waiting = client_waiting(traffic, start, stop)
    else:
        rate, source = served_rate(observations), "decode requests finished/s (SGLang counter)"
        waiting = ()
    markers = sorted([*markers_from(events), *extra_markers], key=lambda m: m.at)
    return Timeline(
        t0=start,
        end=stop,
        probes=probe_points(observations),
        rate=rate,
        rate_source=source,
        waiting=waiting,
        states=state_spans(events, stop),
        markers=tuple(markers),
        restart=restart_span_of(events),
        title=title,
    )


# ------------------------------------------------------------------------------------ drawing
def _marker_lines(axes: Sequence[Axes], timeline: Timeline) -> None:
    t0 = timeline.t0
    labels: list[tuple[float, str, str]] = []
    if timeline.restart is not None:
        span = timeline.restart
        for ax in axes:
            ax.axvspan(span.start - t0, span.end - t0, color=MARKER_COLOURS["restart"], alpha=0.15)
        labels.append((span.start, span.label, MARKER_COLOURS["restart"]))
    for m in timeline.markers:
        colour = MARKER_COLOURS.get(m.kind, "#000000")
        style = (0, (1, 2)) if not m.label else "--"
        for ax in axes:
            ax.axvline(m.at - t0, color=colour, lw=1.0, ls=style, alpha=0.9)
        if m.label:
            labels.append((m.at, m.label, colour))
    # A staircase of rows above the top panel: consecutive labels never share a row.
    top = axes[0]
    for row, (at, text, colour) in enumerate(sorted(labels)):
        top.annotate(
            text,
            xy=(at - t0, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, 3 + 12 * (row % LABEL_ROWS)),
            textcoords="offset points",
            fontsize=8.5,
            color=colour,
            ha="left",
            va="bottom",
            annotation_clip=False,
        )


def _probe_panel(ax: Axes, timeline: Timeline) -> None:
    t0 = timeline.t0
    for ok, style in ((True, {"s": 14, "color": "#2ca02c", "marker": "o", "label": "probe ok"}),
                      (False, {"s": 24, "color": "#d62728", "marker": "x",
                               "label": "probe failed"})):  # fmt: skip
        points = [p for p in timeline.probes if p.ok is ok]
        ax.scatter(
            [p.at - t0 for p in points],
            [max(p.latency_seconds, LATENCY_FLOOR_SECONDS) for p in points],
            zorder=3,
            **style,  # type: ignore[arg-type]
        )
    ax.set_yscale("log")
    ax.set_ylim(LATENCY_FLOOR_SECONDS * 0.8, 20)
    ax.set_ylabel("probe latency (s)")
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    ax.grid(True, which="major", alpha=0.3)


def _rate_panel(ax: Axes, timeline: Timeline) -> None:
    t0 = timeline.t0
    ax.plot(
        [r.at - t0 for r in timeline.rate],
        [r.value for r in timeline.rate],
        color="#1f77b4",
        lw=1.6,
        label=timeline.rate_source,
    )
    ax.set_ylabel("completions/s", color="#1f77b4")
    ax.set_ylim(bottom=0, top=max([r.value for r in timeline.rate] + [1.0]) * 1.3)
    ax.grid(True, alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    if timeline.waiting:
        twin = ax.twinx()
        twin.fill_between(
            [w.at - t0 for w in timeline.waiting],
            [w.value for w in timeline.waiting],
            step="post",
            color="#7f7f7f",
            alpha=0.25,
            lw=0,
            label="client requests waiting > 1 s",
        )
        twin.set_ylabel("waiting", color="#636363")
        twin.set_ylim(bottom=0, top=max([w.value for w in timeline.waiting] + [4.0]) * 1.3)
        more_handles, more_names = twin.get_legend_handles_labels()
        handles, names = handles + more_handles, names + more_names
    ax.legend(handles, names, loc="lower left", fontsize=8, framealpha=0.9)


def _state_panel(ax: Axes, timeline: Timeline) -> None:
    t0 = timeline.t0
    span = max(timeline.end - t0, 1.0)
    for s in timeline.states:
        ax.axvspan(s.start - t0, s.end - t0, color=STATE_COLOURS.get(s.state, "#ffffff"), lw=0)
        share = (s.end - s.start) / span
        if share > 0.03:  # narrower spans stay unlabelled rather than spill over neighbours
            middle = (s.start + s.end) / 2 - t0
            size = 8 if share > 0.07 else 6.5
            ax.text(middle, 0.5, s.state, ha="center", va="center", fontsize=size)
    ax.set_yticks([])
    ax.set_ylabel("watchdog\nstate", rotation=0, ha="right", va="center", fontsize=9)
    ax.set_xlabel("seconds since the demo started")


def render_timeline(timeline: Timeline, path: Path) -> Path:
    """Draw the picture to `path` (PNG, 1200 × 700); returns the path."""
    fig = Figure(figsize=(WIDTH_INCHES, HEIGHT_INCHES), dpi=DPI)
    canvas = FigureCanvasAgg(fig)
    probe_ax, rate_ax, state_ax = fig.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [3.0, 2.0, 0.55]}
    )
    _probe_panel(probe_ax, timeline)
    _rate_panel(rate_ax, timeline)
    _state_panel(state_ax, timeline)
    _marker_lines([probe_ax, rate_ax, state_ax], timeline)
    state_ax.set_xlim(0, max(timeline.end - timeline.t0, 1.0))
    fig.suptitle(timeline.title, fontsize=12, y=0.985)
    fig.subplots_adjust(left=0.075, right=0.94, top=0.80, bottom=0.075, hspace=0.08)
    raw = io.BytesIO()
    fig.savefig(raw, format="rgba", dpi=DPI)
    image = Image.frombytes("RGBA", canvas.get_width_height(), raw.getvalue())
    # A chart has few colours: a 64-colour palette looks the same and is a quarter of the size
    # (the picture is committed for the README).
    palette = image.convert("RGB").quantize(colors=PALETTE_COLOURS)
    path.parent.mkdir(parents=True, exist_ok=True)
    palette.save(path, format="PNG", optimize=True)
    return path
