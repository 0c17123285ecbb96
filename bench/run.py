"""`make bench`: scenarios × repetitions with baselines, recovery, overhead, scale → results.*.

    python -m bench.run [--quick] [--out bench]
    python -m bench.run --only uncompressed     # just that suite (or `scale`), merged into results

Phases: the /metrics parser micro-benchmark and the scale points run on a quiet machine; then the
scenario runs (each on its own stack, `--concurrency` side by side), the systemd-sandbox recovery
measurement and the default-cadence overhead run go together; last the uncompressed suite at the
shipped defaults (bench/uncompressed.py), the runs of a repetition side by side. Every process is
stopped by PID, also on an error or Ctrl-C. Logs of every run stay in the work directory (printed
at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import bench_scrape, report, uncompressed
from bench.harness import (
    COMPRESSED_TIMINGS,
    COMPRESSION,
    DEFAULT_TIMINGS,
    CpuMeter,
    machine_info,
    stop_leftover_watchdogs,
    timing_values,
    watchdog_executable,
)
from bench.overhead import measure_overhead, measure_scale
from bench.recovery import measure_recovery, stop_leftover_sandboxes
from bench.scenarios import (
    SCENARIOS,
    RunSettings,
    Scenario,
    run_scenario,
    scenario_named,
    stop_leftover_stacks,
)


@dataclass(frozen=True)
class Plan:
    """How much to run."""

    reps: int
    concurrency: int
    recovery_reps: int
    overhead_seconds: float
    scale_groups: tuple[int, ...]
    scale_seconds: float
    scrape_repeat: int
    uncompressed_reps: int = 3
    window_scale: float = 1.0
    # Points per group count; the median by CPU is reported, with every run's CPU beside it:
    # the shared machine's speed moves one 20 s point by a quarter (bench/history.md).
    scale_repeats: int = 3


FULL = Plan(
    reps=5,
    concurrency=5,
    recovery_reps=5,
    overhead_seconds=60.0,
    scale_groups=(1, 8, 32, 128),
    scale_seconds=20.0,
    scrape_repeat=5,
)
QUICK = Plan(
    reps=1,
    concurrency=4,
    recovery_reps=1,
    overhead_seconds=15.0,
    scale_groups=(1, 8),
    scale_seconds=10.0,
    scrape_repeat=3,
    uncompressed_reps=1,
    scale_repeats=1,
)


def log(message: str) -> None:
    """Progress on stdout, with the elapsed time."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _brief(result: dict[str, Any]) -> str:
    if "error" in result:
        return "ERROR " + str(result["error"]).splitlines()[0]
    wd = result["watchdog"]
    fired = {
        name: (None if b["first_after_s"] is None else round(b["first_after_s"], 1))
        for name, b in result["baselines"].items()
    }
    decision = wd["decision_after_s"]
    return (
        f"decision {None if decision is None else round(decision, 1)} ({wd['decision_verdict']}), "
        f"decisions {wd['decisions_total']}, alerts {wd['alerts_total']}, baselines {fired}"
    )


