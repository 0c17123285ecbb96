"""`python -m bench.real`: the benchmark's real rows, on the released sglang 0.5.23 (CPU).

The silent transfer stall (decode's mooncake data port dropped, long transfer timeouts) under
light traffic, `--episodes` times on one real stack behind the real router, the watchdog at its
shipped defaults as a unit beside it (not dry-run): detection time from the fault to the
`stall_detected` decision, and recovery time from the fault to `verification_passed` after the
real co-restart (servers' real start-up included). The episode is demo.real's.

Writes bench/results-real.json and the section between REAL_BEGIN and REAL_END of
bench/results.md (appended when absent; `make bench` runs this after bench.run, which rewrites
the rest of that file). Needs root and `make real-setup`; exits 1 with the reason otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from bench.harness import git_revision, write_section
from demo.real import Episode, Teller, run_episode
from realsglang.daemon import SHORT_SOAK, WatchdogUnit
from realsglang.stack import ROUTERS, RealSandbox, skip_reason

BENCH_DIR = Path(__file__).resolve().parent
REAL_BEGIN = "<!-- bench.real: begin -->"
REAL_END = "<!-- bench.real: end -->"


def _fmt(values: Sequence[float | None]) -> str:
    seen = [v for v in values if v is not None]
    if not seen:
        return "never"
    missed = len(values) - len(seen)
    text = f"{statistics.median(seen):.1f} / {max(seen):.1f}"
    return text + (f" ({missed} of {len(values)} never)" if missed else "")


def section(
    episodes: Sequence[Episode], wall_seconds: float, command: str, load: tuple[float, float]
) -> str:
    """The Markdown section of results.md for these episodes (`load`: the machine's 1-minute
    load average at the start and at the end: recovery includes real start-ups, which slow
    down on a busy machine)."""
    rows = [
        "| router | episodes | verdicts | detection, median / max (s) "
        "| recovery, median / max (s) |",
        "|---|---|---|---|---|",
    ]
    for router in sorted({e.router for e in episodes}):
        mine = [e for e in episodes if e.router == router]
        verdicts = ", ".join(sorted({str(e.verdict) for e in mine}))
        rows.append(
            f"| {router} | {len(mine)} | {verdicts} "
            f"| {_fmt([e.detected_after_seconds for e in mine])} "
            f"| {_fmt([e.verified_after_seconds for e in mine])} |"
        )
    return "\n".join(
        [
            REAL_BEGIN,
            "## Real SGLang 0.5.23 (CPU): the silent transfer stall",
            "",
            f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command}` "
            f"(git {git_revision()}) in {wall_seconds / 60:.1f} min on {platform.machine()}, "
            f"Python {platform.python_version()}; load average {load[0]:.1f} at the start, "
            f"{load[1]:.1f} at the end ({os.cpu_count()} CPUs).",
            "",
            "The released sglang 0.5.23 on the CPU (tiny random Llama, KV over mooncake TCP) "
            "behind the real router, in a sandboxed systemd; the watchdog at its shipped defaults "
            "(cycle 5 s, probe timeout 12 s, `no_progress_seconds` 25 s) as a unit beside it, "
            "acting. Fault: decode's mooncake data port dropped with nftables, transfer timeouts "
            "raised to 900 s (every `/health` stays 200). Detection: fault → `stall_detected`. "
            "Recovery: fault → `verification_passed` after the real co-restart prefill → decode "
            "→ router, each gated on readiness (a real server loads in 30-65 s here), and 8 "
            "verification probes.",
            "",
            *rows,
            REAL_END,
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the episodes and write the results; 1 where real SGLang cannot run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--router", choices=ROUTERS, default="sglang-router")
    parser.add_argument("--out", type=Path, default=BENCH_DIR)
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason is not None:
        print(f"bench.real: not run: {reason}", file=sys.stderr)
        return 1
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    episodes: list[Episode] = []
    with RealSandbox.start("bench", routers=[args.router]) as real:
        for index in range(args.episodes):
            real.wait_until_serving(timeout_seconds=300.0)
            daemon = WatchdogUnit(
                real, f"bench-{index}", args.router, dry_run=False, overrides=SHORT_SOAK
            )
            daemon.start()
            daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=120.0)
            teller = Teller(daemon, time.time(), lambda line: print(line, flush=True))
            episodes.append(run_episode(real, daemon, teller))
            daemon.stop()
            print(f"episode {index + 1}: {asdict(episodes[-1])}", flush=True)
    wall = time.monotonic() - started
    command = "python -m bench.real " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / "results-real.json").write_text(
        json.dumps({"episodes": [asdict(e) for e in episodes], "wall_seconds": wall}, indent=1)
        + "\n"
    )
    load = (load_before, os.getloadavg()[0])
    text = section(episodes, wall, command.strip(), load)
    write_section(args.out / "results.md", text, REAL_BEGIN, REAL_END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
