"""`python -m demo.real` (`make demo-real`): the demo's story on the released sglang 0.5.23.

A real prefill and decode on the CPU (KV over mooncake TCP) behind a real router, in a sandboxed
systemd with its own network namespace; the watchdog at its shipped defaults as a unit beside them;
light traffic; then decode's mooncake data port is dropped with long transfer timeouts (the silent
stall: every /health stays 200, requests hang). The watchdog's log is told as it happens; it
detects the stall, captures evidence, co-restarts prefill → decode → router (real start-up: about
a minute per server on two cores) and verifies. Everything stops when it ends; the incident report
and a summary.json with the timings are copied to the output folder (demo-output/real/).

Needs root and `make real-setup`. Exit status 0 when the story happened, 1 when it did not (the
reason printed), 2 for bad usage. `run_episode` is the one stall episode, shared with the
benchmark's real rows (bench/real.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from demo.logevents import parse_log_line
from demo.narrative import Narrator
from pdsim.stack import REPO_ROOT
from realsglang.daemon import SHORT_SOAK, SHORT_SOAK_SECONDS, WatchdogUnit
from realsglang.load import load
from realsglang.stack import ROUTERS, RealSandbox, skip_reason
from watchdog.errors import EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE

DEFAULT_OUTPUT = REPO_ROOT / "demo-output" / "real"
BASELINE_SECONDS = 20.0  # healthy traffic before the fault
DETECT_TIMEOUT_SECONDS = 180.0
# The co-restart of real servers, then the short soak (realsglang.daemon.SHORT_SOAK) before
# verification passes.
RECOVER_TIMEOUT_SECONDS = 480.0 + SHORT_SOAK_SECONDS


@dataclass(frozen=True)
class Episode:
    """One silent stall on the real stack, timed from the fault (seconds; None: did not happen)."""

    router: str
    verdict: str | None
    detected_after_seconds: float | None
    verified_after_seconds: float | None
    incident: str | None


class Teller:
    """Prints the daemon's new log events as story lines (demo.narrative), once each."""

    def __init__(self, daemon: WatchdogUnit, t0: float, say: Callable[[str], None]) -> None:
        self.daemon = daemon
        self.narrator = Narrator(t0)
        self.say = say
        self.seen = 0

    def poll(self) -> None:
        """Tell what the daemon logged since the last poll."""
        lines = self.daemon.output().splitlines()
        for line in lines[self.seen :]:
            event = parse_log_line(line)
            if event is not None:
                for text in self.narrator.narrate(event):
                    self.say(text)
        self.seen = len(lines)


def _event_time(daemon: WatchdogUnit, name: str, after: float) -> float | None:
    for line in daemon.output().splitlines():
        event = parse_log_line(line)
        if event is not None and event.name == name and event.at >= after:
            return event.at
    return None


def _wait(teller: Teller, name: str, after: float, timeout_seconds: float) -> float | None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        teller.poll()
        at = _event_time(teller.daemon, name, after)
        if at is not None:
            return at
        if teller.daemon.exited():
            return None
        time.sleep(0.5)
    return None


def run_episode(real: RealSandbox, daemon: WatchdogUnit, teller: Teller) -> Episode:
    """Drop the transfer path under light traffic; follow detection, co-restart, verification."""
    with load(real, [daemon.router], concurrency=1, max_tokens=16, timeout_seconds=60.0):
        time.sleep(BASELINE_SECONDS)
        teller.poll()
        port = real.drop_transfer()
        fault_at = time.time()
        teller.say(
            teller.narrator.line(
                fault_at,
                f"FAULT: decode's mooncake data port {port} dropped (nftables, long mooncake "
                "timeouts): requests hang, every /health stays 200",
            )
        )
        detected = _wait(teller, "stall_detected", fault_at, DETECT_TIMEOUT_SECONDS)
        verdict = next((e.get("verdict") for e in daemon.events("stall_detected")[-1:]), None)
        if detected is not None:
            _wait(teller, "unit_restart_started", fault_at, 60.0)
        # A restarted decode listens on a new port anyway; lifting the drop keeps nothing stale.
        real.restore_transfer()
        verified = (
            _wait(teller, "verification_passed", fault_at, RECOVER_TIMEOUT_SECONDS)
            if detected is not None
            else None
        )
    opened = [e for e in daemon.events("incident_opened") if e.get("path")]
    return Episode(
        router=daemon.router,
        verdict=verdict,
        detected_after_seconds=None if detected is None else round(detected - fault_at, 1),
        verified_after_seconds=None if verified is None else round(verified - fault_at, 1),
        incident=str(opened[-1]["path"]) if opened else None,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m demo.real", description=__doc__.split("\n")[0])
    parser.add_argument("--router", choices=ROUTERS, default="sglang-router")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the story; 0 when the stall was detected, co-restarted and verified."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    reason = skip_reason()
    if reason is not None:
        print(f"demo.real: cannot run here: {reason}", file=sys.stderr)
        return EXIT_UNHEALTHY

    def say(text: str) -> None:
        print(text, flush=True)

    t0 = time.time()
    say(f"starting real sglang 0.5.23 prefill + decode on the CPU behind {args.router} (~1 min)")
    with RealSandbox.start("demo", routers=[args.router]) as real:
        say(f"serving after {time.time() - t0:.0f} s; starting the watchdog (shipped defaults)")
        daemon = WatchdogUnit(real, "demo", args.router, dry_run=False, overrides=SHORT_SOAK)
        daemon.start()
        teller = Teller(daemon, t0, say)
        episode = run_episode(real, daemon, teller)
        teller.poll()
        daemon.stop()
        out = args.output
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        if episode.incident is not None:
            shutil.copy(Path(episode.incident) / "report.md", out / "incident-report.md")
        shutil.copy(daemon.log_path, out / "watchdog.log")
        (out / "summary.json").write_text(json.dumps(asdict(episode), indent=1) + "\n")
    say(
        f"detected {episode.detected_after_seconds} s after the fault ({episode.verdict}), "
        f"verified {episode.verified_after_seconds} s after it; {out}/ has the incident report"
    )
    ok = episode.verdict == "silent_stall" and episode.verified_after_seconds is not None
    return EXIT_OK if ok else EXIT_UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
