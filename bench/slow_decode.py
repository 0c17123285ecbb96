"""`python -m bench.slow_decode`: the slow-decode rows ("never restart a slow server").

The real daemon (dry-run) at the SHIPPED defaults (cycle 5 s, probe period 5 s, probe timeout
12 s, `no_progress_seconds` 25 s; only the state dir, the metrics port and the probe model set;
the router checks every worker's /health each second) watches pdsim (0.5.23 semantics) behind
the real sglang-router. Decode is made slow with pdsim's `slow_decode` fault (`tokens_per_s`
per running request) and its one slot kept busy by closed-loop clients with a queue behind it,
so every probe of ours times out in decode's queue: the decode's total rate, beyond anything of
ours, is then `slots x tokens_per_s`.

1. Slow rows: for each total rate, `--window` seconds (side by side; the stacks mostly sleep):
   did the daemon decide anything with an action (`stall_detected`)? The lowest rate with none
   (at every request length) is the slowest decode the watchdog still reads as progress.
2. Stall rows: the same slow load (16 s requests) at that rate, then prefill's `transfer_stall`
   (the incident's fault): detection time from the fault to `stall_detected`, `--stall-reps`
   times side by side.

Writes bench/results-slow.json and the section of bench/results.md between SLOW_BEGIN and
SLOW_END (appended when absent). ~5 minutes (two phases of side-by-side stacks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.harness import DEFAULT_TIMINGS, git_revision, timing_values, write_section
from bench.slowstack import (
    ROUTER_HEALTH_INTERVAL_S,
    Run,
    Slow,
    act_decisions,
    decode_tokens,
    slow_stack,
    wait_decision,
)

BENCH_DIR = Path(__file__).resolve().parent
SLOW_BEGIN = "<!-- bench.slow_decode: begin -->"
SLOW_END = "<!-- bench.slow_decode: end -->"

RATES = (0.5, 1.0, 2.0, 4.0)  # total tokens/s across decode's running requests
SLOTS = 1  # decode's --max-running-requests: per-request rate = total rate
CLIENTS = 4  # one running, three waiting: a probe waits behind >= 2 whole requests
# Each client request lasts this long at the slow rate (> the probe timeout). 16 s: requests finish
# within no_progress_seconds, so the finished-request counters (generation_tokens_total) move too;
# 60 s: none finishes within it, only the per-iteration counters (realtime_tokens_total, /v1/loads
# decode_moments) can show the decode's progress, net of the health checks' allowance.
REQUEST_SECONDS = (16.0, 60.0)
SLOW_FIRST_S = 30.0  # the stall rows: read as slow for a while before the fault


def slow_at(total: float, request_s: float) -> Slow:
    """The load for a total rate: SLOTS requests at total/SLOTS tokens/s each, queue behind."""
    per_request = total / SLOTS
    tokens = max(4, round(per_request * request_s))
    return Slow(
        tokens_per_s=per_request,
        decodes=1,
        loads=True,
        slots=SLOTS,
        clients=CLIENTS,
        max_tokens=tokens,
    )


@dataclass(frozen=True)
class SlowRow:
    total_tokens_per_s: float  # nominal: slots x tokens_per_s
    tokens_per_s_per_request: float
    request_seconds: float
    max_tokens: int
    window_seconds: float
    measured_tokens_per_s: float  # realtime_tokens_total over the window (the clients' tokens)
    client_requests_ok: int
    probes_failed: int
    decisions: int  # stall_detected in the window
    verdicts: list[str]
    first_decision_after_seconds: float | None
    states: list[str]  # state_changed targets in the window

    @property
    def progress(self) -> bool:
        return self.decisions == 0


@dataclass(frozen=True)
class StallRow:
    total_tokens_per_s: float
    max_tokens: int
    decisions_before_fault: int
    verdict: str | None
    detected_after_seconds: float | None  # fault -> stall_detected
    drain_bound_seconds: float  # the longest a running request may still generate after it


def _states(run: Run) -> list[str]:
    return [str(e.get("new")) for e in run.events_after("state_changed")]


async def _slow_row(tmp: Path, total: float, request_s: float, window_s: float) -> SlowRow:
    slow = slow_at(total, request_s)
    async with slow_stack(tmp, slow, DEFAULT_TIMINGS) as run:
        before = await decode_tokens(run, slow.decodes)
        await asyncio.sleep(window_s)
        after = await decode_tokens(run, slow.decodes)
        decisions = run.events_after("stall_detected")
        acted = act_decisions(run)
        first = decisions[0]["_at"] - run.t0 if decisions else None
        row = SlowRow(
            total_tokens_per_s=slow.total_tokens_per_s,
            tokens_per_s_per_request=slow.tokens_per_s,
            request_seconds=request_s,
            max_tokens=slow.max_tokens,
            window_seconds=window_s,
            measured_tokens_per_s=(after - before) / window_s,
            client_requests_ok=sum(g.ok for g in run.loads.generators[1:]),
            probes_failed=len(run.events_after("probe_failed")),
            decisions=len(decisions),
            verdicts=sorted({str(e.get("verdict")) for e in acted if e.get("verdict")}),
            first_decision_after_seconds=first,
            states=_states(run),
        )
        print(
            f"slow {total:g} tok/s, {request_s:g} s requests: {asdict(row)}\n"
            + run.decisions_text(),
            flush=True,
        )
        return row


async def _stall_row(tmp: Path, total: float) -> StallRow:
    slow = slow_at(total, REQUEST_SECONDS[0])
    drain_s = slow.max_tokens / slow.tokens_per_s
    async with slow_stack(tmp, slow, DEFAULT_TIMINGS) as run:
        await asyncio.sleep(SLOW_FIRST_S)
        early = len(run.events_after("stall_detected"))
        await asyncio.to_thread(run.stack.set_fault, "prefill", "transfer_stall")
        fault_at = time.time()
        timings = timing_values(DEFAULT_TIMINGS)
        bound = timings["no_progress_seconds"] + timings["cycle_seconds"] + drain_s
        run.t0 = fault_at
        decision = await wait_decision(run, bound + 60.0)
        row = StallRow(
            total_tokens_per_s=slow.total_tokens_per_s,
            max_tokens=slow.max_tokens,
            decisions_before_fault=early,
            verdict=None if decision is None else str(decision.get("verdict")),
            detected_after_seconds=None if decision is None else decision["_at"] - fault_at,
            drain_bound_seconds=drain_s,
        )
        print(f"stall at {total:g} tok/s: {asdict(row)}\n{run.decisions_text()}", flush=True)
        return row


def lowest_everywhere(rows: Sequence[SlowRow]) -> float | None:
    """The lowest rate read as progress at every request length (None when there is none)."""
    rates = sorted({r.total_tokens_per_s for r in rows})
    good = [rate for rate in rates if all(r.progress for r in rows if r.total_tokens_per_s == rate)]
    return min(good) if good else None


def premature(stall: StallRow) -> bool:
    """Decided sooner after the fault than `no_progress_seconds`: decode's counters were already
    flat before the fault, so the decision is not the fault's (a slow decode read as flat)."""
    after = stall.detected_after_seconds
    return after is not None and after < timing_values(DEFAULT_TIMINGS)["no_progress_seconds"]


