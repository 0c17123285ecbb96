"""Turns the bench's raw run results into statistics, bench/results.md, results.json and a plot.

Everything here is pure (dicts in, text or numbers out) except `write_outputs`, which writes the
three files, and `main`, which re-renders results.md and the plot from a results.json (after a
change to the wording, without rerunning the bench); the plot needs no display (Agg canvas).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

BASELINE_TITLES = {
    "k8s_liveness": "k8s liveness (/health)",
    "router_health": "router /health + /readiness",
    "prometheus_rule": "Prometheus rule",
    "prometheus_rule_literal": "Prometheus rule, literal",
}
MAIN_BASELINES = ("k8s_liveness", "router_health", "prometheus_rule")


# --------------------------------------------------------------------------- statistics


def median(values: Sequence[float]) -> float | None:
    """The median, or None for no values."""
    return percentile(values, 50.0)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_stats(values: Sequence[float | None], unit_seconds: float) -> dict[str, Any]:
    """Detected count, median and p95 (seconds and in `unit_seconds`) of per-run latencies."""
    found = [v for v in values if v is not None]
    med = median(found)
    p95 = percentile(found, 95.0)
    return {
        "runs": len(values),
        "detected": len(found),
        "values_s": [None if v is None else round(v, 3) for v in values],
        "median_s": None if med is None else round(med, 3),
        "p95_s": None if p95 is None else round(p95, 3),
        "median_periods": None if med is None else round(med / unit_seconds, 2),
        "p95_periods": None if p95 is None else round(p95 / unit_seconds, 2),
    }


def histogram_quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """PromQL histogram_quantile over cumulative `le -> count` buckets (+Inf included)."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    rank = q * items[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in items:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return items[-1][0]


def _ok_runs(runs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in runs if "error" not in r]


def probe_share(runs: Iterable[Mapping[str, Any]], key: str | None = None) -> float | None:
    """Probes / requests served by decode, summed over the runs (from `run[key]` if given)."""
    probes = served = 0.0
    for run in runs:
        source = (run.get(key) or {}) if key else run
        probes += float(source.get("probes_total") or 0.0)
        served += float(source.get("served_requests") or 0.0)
    return None if served <= 0 else probes / served


def fault_summary(runs: Sequence[Mapping[str, Any]], period_seconds: float) -> dict[str, Any]:
    """Detection statistics of one fault scenario's repetitions."""
    ok = _ok_runs(runs)
    wd = [r["watchdog"] for r in ok]
    summary: dict[str, Any] = {
        "runs": len(runs),
        "errors": [r["error"] for r in runs if "error" in r],
        "window_s": min((float(r.get("window_s", 0.0)) for r in ok), default=None),
        "watchdog": latency_stats([w["decision_after_s"] for w in wd], period_seconds),
        "watchdog_alert": latency_stats([w["alert_after_s"] for w in wd], period_seconds),
        "verdicts": dict(Counter(str(w["decision_verdict"]) for w in wd if w["decision_verdict"])),
        "alert_verdicts": dict(Counter(str(w["alert_verdict"]) for w in wd if w["alert_verdict"])),
        "false_restarts_before_fault": sum(int(w["decisions_before_t0"]) for w in wd),
        "probe_share": probe_share(ok, "before_fault"),
        "baselines": {},
    }
    for name in BASELINE_TITLES:
        values = [r["baselines"][name]["first_after_s"] for r in ok]
        stats = latency_stats(values, period_seconds)
        stats["fired_before_fault"] = sum(int(r["baselines"][name]["fired_before_t0"]) for r in ok)
        summary["baselines"][name] = stats
    wd_median = summary["watchdog"]["median_s"]
    prom_median = summary["baselines"]["prometheus_rule"]["median_s"]
    summary["speedup_vs_prometheus"] = (
        None if not wd_median or prom_median is None else round(prom_median / wd_median, 2)
    )
    return summary


def benign_summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """False restarts, alerts and baseline firings of one benign scenario's repetitions."""
    ok = _ok_runs(runs)
    wd = [r["watchdog"] for r in ok]
    decisions = [int(w["decisions_total"]) for w in wd]
    metric = [float(r.get("restarts_metric_dry_run", 0.0)) for r in ok]
    return {
        "runs": len(runs),
        "errors": [r["error"] for r in runs if "error" in r],
        "window_s": min((float(r.get("window_s", 0.0)) for r in ok), default=None),
        "false_restarts": sum(decisions),
        "false_restarts_metric": sum(metric),
        "runs_with_false_restart": sum(1 for d in decisions if d > 0),
        "restart_verdicts": dict(
            Counter(str(w["decision_verdict"]) for w in wd if w["decision_verdict"])
        ),
        "alerts": sum(int(w["alerts_total"]) for w in wd),
        "alert_verdicts": dict(Counter(str(w["alert_verdict"]) for w in wd if w["alert_verdict"])),
        "probe_share": probe_share(ok),
        "baselines": {
            name: {
                "runs_fired": sum(1 for r in ok if r["baselines"][name]["fires"] > 0),
                "fires": sum(int(r["baselines"][name]["fires"]) for r in ok),
            }
            for name in BASELINE_TITLES
        },
    }


