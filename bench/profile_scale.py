"""Where the daemon's time goes at N groups: one scale point with the daemon under cProfile.

    python -m bench.profile_scale --groups 32 --seconds 60 [--recording DIR] [--work-dir DIR]

Runs the daemon (dry-run, default cadence) against bench/recorded_endpoints.py as the scale
measurement does (bench/overhead.py), but launched as `python -m cProfile -o FILE -m watchdog`;
the profile is written when the daemon exits on SIGTERM. Prints the daemon's own CPU (utime +
stime of its PID, so cProfile's overhead is included) apart from the replay server's, the cycle
statistics, and the top functions by own and by cumulative time. The summary of a run is kept in
bench/profile.md; the raw profile is not committed.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import pstats
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.overhead import measure_point, record_payloads
from bench.recorded_endpoints import FILES


def top_functions(profile: Path, sort: str, count: int) -> str:
    """pstats' table of the `count` functions first by `sort` (tottime or cumulative)."""
    out = io.StringIO()
    stats = pstats.Stats(str(profile), stream=out)
    stats.strip_dirs().sort_stats(sort).print_stats(count)
    return out.getvalue()


async def profile_point(
    recording_dir: Path, groups: int, seconds: float, work_dir: Path, *, profiled: bool
) -> dict[str, Any]:
    """One point, the daemon under cProfile when `profiled`; the profile path is in the result."""
    if not all((recording_dir / name).exists() for name in FILES.values()):
        await asyncio.to_thread(record_payloads, recording_dir)
    profile = work_dir / "daemon.prof"
    launcher = (
        [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "watchdog"]
        if profiled
        else None
    )
    point = await measure_point(recording_dir, groups, work_dir / "point", seconds, launcher)
    point["profile"] = str(profile) if profiled else None
    return point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--recording", type=Path, help="a saved Recording (made when absent)")
    parser.add_argument("--work-dir", type=Path, help="default: a new temp dir (kept)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-profile", action="store_true", help="measure without cProfile")
    args = parser.parse_args(argv)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="watchdog-profile-"))
    recording = args.recording or work_dir / "recording"
    point = asyncio.run(
        profile_point(recording, args.groups, args.seconds, work_dir, profiled=not args.no_profile)
    )
    summary = {k: v for k, v in point.items() if k != "command"}
    print(json.dumps(summary, indent=1))
    if point["profile"] is not None and Path(point["profile"]).exists():
        print(top_functions(Path(point["profile"]), "tottime", args.top))
        print(top_functions(Path(point["profile"]), "cumulative", args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