async def run_scenarios(
    scenarios: Sequence[Scenario],
    plan: Plan,
    settings: RunSettings,
    *,
    reps: int | None = None,
    concurrency: int | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """All repetitions of all scenarios, `plan.concurrency` at a time, rep-major order."""
    reps = plan.reps if reps is None else reps
    gate = asyncio.Semaphore(plan.concurrency if concurrency is None else concurrency)
    results: dict[str, list[dict[str, Any]]] = {s.name: [] for s in scenarios}

    async def one(scenario: Scenario, rep: int) -> None:
        async with gate:
            result = await run_scenario(scenario, rep, settings)
        results[scenario.name].append(result)
        log(f"{scenario.name} #{rep}: {_brief(result)}")

    async with asyncio.TaskGroup() as tasks:
        # Rep-major: the runs that share the machine at any moment are different scenarios.
        for rep in range(reps):
            for scenario in scenarios:
                tasks.create_task(one(scenario, rep))
    for runs in results.values():
        runs.sort(key=lambda r: int(r["rep"]))
    return results


def _scrape_parser(repeat: int) -> dict[str, Any]:
    try:
        return dict(bench_scrape.run(repeat))
    except Exception as exc:  # optional: results.md says it is missing
        return {"error": f"{type(exc).__name__}: {exc}"}


async def _guard(name: str, coro: Any) -> dict[str, Any]:
    try:
        result: dict[str, Any] = await coro
        return result
    except Exception as exc:
        log(f"{name} failed: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}


# Suites `--only` can name besides the compressed scenarios.
SUITES = ("uncompressed", "scale")


def selection(only: str | None) -> tuple[list[Scenario], set[str], bool]:
    """The compressed scenarios and the extra suites `--only` selects, and whether the run is
    partial (suites only: their results replace those sections of the existing results.json)."""
    if not only:
        return list(SCENARIOS), set(SUITES), False
    names = [name for name in only.split(",") if name]
    suites = {name for name in names if name in SUITES}
    scenarios = [scenario_named(name) for name in names if name not in SUITES]
    if scenarios:
        suites.add("scale")  # as before: a scenario selection still measures scale and overhead
    return scenarios, suites, not scenarios


def scenario_docs(
    scenarios: Sequence[Scenario],
    runs: Mapping[str, list[dict[str, Any]]],
    period_seconds: float,
    *,
    window_scale: float = 1.0,
) -> list[dict[str, Any]]:
    """One results document per scenario: what it is, its runs and their summary."""
    docs = []
    for scenario in scenarios:
        mine = runs[scenario.name]
        summary = (
            report.fault_summary(mine, period_seconds)
            if scenario.kind == "fault"
            else report.benign_summary(mine)
        )
        docs.append(
            {
                "name": scenario.name,
                "kind": scenario.kind,
                "title": scenario.title,
                "how": scenario.how,
                "observe_seconds": scenario.observe_seconds * window_scale,
                "summary": summary,
                "runs": mine,
            }
        )
    return docs


async def run_uncompressed(plan: Plan, base: RunSettings) -> dict[str, Any]:
    """The uncompressed suite (bench/uncompressed.py): all its scenarios of a rep side by side."""
    started = time.time()
    suite = uncompressed.scenarios()
    settings = uncompressed.settings(base)
    runs = await run_scenarios(
        suite, plan, settings, reps=plan.uncompressed_reps, concurrency=len(suite)
    )
    period = timing_values(DEFAULT_TIMINGS)["period_seconds"]
    docs = scenario_docs(suite, runs, period)
    return {
        "wall_seconds": time.time() - started,
        "reps": plan.uncompressed_reps,
        "concurrency": len(suite),
        "timings": timing_values(DEFAULT_TIMINGS),
        "scenarios": docs,
        "cost": uncompressed.probe_cost(),
    }


async def bench(args: argparse.Namespace, plan: Plan, work_dir: Path) -> dict[str, Any]:
    """Every phase; returns the results document."""
    # SIGTERM ends the bench like Ctrl-C: cancel, let every run stop its processes by PID.
    main_task = asyncio.current_task()
    if main_task is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    started = time.time()
    load_before = os.getloadavg()
    scenarios, suites, _ = selection(args.only)
    run_scale = "scale" in suites and not args.skip_scale
    settings = RunSettings(work_dir=work_dir / "runs", window_scale=plan.window_scale)
    notes: list[str] = []

    log("phase 1/4: /metrics parser micro-benchmark")
    scrape = await asyncio.to_thread(_scrape_parser, plan.scrape_repeat) if run_scale else {}

    log("phase 2/4: scale (quiet machine)")
    scale: dict[str, Any] = {}
    if run_scale:
        scale = await _guard(
            "scale",
            measure_scale(
                work_dir / "scale",
                plan.scale_groups,
                plan.scale_seconds,
                progress=log,
                repeats=plan.scale_repeats,
            ),
        )

    log(
        f"phase 3/4: {len(scenarios)} scenarios × {plan.reps} reps, {plan.concurrency} at a time, "
        "with the recovery measurement and the overhead run alongside"
    )
    meter = CpuMeter()
    meter.start()
    phase_started = time.time()
    recovery_coro = (
        measure_recovery(work_dir / "recovery", reps=plan.recovery_reps, progress=log)
        if plan.recovery_reps > 0 and not args.skip_recovery and scenarios
        else _skipped("skipped (--skip-recovery or no scenario selected)")
    )
    overhead_coro = (
        measure_overhead(work_dir / "overhead", plan.overhead_seconds)
        if run_scale and scenarios
        else _skipped("skipped")
    )
    runs, recovery, overhead = await asyncio.gather(
        run_scenarios(scenarios, plan, settings),
        _guard("recovery", recovery_coro),
        _guard("overhead", overhead_coro),
    )
    utilisation = meter.stop()
    phase_seconds = time.time() - phase_started

    uncompressed_doc: dict[str, Any] = {}
    if "uncompressed" in suites:
        log(f"phase 4/4: uncompressed suite at the shipped defaults, {plan.uncompressed_reps} reps")
        uncompressed_doc = await _guard("uncompressed", run_uncompressed(plan, settings))
    if scenarios:
        notes.append(
            f"The machine was {100 * utilisation:.0f} % busy on average (all CPUs) during the "
            f"scenario phase ({phase_seconds / 60:.1f} min, up to {plan.concurrency} stacks + the "
            "recovery sandbox + the overhead run at once): latencies include that contention. "
            "CPU seconds and RSS are per process and hardly affected; the scale points ran alone."
        )
    notes.append(
        f"Load average before the bench started: {load_before[0]:.2f} (1 min), "
        f"{load_before[1]:.2f} (5 min); other work on the machine would add to the contention."
    )
    notes += STANDING_NOTES
    period = timing_values(COMPRESSED_TIMINGS)["period_seconds"]
    compressed_docs = scenario_docs(scenarios, runs, period, window_scale=plan.window_scale)
    command = "python -m bench.run" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    first_cmd = next(
        (r["watchdog_command"] for rs in runs.values() for r in rs if "watchdog_command" in r),
        watchdog_executable(),
    )
    return {
        "generated_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "wall_seconds": time.time() - started,
        "machine": machine_info(),
        "watchdog_command": first_cmd.replace(str(work_dir), "$WORK"),
        "settings": {
            "quick": args.quick,
            "reps": plan.reps,
            "concurrency": plan.concurrency,
            "compression": COMPRESSION,
            "watchdog_timings": timing_values(COMPRESSED_TIMINGS),
            "default_watchdog_timings": timing_values(DEFAULT_TIMINGS),
            "baseline_timings": settings.baseline_timings.compressed().__dict__,
            "work_dir": str(work_dir),
            "cpu_utilisation_scenario_phase": utilisation,
        },
        "scenarios": compressed_docs,
        "recovery": recovery,
        "overhead": overhead,
        "scale": scale,
        "scrape_parser": scrape,
        "uncompressed": uncompressed_doc,
        "notes": notes,
    }


STANDING_NOTES = [
    "Without systemd (the scenario runs) the daemon cannot read unit start times or states over "
    "D-Bus (it is pointed at a bus that does not exist), so the unit-based rules (decode-only "
    "restart, crash, hung worker) cannot fire there; the recovery section runs under a real "
    "systemd.",
    "The watchdog's own probes are part of the traffic every baseline sees (same stack, same "
    "time): a completing probe moves `num_requests_total`, which keeps the Prometheus rule quiet "
    "until the probes stall too.",
    "The router runs with its documented defaults (retries, circuit breaker; health-check "
    "timings compressed), so a half-failing transfer path mostly succeeds on retry.",
]


async def _skipped(reason: str) -> dict[str, Any]:
    return {"status": "not measured", "reason": reason}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1 repetition, short overhead/scale")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--reps", type=int, help="repetitions per scenario (default 5; quick 1)")
    parser.add_argument("--concurrency", type=int, help="scenario runs side by side")
    parser.add_argument(
        "--only",
        help="comma-separated scenario names, and/or the suites 'uncompressed' and 'scale' "
        "(suites alone replace just their sections of the existing results)",
    )
    parser.add_argument("--uncompressed-reps", type=int, help="default 3; quick 1")
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--skip-scale", action="store_true", help="also skips overhead")
    parser.add_argument("--work-dir", type=Path, help="logs and state (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir after success")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.reps is not None:
        plan = Plan(**{**plan.__dict__, "reps": args.reps, "recovery_reps": args.reps})
    if args.concurrency is not None:
        plan = Plan(**{**plan.__dict__, "concurrency": args.concurrency})
    if args.uncompressed_reps is not None:
        plan = Plan(**{**plan.__dict__, "uncompressed_reps": args.uncompressed_reps})
    if not Path(watchdog_executable()).exists():
        print(f"error: {watchdog_executable()} not found (make install)", file=sys.stderr)
        return 2
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="watchdog-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    log(f"work dir {work_dir}")
    try:
        results = asyncio.run(bench(args, plan, work_dir))
    except (KeyboardInterrupt, asyncio.CancelledError):
        log("interrupted: every process was stopped by PID")
        return 130
    finally:
        stop_leftover_watchdogs()
        stop_leftover_stacks()
        stop_leftover_sandboxes()
    _, suites, partial = selection(args.only)
    if partial:
        results = merge_partial(results, suites, args.out / "results.json")
    paths = report.write_outputs(results, args.out)
    for path in paths:
        log(f"wrote {path}")
    if not args.keep and args.work_dir is None and not _any_errors(results):
        shutil.rmtree(work_dir, ignore_errors=True)
    else:
        log(f"logs kept in {work_dir}")
    return 0


def merge_partial(results: dict[str, Any], suites: set[str], previous_path: Path) -> dict[str, Any]:
    """The previous results with the sections of `suites` replaced by this run's (as is when
    there is no previous results.json)."""
    try:
        previous: dict[str, Any] = json.loads(previous_path.read_text())
    except (OSError, ValueError):
        return results
    keys = {"uncompressed": ("uncompressed",), "scale": ("scale", "scrape_parser")}
    for suite in sorted(suites):
        for key in keys[suite]:
            previous[key] = results[key]
    previous.setdefault("updates", []).append(
        f"{results['generated_at']}: {results['command']} replaced the sections "
        f"{', '.join(sorted(suites))} ({results['wall_seconds'] / 60:.1f} min, git "
        f"{results['machine'].get('git', '?')})"
    )
    return previous


def _any_errors(results: dict[str, Any]) -> bool:
    return any(s["summary"]["errors"] for s in results["scenarios"])


if __name__ == "__main__":
    sys.exit(main())