# --------------------------------------------------------------------------- markdown


def _s(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _latency_cell(stats: Mapping[str, Any], window: float | None, *, periods: bool = True) -> str:
    if stats["detected"] == 0:
        within = "" if window is None else f" in {_s(window, 0)} s"
        return f"never (0/{stats['runs']} runs{within})"
    cell = f"{_s(stats['median_s'])} / {_s(stats['p95_s'])} s"
    if periods:
        cell += f" ({_s(stats['median_periods'])} / {_s(stats['p95_periods'])} periods)"
    if stats["detected"] < stats["runs"]:
        cell += f", {stats['detected']}/{stats['runs']} runs"
    return cell


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f} %"


def fault_table(scenarios: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown rows of the fault scenarios."""
    rows = [
        "| fault | watchdog restart decision, median / p95 | verdict | watchdog first alert, "
        "median | k8s liveness | router health | Prometheus rule | vs Prometheus | probe share "
        "before the fault |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario in scenarios:
        if scenario["kind"] != "fault":
            continue
        s = scenario["summary"]
        window = s["window_s"]
        verdicts = ", ".join(f"{k} ×{v}" for k, v in s["verdicts"].items()) or "–"
        alert = s["watchdog_alert"]
        alert_cell = (
            "–"
            if alert["detected"] == 0
            else f"{_s(alert['median_s'])} s ({', '.join(s['alert_verdicts'])})"
        )
        speedup = s["speedup_vs_prometheus"]
        if speedup is not None:
            versus = f"{speedup:.1f}x faster"
        elif s["watchdog"]["detected"] and not s["baselines"]["prometheus_rule"]["detected"]:
            versus = "finite vs never"
        else:
            versus = "–"
        cells = [
            f"{scenario['title']} (`{scenario['name']}`)",
            _latency_cell(s["watchdog"], window),
            verdicts,
            alert_cell,
            *(_latency_cell(s["baselines"][b], window, periods=False) for b in MAIN_BASELINES),
            versus,
            _pct(s["probe_share"]),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def benign_table(scenarios: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown rows of the benign scenarios."""
    rows = [
        "| benign load | false restarts (runs) | watchdog alerts | k8s liveness fired | "
        "router health fired | Prometheus rule fired | literal rule fired | probe share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scenario in scenarios:
        if scenario["kind"] != "benign":
            continue
        s = scenario["summary"]
        n = s["runs"] - len(s["errors"])
        restarts = f"**{s['false_restarts']}** ({s['runs_with_false_restart']}/{n})"
        if s["restart_verdicts"]:
            restarts += " " + ", ".join(s["restart_verdicts"])
        alerts = str(s["alerts"])
        if s["alert_verdicts"]:
            alerts += " (" + ", ".join(s["alert_verdicts"]) + ")"
        fired = [
            f"{s['baselines'][b]['runs_fired']}/{n} runs"
            for b in (*MAIN_BASELINES, "prometheus_rule_literal")
        ]
        cells = [f"{scenario['title']} (`{scenario['name']}`)", restarts, alerts, *fired]
        cells.append(_pct(s["probe_share"]))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def recovery_rows(recovery: Mapping[str, Any]) -> list[str]:
    """Markdown lines of the systemd-sandbox recovery measurement."""
    if recovery.get("status") != "measured":
        return [f"Not measured: {recovery.get('reason', recovery.get('status'))}."]
    rows = [
        "| fault | runs | stall decision, median / p95 | verified recovery, median / p95 | "
        "verification failed | healthy again, median | serving afterwards | verdicts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    failures: list[str] = []
    for name, s in recovery["summary"].items():
        verdicts = ", ".join(f"{k} ×{v}" for k, v in s["verdicts"].items()) or "–"
        failed = s.get("verification_failed", [])
        healthy = s.get("healthy_again", {})
        rows.append(
            f"| `{name}` | {s['runs']} | {_latency_cell(s['detection'], None)} | "
            f"{_latency_cell(s['recovery'], None)} | {len(failed)}/{s['runs']} | "
            f"{_s(healthy.get('median_s'))} s | {s['served_after']}/{s['runs']} | {verdicts} |"
        )
        failures += [
            f"- `{name}`: verification failed {f['after_s']:.1f} s after the fault: {f['reasons']}"
            for f in failed
        ]
    if failures:
        rows += ["", "Failed verifications (the daemon's reasons):", "", *failures]
    return rows


def _target(name: str, measured: str, target: str, met: bool | None) -> str:
    verdict = "n/a" if met is None else ("met" if met else "**missed**")
    return f"| {name} | {measured} | {target} | {verdict} |"


def targets(results: Mapping[str, Any]) -> list[str]:
    """The targets (docs/architecture.md, "Targets") against the measured values."""
    scenarios = results["scenarios"]
    timings = results["settings"]["watchdog_timings"]
    period = float(timings["period_seconds"])
    bound = float(timings["timeout_seconds"]) + 2 * period
    false_restarts = sum(
        s["summary"]["false_restarts"] for s in scenarios if s["kind"] == "benign"
    ) + sum(s["summary"]["false_restarts_before_fault"] for s in scenarios if s["kind"] == "fault")
    rows = ["| target | measured | target | |", "|---|---|---|---|"]
    rows.append(
        _target(
            "false restarts (benign runs, and fault runs before the fault)",
            str(false_restarts),
            "0",
            false_restarts == 0,
        )
    )
    silent = [s for s in scenarios if s["name"] in SILENT_STALLS]
    for s in silent:
        stats = s["summary"]["watchdog"]
        p95 = stats["p95_s"]
        measured = "never" if p95 is None else f"{p95:.1f} s ({p95 / period:.1f} periods)"
        measured += _missing(stats)
        rows.append(
            _target(
                f"silent-stall detection p95, `{s['name']}`",
                measured,
                f"≤ timeout + 2 periods = {bound:g} s",
                p95 is not None and p95 <= bound and stats["detected"] == stats["runs"],
            )
        )
    recovery = (results.get("recovery") or {}).get("summary") or {}
    for s in scenarios:
        if s["kind"] != "fault":
            continue
        summary = s["summary"]
        speedup = summary["speedup_vs_prometheus"]
        wd = summary["watchdog"]["detected"]
        every_run = wd == summary["watchdog"]["runs"]
        missing = _missing(summary["watchdog"])
        never = "never"
        alert = summary["watchdog_alert"]
        if alert["detected"]:
            never += (
                f" (alert only, {_s(alert['median_s'])} s: {', '.join(summary['alert_verdicts'])})"
            )
        under_systemd = recovery.get(s["name"], {}).get("detection", {})
        if under_systemd.get("detected"):
            never += f"; under systemd {_s(under_systemd['median_s'])} s"
        prom = summary["baselines"]["prometheus_rule"]["detected"]
        if speedup is not None:
            rows.append(
                _target(
                    f"vs Prometheus rule, `{s['name']}`",
                    f"{speedup:.1f}x faster (medians){missing}",
                    "≥ 3x",
                    speedup >= 3 and every_run,
                )
            )
        elif wd and not prom:
            rows.append(
                _target(
                    f"vs Prometheus rule, `{s['name']}`",
                    f"finite vs never{missing}",
                    "≥ 3x",
                    every_run,
                )
            )
        health = [
            b for b in ("k8s_liveness", "router_health") if not summary["baselines"][b]["detected"]
        ]
        if health:
            rows.append(
                _target(
                    f"finite where /health baselines never fire, `{s['name']}`",
                    f"{_s(summary['watchdog']['median_s'])} s{missing}" if wd else never,
                    f"finite ({', '.join(health)} never fired)",
                    every_run,
                )
            )
    rows += uncompressed_targets(results.get("uncompressed") or {})
    rows += scale_targets(results.get("scale") or {})
    overhead = results.get("overhead") or {}
    if overhead.get("cpu_core_fraction") is not None:
        frac = overhead["cpu_core_fraction"]
        rss = overhead["peak_rss_mib"]
        rows.append(
            _target("one group, default cadence: CPU", _pct(frac), "< 1 % of a core", frac < 0.01)
        )
        rows.append(
            _target("one group, default cadence: peak RSS", f"{rss:.1f} MiB", "< 60 MiB", rss < 60)
        )
    return rows


SILENT_STALLS = ("transfer_stall", "decode_stall_midstream")
# The bounds at the shipped defaults.
UNCOMPRESSED_DETECTION_S = 30.0
# groups: (CPU of a core, mean cycle s, p95 cycle s); None: no target for that one.
SCALE_TARGETS: dict[int, tuple[float, float | None, float | None]] = {
    32: (0.10, 0.25, 1.0),
    128: (0.35, None, None),  # its timing: the "keeps up with the 5 s cycle" row
}


def uncompressed_targets(doc: Mapping[str, Any]) -> list[str]:
    """Detection p95 ≤ 30 s at the shipped defaults, and no false restart there."""
    rows = []
    for s in doc.get("scenarios", []):
        summary = s["summary"]
        if s["kind"] == "fault":
            stats = summary["watchdog"]
            p95 = stats["p95_s"]
            rows.append(
                _target(
                    f"uncompressed, shipped defaults: detection p95, `{s['name']}`",
                    ("never" if p95 is None else f"{p95:.1f} s") + _missing(stats),
                    f"≤ {UNCOMPRESSED_DETECTION_S:g} s",
                    p95 is not None
                    and p95 <= UNCOMPRESSED_DETECTION_S
                    and stats["detected"] == stats["runs"],
                )
            )
        else:
            rows.append(
                _target(
                    f"uncompressed, shipped defaults: false restarts, `{s['name']}`",
                    str(summary["false_restarts"]),
                    "0",
                    summary["false_restarts"] == 0,
                )
            )
    return rows


def cycles_due(point: Mapping[str, Any], cycle_seconds: float = 5.0) -> float | None:
    """Cycles a scale point should have run: every group once per cycle over its duration."""
    duration = point.get("duration_s")
    return None if duration is None else float(point["groups"]) * float(duration) / cycle_seconds


def keeps_up(point: Mapping[str, Any]) -> bool | None:
    """Whether a scale point ran (nearly) every cycle due, with p95 cycle time below a cycle."""
    cycles, p95, due = point.get("cycles"), point.get("cycle_p95_s"), cycles_due(point)
    if cycles is None or p95 is None or due is None:
        return None
    return bool(cycles >= 0.9 * due and p95 < 5.0)


def _due(point: Mapping[str, Any]) -> str:
    due = cycles_due(point)
    return "–" if due is None else f"{due:.0f}"


def scale_targets(scale: Mapping[str, Any]) -> list[str]:
    """32 groups: CPU, mean and p95 cycle; the largest point: keeping up with the cycle."""
    rows = []
    points = scale.get("points") or []
    for p in points:
        bounds = SCALE_TARGETS.get(int(p["groups"]))
        if bounds is None:
            continue
        cpu, mean, p95 = bounds
        n = p["groups"]
        frac, m, q = p.get("cpu_core_fraction"), p.get("cycle_mean_s"), p.get("cycle_p95_s")
        rows.append(
            _target(f"{n} groups: CPU", _pct(frac), f"≤ {100 * cpu:g} % of a core", _le(frac, cpu))
        )
        if mean is not None:
            rows.append(
                _target(f"{n} groups: mean cycle", _ms(m), f"≤ {1000 * mean:g} ms", _le(m, mean))
            )
        if p95 is not None:
            rows.append(
                _target(f"{n} groups: p95 cycle", _ms(q), f"≤ {1000 * p95:g} ms", _le(q, p95))
            )
    if points:
        largest = max(points, key=lambda p: int(p["groups"]))
        rows.append(
            _target(
                f"{largest['groups']} groups: keeps up with the 5 s cycle",
                f"{largest.get('cycles', '–')} of {_due(largest)} cycles due, "
                f"p95 {_ms(largest.get('cycle_p95_s'))}",
                "every cycle on time",
                keeps_up(largest),
            )
        )
    return rows


def _le(value: float | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


def uncompressed_section(doc: Mapping[str, Any]) -> list[str]:
    """The uncompressed suite's tables, its wall time, and the cost to the served system."""
    if not doc.get("scenarios"):
        reason = doc.get("error", "not run (`python -m bench.run --only uncompressed`)")
        return [f"Not measured: {reason}."]
    t = doc["timings"]
    lines = [
        f"The daemon at config.py's defaults, nothing overridden (cycle {t['cycle_seconds']:g} s, "
        f"probe every {t['period_seconds']:g} s, timeout {t['timeout_seconds']:g} s, stream idle "
        f"{t['stream_idle_seconds']:g} s, probe_failures {t['probe_failures']}, no_progress "
        f"{t['no_progress_seconds']:g} s); SGLang's and the router's documented timeouts; "
        f"{doc['reps']} repetition(s), the {doc['concurrency']} scenarios of a repetition side by "
        f"side. Wall time of this suite: **{doc['wall_seconds'] / 60:.1f} min**.",
        "",
        f"A silent stall is decided no_progress_seconds after the first scrape that follows the "
        f"fault (the last tokens before it still count as progress), so between "
        f"{t['no_progress_seconds']:g} and {t['no_progress_seconds'] + t['cycle_seconds']:g} s "
        "after it. Every fault here is injected at the same phase of the daemon's cycle (the "
        "settle time after the group turned healthy), so the runs hardly spread; where that "
        "phase lies in the cycle sets where in that range they land.",
        "",
        "| scenario | kind | restart decision, median / p95 | verdict | false restarts (runs) "
        "| alerts |",
        "|---|---|---|---|---|---|",
    ]
    for s in doc["scenarios"]:
        summary = s["summary"]
        if s["kind"] == "fault":
            verdicts = ", ".join(f"{v} ×{n}" for v, n in summary["verdicts"].items()) or "–"
            lines.append(
                f"| {s['title']} (`{s['name']}`) | fault "
                f"| {_latency_cell(summary['watchdog'], summary['window_s'])} | {verdicts} "
                f"| {summary['false_restarts_before_fault']} before the fault | – |"
            )
        else:
            alerts = summary["alerts"]
            kinds = ", ".join(summary["alert_verdicts"]) or ""
            lines.append(
                f"| {s['title']} (`{s['name']}`) | benign | – | – "
                f"| **{summary['false_restarts']}** ({summary['runs_with_false_restart']}/"
                f"{summary['runs']}) | {alerts}{f' ({kinds})' if kinds else ''} |"
            )
    lines += ["", *[f"- `{s['name']}`: {s['how']}" for s in doc["scenarios"]], ""]
    lines += cost_lines(doc.get("cost") or {})
    errors = [f"- `{s['name']}`: {e}" for s in doc["scenarios"] for e in s["summary"]["errors"]]
    if errors:
        lines += ["", "Runs that failed:", "", *errors]
    return lines


def cost_lines(cost: Mapping[str, Any]) -> list[str]:
    """What one group's watchdog adds to the served system at the defaults (from the config)."""
    if not cost:
        return []
    return [
        "What the watchdog adds to the served system, per group, at the defaults (computed from "
        "the config):",
        "",
        "| traffic | rate | per hour |",
        "|---|---|---|",
        f"| completion requests through the router (a {cost['max_tokens']}-token probe every "
        f"{cost['period_seconds']:g} s, a {cost['multiround_rounds']}-round conversation every "
        f"{cost['multiround_every_seconds']:g} s) | "
        f"{cost['generation_requests_per_second']:.3f} /s "
        f"| {3600 * cost['generation_requests_per_second']:.0f} requests, "
        f"{cost['generated_tokens_per_hour']:.0f} generated tokens |",
        _cost_row(
            cost,
            "health",
            "/health + /readiness (3 per cycle of "
            f"{cost['cycle_seconds']:g} s{_calm_every(cost, 'health_every_cycles')})",
        ),
        _cost_row(
            cost,
            "scrape",
            "/metrics of prefill, decode (2 per cycle"
            f"{_calm_every(cost, 'metrics_every_cycles')}) and the router (1"
            f"{_calm_every(cost, 'router_metrics_every_cycles')})",
        ),
        _cost_row(
            cost,
            "loads",
            "/v1/loads of prefill and decode (2 per cycle"
            f"{_calm_every(cost, 'loads_every_cycles')})",
        ),
        _cost_row(cost, "http", "all HTTP requests"),
        "",
        "A timed-out probe adds one `/abort_request` to each worker; none while healthy. Calm: "
        "the last decision healthy, probes passing, every answer ok (docs/decisions.md, "
        '"Fetch cadence"); worker /metrics wait their cadence only while `/v1/loads` carries '
        "decode's tokens (SGLang 0.5.23+), and anything in doubt fetches everything every cycle.",
    ]


def _calm_every(cost: Mapping[str, Any], name: str) -> str:
    """', calm: every N cycles' for a cadence above 1 (nothing for results without them)."""
    every = (cost.get("calm") or {}).get(name)
    return f"; calm: every {every:g} cycles" if every and every > 1 else ""


def _cost_row(cost: Mapping[str, Any], kind: str, label: str) -> str:
    """One traffic row: the rate per cycle of doubt, and while calm when the results have it."""
    rate = cost[f"{kind}_requests_per_second"]
    calm = (cost.get("calm") or {}).get(f"{kind}_requests_per_second")
    if calm is None or math.isclose(calm, rate):
        return f"| {label} | {rate:.2f} /s | {3600 * rate:.0f} |"
    per_hour = f"{3600 * rate:.0f} ({3600 * calm:.0f} calm)"
    return f"| {label} | {rate:.2f} /s ({calm:.2f} /s calm) | {per_hour} |"


def _missing(stats: Mapping[str, Any]) -> str:
    """', never in k/n runs' when some runs did not detect (a target needs every run)."""
    misses = stats["runs"] - stats["detected"]
    return (
        "" if misses == 0 or stats["detected"] == 0 else f", never in {misses}/{stats['runs']} runs"
    )


# Measurements made by hand between full runs (each against the build before it); results.md
# carries them after the scale tables, so a rerun of the suites keeps them.
HISTORY = Path(__file__).resolve().parent / "history.md"


def history_section() -> list[str]:
    """bench/history.md as it is, or nothing when there is none."""
    try:
        return ["", HISTORY.read_text().rstrip()]
    except FileNotFoundError:
        return []


# Said in results.md: what differs from the previously committed results and why. Update it with
# the change that makes a rerun necessary.
RUN_CHANGES: tuple[str, ...] = (
    "- New shipped defaults (probe timeout 12 s, stream idle 8 s, `no_progress_seconds` 25 s; "
    "configs/example.toml says why), and a new suite that runs them uncompressed at real cadence "
    "(`python -m bench.run --only uncompressed`): the transfer stall, the mid-stream stall and the "
    "three hardest benign loads (overload with aborted probes, long generations, a 25 s pause).",
    "- The daemon's hot path (bench/profile.md): one connection pool per target origin instead of "
    "one shared pool whose matching was 92 % of the CPU at 32 groups, `sniffio` installed, group "
    "loops spread over the cycle, state files parsed only when their stat changes. The scale "
    "table now has 1, 8, 32 and 128 groups and counts the cycles run against those due.",
    "- Direct PD probes and the router rung: while router probes fail the daemon asks each "
    "prefill/decode pair directly; a wedged router with healthy pairs is `router_wedge`, acted on "
    "by restarting the router alone (before: `silent_stall` and the full co-restart). A failed "
    "direct probe is set against the failure counters like the daemon's own aborts, which errs "
    "towards not restarting (see `degraded_bootstrap`).",
    "- Counter semantics: a missing series is unknown and a decrease without a new process counts "
    "nothing; a probe that raises inside the watchdog is not evidence. Every network read is "
    "capped.",
    "- Multi-host (SSH), several workers per role and DP ranks are not benchmarked here: every "
    "scenario runs one prefill, one decode and one router on this machine.",
)


def render_markdown(results: Mapping[str, Any]) -> str:
    """The whole results.md."""
    settings = results["settings"]
    machine = results["machine"]
    wt = settings["watchdog_timings"]
    dt = settings["default_watchdog_timings"]
    bt = settings["baseline_timings"]
    scenarios = results["scenarios"]
    period = float(wt["period_seconds"])
    k = settings["compression"]
    out = [
        "# sglang-watchdog benchmark",
        "",
        f"Generated {results['generated_at']} by `{results['command']}` (what `make bench` "
        f"runs, from the repository root) in {results['wall_seconds'] / 60:.1f} min wall time.",
        "",
        f"Machine: {machine['cpu_model']}, {machine['usable_cpus']} usable CPUs, "
        f"{machine['memory_gib']} GiB, Linux {machine['kernel']}, Python {machine['python']}, "
        f"sglang-router {machine['sglang_router']}, prometheus-client "
        f"{machine['prometheus_client']}, sglang-watchdog {machine['sglang_watchdog']} "
        f"(git {machine['git']}).",
        "",
        f"Daemon under test: `{results.get('watchdog_command', 'watchdog')}` (the real daemon as a "
        "subprocess, dry-run: restart decisions are logged and counted, nothing is restarted), "
        "against a simulated SGLang PD stack (pdsim/) behind the real sglang-router, one "
        f"fresh stack per run, {settings['reps']} repetitions per scenario, up to "
        f"{settings['concurrency']} runs side by side.",
        "",
        "## What changed since the previous run, and why",
        "",
        *RUN_CHANGES,
        "",
        "## Time compression",
        "",
        f"Real cadences would need hours; everything time-based is divided by about {k:g} and "
        "the latencies are also given in probe periods, which do not depend on the compression.",
        "",
        f"- Watchdog: probe period {wt['period_seconds']:g} s (default {dt['period_seconds']:g}), "
        f"timeout {wt['timeout_seconds']:g} s ({dt['timeout_seconds']:g}), stream idle "
        f"{wt['stream_idle_seconds']:g} s ({dt['stream_idle_seconds']:g}), cycle "
        f"{wt['cycle_seconds']:g} s ({dt['cycle_seconds']:g}), probe_failures "
        f"{wt['probe_failures']}, no_progress {wt['no_progress_seconds']:g} s "
        f"({dt['no_progress_seconds']:g}: set to timeout + 2 periods instead of "
        f"{dt['no_progress_seconds']:g}/{k:g}), transfer window {wt['window_seconds']:g} s "
        f"({dt['window_seconds']:g}), decode-only grace {wt['decode_only_grace_seconds']:g} s "
        f"({dt['decode_only_grace_seconds']:g}), multi-round probe off, restart budget raised to "
        f"{wt['max_restarts']}. The uncompressed run below uses the defaults unchanged.",
        f"- Baselines, same factor: k8s liveness period {bt['k8s_period_seconds']:g} s (10), "
        f"timeout {bt['k8s_timeout_seconds']:g} s (1, Kubernetes' default, not compressed: "
        "SGLang's /health sleeps 1 s before its first check, docs/sglang.md §7.1, so at this "
        "default a liveness probe times out on a healthy server too), failureThreshold "
        f"{bt['k8s_failure_threshold']}; router health checks every 12 s (60), timeout 1 s (5), "
        f"3 failures, probed like k8s; Prometheus scrape + evaluation every "
        f"{bt['scrape_interval_seconds']:g} s (15), `[{bt['rule_range_seconds']:g}s]` (1m), "
        f"`for: {bt['rule_for_seconds']:g}s` (1m).",
        "- SGLang's own timeouts likewise: /health timeout 4 s (20), scheduler watchdog 60 s "
        "(300), PD bootstrap/waiting 60 s (300).",
        f"- A latency of x s here is about {k:g}x s at production cadence for the baselines; for "
        "the watchdog multiply the probe periods by 5 s.",
        "",
        "## Fault scenarios: detection latency (fault injected → decision)",
        "",
        "Watchdog: first `stall_detected` log event (its restart decision); first alert = first "
        "`alert` event or state change to degraded/stalled. Baselines: first firing after the "
        "fault. Median / p95 over the runs that fired, in seconds and probe periods; "
        "'never fired' = not within the observation window.",
        "",
        *fault_table(scenarios),
        "",
        "## Benign loads: restarts that must not happen",
        "",
        "A false restart is any restart decision (`stall_detected`; cross-checked with "
        '`sglang_watchdog_restarts_total{result="dry_run"}`) during the run.',
        "",
        *benign_table(scenarios),
        "",
        "Probe share = the watchdog's completion probes / requests finished by decode "
        "(`sglang:num_requests_total`, probes included). Background load in most scenarios: "
        "2 closed-loop clients, 32 tokens, 0.2 s think time.",
        "",
        "## How each scenario is modelled",
        "",
        *[f"- `{s['name']}`: {s['how']}" for s in scenarios],
        "",
        "## Uncompressed: the shipped defaults at real cadence",
        "",
        *uncompressed_section(results.get("uncompressed") or {}),
        "",
        "## Time to verified recovery (real systemd, real restarts)",
        "",
        *recovery_section(results.get("recovery") or {}),
        "",
        "## Overhead and scale",
        "",
        *overhead_section(results),
        *history_section(),
        "",
        "## Targets",
        "",
        *targets(results),
        "",
        "## Notes",
        "",
        *[f"- {note}" for note in [*results.get("notes", []), *conditional_notes(scenarios)]],
        *[f"- Partial rerun {update}." for update in results.get("updates", [])],
        "",
        "![detection latency and scale](results.png)",
        "",
    ]
    errors = [f"- `{s['name']}`: {err}" for s in scenarios for err in s["summary"]["errors"]]
    if errors:
        out += ["## Runs that failed", "", *errors, ""]
    del period
    return "\n".join(out)


def conditional_notes(scenarios: Sequence[Mapping[str, Any]]) -> list[str]:
    """Notes that explain a result, written only when that result occurred."""
    notes = []
    by_name = {s["name"]: s for s in scenarios}
    hang = by_name.get("collective_hang")
    if hang is not None and hang["kind"] == "fault":
        k8s = hang["summary"]["baselines"]["k8s_liveness"]
        if k8s["detected"] < k8s["runs"]:
            notes.append(
                "k8s liveness did not fire in every `collective_hang` run although pdsim's "
                "/health answers 503 once its (compressed) 4 s health timeout passes with the "
                "scheduler hung; why the kubelet-style baseline's failure count does not reach "
                "its threshold within the window has not been investigated yet, so treat that "
                "baseline's 'never' here with caution."
            )
    pause = by_name.get("pause_5s")
    if pause is not None and pause["kind"] == "benign":
        fired = pause["summary"]["baselines"]["k8s_liveness"]["runs_fired"]
        if fired:
            notes.append(
                f"k8s liveness fired in {fired} `pause_5s` run(s): the pause is not compressed, so "
                "against the compressed 2 s kubelet period it is as long as a 25 s pause at "
                "production cadence, which three failed 10 s probes can catch. A restart there "
                "would be a false restart of that baseline."
            )
    return notes


def recovery_section(recovery: Mapping[str, Any]) -> list[str]:
    """Text and table of the sandbox recovery measurement."""
    if recovery.get("status") != "measured":
        return [f"Not measured ({recovery.get('reason', 'not run')})."]
    return [
        recovery.get("description", ""),
        "",
        *recovery_rows(recovery),
    ]


def _ratio(point: Mapping[str, Any]) -> str:
    """The daemon's CPU over the replay server's, measured over the same window."""
    ours, server = point.get("cpu_core_fraction"), point.get("endpoints_cpu_core_fraction")
    return "–" if not ours or not server else f"{ours / server:.1f}"


def _runs(point: Mapping[str, Any]) -> str:
    """' (runs a, b, c %)' for a point measured more than once."""
    runs = point.get("cpu_core_fraction_runs") or []
    if len(runs) < 2:
        return ""
    return f" (runs {', '.join(f'{100 * r:.1f}' for r in runs)} %)"


def overhead_section(results: Mapping[str, Any]) -> list[str]:
    """Overhead at default cadence, scale, and the scrape parser benchmark."""
    lines: list[str] = []
    overhead = results.get("overhead") or {}
    if overhead.get("cpu_seconds") is not None:
        lines += [
            f"One group at the default cadence (configs/example.toml timings: cycle 5 s, probe "
            f"every 5 s) against a healthy simulated stack for {overhead['duration_s']:.0f} s: "
            f"{overhead['cpu_seconds']:.2f} CPU s = **{_pct(overhead['cpu_core_fraction'])} of one "
            f"core**, peak RSS (VmHWM) **{overhead['peak_rss_mib']:.1f} MiB**, "
            f"{overhead.get('cycles', '–')} cycles.",
            "",
        ]
    elif overhead:
        lines += [f"Overhead not measured: {overhead.get('error', 'unknown error')}", ""]
    scale = results.get("scale") or {}
    if scale.get("points"):
        lines += [
            scale.get("description", ""),
            "",
            "| groups | cycle time mean | cycle time p95 | watchdog CPU (of one core) | CPU s "
            "| peak RSS | cycles run / due | replay server CPU | watchdog ÷ replay server |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in scale["points"]:
            lines.append(
                f"| {p['groups']} | {_ms(p.get('cycle_mean_s'))} | {_ms(p.get('cycle_p95_s'))} "
                f"| {_pct(p.get('cpu_core_fraction'))}{_runs(p)} | {_s(p.get('cpu_seconds'), 2)} "
                f"| {_s(p.get('peak_rss_mib'))} MiB "
                f"| {p.get('cycles', '–')} / {_due(p)} "
                f"| {_pct(p.get('endpoints_cpu_core_fraction'))} | {_ratio(p)} |"
            )
        lines += [
            "",
            "The replay server does the same work per group and cycle whatever the build, so its "
            "CPU follows the shared machine's speed; the ratio in the last column moves far less "
            "than either CPU when the machine slows down (bench/history.md, fourth section).",
        ]
        lines.append("")
    elif scale:
        lines += [f"Scale not measured: {scale.get('error', 'unknown error')}", ""]
    scrape = results.get("scrape_parser") or {}
    if scrape.get("ours_ms"):
        lines += [
            f"/metrics parser (bench/bench_scrape.py, {scrape['payload']['lines']}-line SGLang "
            f"TP={scrape['payload']['tp']} payload): {scrape['ours_ms']['best']:.2f} ms per parse "
            f"vs prometheus_client {scrape['prometheus_client_ms']['best']:.0f} ms "
            f"({scrape['speedup']:.0f}x).",
            "",
        ]
    return lines


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{1000 * value:.1f} ms"


# --------------------------------------------------------------------------- plot


def plot(results: Mapping[str, Any], path: Path) -> None:
    """Detection latency per fault (watchdog vs baselines) and cycle time / CPU vs groups."""
    faults = [s for s in results["scenarios"] if s["kind"] == "fault"]
    # A bare Figure renders with the Agg canvas and touches no global pyplot state.
    fig = Figure(figsize=(13, 5), layout="constrained")
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]})
    series = [("watchdog", "watchdog decision", "tab:green", "o")] + [
        (b, BASELINE_TITLES[b], color, marker)
        for b, color, marker in zip(
            MAIN_BASELINES, ("tab:blue", "tab:orange", "tab:red"), ("s", "^", "D"), strict=True
        )
    ]
    width = 0.8 / len(series)
    top = max((float(s["summary"]["window_s"] or 0.0) for s in faults), default=1.0)
    for index, (key, label, color, marker) in enumerate(series):
        xs_hit: list[float] = []
        ys_hit: list[float] = []
        xs_miss: list[float] = []
        for i, scenario in enumerate(faults):
            summary = scenario["summary"]
            stats = summary["watchdog"] if key == "watchdog" else summary["baselines"][key]
            x = i - 0.4 + width * (index + 0.5)
            for v in stats["values_s"]:
                if v is None:
                    xs_miss.append(x)
                else:
                    xs_hit.append(x)
                    ys_hit.append(v)
        ax.scatter(xs_hit, ys_hit, color=color, marker=marker, s=22, label=label, alpha=0.8)
        ax.scatter(xs_miss, [top * 1.04] * len(xs_miss), color=color, marker="x", s=22, alpha=0.8)
    ax.axhline(top, color="grey", linewidth=0.6, linestyle=":")
    ax.text(
        0.01,
        0.98,
        "x = never fired within the observation window",
        fontsize=8,
        color="grey",
        transform=ax.transAxes,
        va="top",
    )
    ax.set_xticks(range(len(faults)), [s["name"] for s in faults], rotation=20, fontsize=8)
    ax.set_ylabel("fault → detection (s, compressed cadence)")
    ax.set_ylim(0, top * 1.15)
    ax.set_title("Detection latency per run")
    # Mid-height on the left is empty in practice: below the baselines, above the watchdog.
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(0.0, 0.42))

    points = (results.get("scale") or {}).get("points") or []
    if points:
        groups = [p["groups"] for p in points]
        ax2.plot(
            groups,
            [1000 * (p.get("cycle_mean_s") or 0.0) for p in points],
            "o-",
            color="tab:green",
            label="cycle time, mean (ms)",
        )
        ax2.set_xlabel("groups (recorded endpoints, default cadence)")
        ax2.set_ylabel("cycle time (ms)")
        ax2.set_xscale("log", base=2)
        ax2.set_xticks(groups, [str(g) for g in groups])
        twin = ax2.twinx()
        twin.plot(
            groups,
            [100 * (p.get("cpu_core_fraction") or 0.0) for p in points],
            "s--",
            color="tab:purple",
            label="CPU (% of a core)",
        )
        twin.set_ylabel("CPU (% of one core)")
        lines = ax2.get_legend_handles_labels()
        more = twin.get_legend_handles_labels()
        ax2.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
        ax2.set_title("Scale")
    else:
        ax2.set_axis_off()
    fig.savefig(path, dpi=110)


def write_outputs(results: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """results.json, results.md and results.png in `out_dir`; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    md_path = out_dir / "results.md"
    png_path = out_dir / "results.png"
    json_path.write_text(json.dumps(results, indent=1, sort_keys=False, default=str) + "\n")
    md_path.write_text(render_markdown(results))
    plot(results, png_path)
    return [md_path, json_path, png_path]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.report [RESULTS.json]`: rewrite results.md and results.png from the JSON."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    default = Path(__file__).resolve().with_name("results.json")
    parser.add_argument("results", type=Path, nargs="?", default=default)
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    out_dir = args.results.parent
    (out_dir / "results.md").write_text(render_markdown(results))
    plot(results, out_dir / "results.png")
    print(f"wrote {out_dir / 'results.md'} and {out_dir / 'results.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