def _fmt_s(value: float | None) -> str:
    return "none" if value is None else f"{value:.1f} s"


def section(
    rows: Sequence[SlowRow],
    stalls: Sequence[StallRow],
    *,
    command: str,
    wall_seconds: float,
    load: tuple[float, float],
) -> str:
    """The Markdown section of results.md."""
    t = timing_values(DEFAULT_TIMINGS)
    lowest = []
    for length in sorted({r.request_seconds for r in rows}):
        progress = [
            r.total_tokens_per_s for r in rows if r.progress and r.request_seconds == length
        ]
        rate = f"{min(progress):g} token(s)/s" if progress else "none of the rates measured"
        lowest.append(f"{rate} with {length:g} s requests")
    slow_table = [
        "| request length | total decode rate, beyond ours (tokens/s) "
        "| measured decode tokens/s | probes failed "
        "| client requests done | `stall_detected` | first after (s) | states entered | read as |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        verdicts = f" ({', '.join(r.verdicts)})" if r.verdicts else ""
        slow_table.append(
            f"| {r.request_seconds:g} s | {r.total_tokens_per_s:g} "
            f"| {r.measured_tokens_per_s:.2f} "
            f"| {r.probes_failed} | {r.client_requests_ok} "
            f"| {r.decisions}{verdicts} | {_fmt_s(r.first_decision_after_seconds)} "
            f"| {', '.join(r.states) or '-'} "
            f"| {'progress (0 restarts)' if r.progress else '**no progress: acted on**'} |"
        )
    stall_table = [
        "| total decode rate before the fault (tokens/s) | repetition | decided before the fault "
        "| verdict | fault → `stall_detected` | of which: decode finishing its running request "
        "(at most) |",
        "|---|---|---|---|---|---|",
    ]
    for i, s in enumerate(stalls, 1):
        stall_table.append(
            f"| {s.total_tokens_per_s:g} | {i} | {s.decisions_before_fault} | {s.verdict or '-'} "
            f"| {_fmt_s(s.detected_after_seconds)}"
            f"{' (**premature**: flat before the fault)' if premature(s) else ''} "
            f"| {s.drain_bound_seconds:.0f} s |"
        )
    detected = [
        s.detected_after_seconds
        for s in stalls
        if s.detected_after_seconds is not None and not premature(s)
    ]
    stall_summary = (
        f"median {statistics.median(detected):.1f} s, max {max(detected):.1f} s "
        f"({len(detected)} of {len(stalls)} detected after the fault could show)"
        if detected
        else "never detected"
    )
    window = rows[0].window_seconds if rows else 0.0
    return "\n".join(
        [
            SLOW_BEGIN,
            "## Slow decode at the shipped defaults",
            "",
            f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command}` "
            f"(git {git_revision()}) in {wall_seconds / 60:.1f} min on {platform.machine()}, "
            f"Python {platform.python_version()}; load average {load[0]:.1f} at the start, "
            f"{load[1]:.1f} at the end ({os.cpu_count()} CPUs; the machine was shared).",
            "",
            "pdsim with SGLang 0.5.23 semantics behind the real sglang-router (health checks "
            f"every {ROUTER_HEALTH_INTERVAL_S:g} s, round robin), the real daemon in dry-run "
            f"at the shipped defaults: cycle {t['cycle_seconds']:g} s, probe period "
            f"{t['period_seconds']:g} s, probe timeout {t['timeout_seconds']:g} s, "
            f"`no_progress_seconds` {t['no_progress_seconds']:g} s; nothing else set but the "
            "state dir, the metrics port and the probe model. Decode runs "
            f"{SLOTS} request(s) at a time (`--max-running-requests {SLOTS}`) at the given rate "
            f"(pdsim's `slow_decode`), {CLIENTS} closed-loop clients keep its slot busy and a "
            "queue behind it, each request lasting "
            f"{' or '.join(f'{x:g}' for x in REQUEST_SECONDS)} s, so every probe of ours "
            "waits in the queue past its timeout: the decode's rate is all beyond our own "
            "probes. Each rate watched for "
            f"{window:g} s after the decode turned slow, side by side.",
            "",
            f"**Lowest total decode rate read as progress: {'; '.join(lowest)}.**",
            "",
            f"With {REQUEST_SECONDS[0]:g} s requests a client request finishes within "
            "`no_progress_seconds`, and `generation_tokens_total` (which no health check "
            f"moves) shows it; with {REQUEST_SECONDS[1]:g} s requests none does, and only the "
            "per-iteration counters (`realtime_tokens_total`, `/v1/loads` `decode_moments`) can "
            "show progress.",
            "",
            *slow_table,
            "",
            "The measured column is decode's `realtime_tokens_total` over the window: the clients' "
            "tokens (a /health check, the router's or ours, adds none: it finishes without a "
            "decode step, checked on real 0.5.23 by tests/conformance; docs/decisions.md, "
            '"Progress").',
            "",
            f"Stall under the same load ({REQUEST_SECONDS[0]:g} s requests): the slowest rate "
            "read as progress at every request length, "
            f"{SLOW_FIRST_S:g} s slow, then prefill's `transfer_stall`; decode finishes what it "
            f"runs and gets nothing more. Detection: {stall_summary}.",
            "",
            *stall_table,
            SLOW_END,
        ]
    )


async def measure(
    tmp: Path, rates: Sequence[float], window_s: float, stall_reps: int, stall_rate: float | None
) -> tuple[list[SlowRow], list[StallRow]]:
    cases = [(rate, length) for length in REQUEST_SECONDS for rate in rates]
    rows = list(
        await asyncio.gather(
            *(
                _slow_row(tmp / f"slow{i}", rate, length, window_s)
                for i, (rate, length) in enumerate(cases)
            )
        )
    )
    if stall_rate is None:
        stall_rate = lowest_everywhere(rows) or max(rates)
    stalls = list(
        await asyncio.gather(
            *(_stall_row(tmp / f"stall{i}", stall_rate) for i in range(stall_reps))
        )
    )
    return rows, stalls


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES))
    parser.add_argument("--window", type=float, default=180.0)
    parser.add_argument("--stall-reps", type=int, default=3)
    parser.add_argument(
        "--stall-rate", type=float, default=None, help="default: the lowest read as progress"
    )
    parser.add_argument("--out", type=Path, default=BENCH_DIR)
    args = parser.parse_args(argv)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-slow-") as tmp:
        rows, stalls = asyncio.run(
            measure(Path(tmp), args.rates, args.window, args.stall_reps, args.stall_rate)
        )
    wall = time.monotonic() - started
    load = (load_before, os.getloadavg()[0])
    command = "python -m bench.slow_decode " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / "results-slow.json").write_text(
        json.dumps(
            {
                "command": command.strip(),
                "git": git_revision(),
                "load_average": {"start": load[0], "end": load[1], "cpus": os.cpu_count()},
                "settings": {
                    "watchdog_timings": timing_values(DEFAULT_TIMINGS),
                    "router_health_check_interval_secs": ROUTER_HEALTH_INTERVAL_S,
                    "decode_slots": SLOTS,
                    "clients": CLIENTS,
                    "request_seconds": list(REQUEST_SECONDS),
                },
                "slow": [asdict(r) | {"progress": r.progress} for r in rows],
                "stall": [asdict(s) | {"premature": premature(s)} for s in stalls],
                "wall_seconds": wall,
            },
            indent=1,
        )
        + "\n"
    )
    text = section(rows, stalls, command=command.strip(), wall_seconds=wall, load=load)
    write_section(args.out / "results.md", text, SLOW_BEGIN, SLOW_END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
