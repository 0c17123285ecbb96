"""`python -m demo`: orchestration of the demo, from an empty machine state to the timeline picture.

Starts the simulated PD stack behind the real router, starts the watchdog, sends light traffic,
injects a transfer stall, narrates the watchdog's log in the terminal, then stops every process it
started (also on Ctrl-C or an error) and draws the timeline. Everything it writes goes under the
output folder (demo-output/ by default, git-ignored); the README's picture is refreshed only when
asked (`--docs-image`, `make demo-picture`). Exit status 0 when the story happened, 1 (with the
reason printed) when it did not or the asked-for docs picture was not written, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar, TextIO

from demo.backends import (
    Backend,
    PlainBackend,
    SandboxBackend,
    SandboxUnavailable,
    inject_transfer_stall,
    lift_transfer_stall,
)
from demo.config import DEMO_TIMINGS, config_toml
from demo.logevents import LogEvent, parse_log_line
from demo.narrative import Narrator
from demo.story import Story
from demo.timeline import Marker, build_timeline, render_timeline
from demo.traffic import LightTraffic, read_traffic
from pdsim.stack import REPO_ROOT, free_ports
from sandbox.namespace import skip_reason
from watchdog.configfile import Overrides
from watchdog.errors import EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE
from watchdog.run.recording import RecordingError, read_recording

DEFAULT_OUTPUT = REPO_ROOT / "demo-output"
DOCS_IMAGE = REPO_ROOT / "docs" / "demo-timeline.png"
FAULT_AFTER_SECONDS = 20.0  # from the demo's start
HEALTHY_BEFORE_FAULT_SECONDS = 6.0  # at least this much healthy baseline in the picture
TAIL_SECONDS = 12.0  # healthy traffic after verification, so the picture shows the recovery
MAX_SECONDS = 175.0  # the whole demo, teardown included
TEARDOWN_RESERVE_SECONDS = 20.0
TRAFFIC_REPORT_SECONDS = 10.0
EXIT_INTERRUPTED = 130  # the shell's convention for SIGINT
# Everything the demo writes into the output directory (removed at the start of a run; nothing
# else there is touched).
OUTPUT_NAMES = (
    "state",
    "stack-logs",
    "watchdog.toml",
    "watchdog.log",
    "recording.jsonl",
    "traffic.jsonl",
    "demo-events.jsonl",
    "timeline.png",
    "incident-report.md",
)


class Terminal:
    """Prints the story; colours key lines when stdout is a terminal (and NO_COLOR is unset)."""

    COLOURS: ClassVar[dict[str, str]] = {
        "bad": "\033[1;31m",
        "good": "\033[1;32m",
        "note": "\033[1;33m",
        "dim": "\033[2m",
    }

    def __init__(self, stream: TextIO = sys.stdout) -> None:
        self.stream = stream
        self.colour = stream.isatty() and not os.environ.get("NO_COLOR")

    def print(self, text: str = "", style: str = "") -> None:
        """One line, flushed at once (the story is read as it happens)."""
        if self.colour and style in self.COLOURS:
            text = f"{self.COLOURS[style]}{text}\033[0m"
        print(text, file=self.stream, flush=True)


def style_of(line: str) -> str:
    """Red for failures and the stall, green for the happy end, plain otherwise."""
    if "STALL DETECTED" in line or "FAILED" in line or "internal error" in line:
        return "bad"
    if "verification passed" in line:
        return "good"
    return ""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The demo's command line."""
    parser = argparse.ArgumentParser(
        prog="python -m demo",
        description="A transfer stall on a simulated SGLang PD stack (real sglang-router), "
        "detected, recorded and healed by the watchdog; ends with a timeline picture.",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="skip the systemd sandbox even where it could run: plain processes, watchdog "
        "--dry-run (the demo carries out the logged plan itself)",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="output directory")
    parser.add_argument(
        "--fault-after",
        type=float,
        default=FAULT_AFTER_SECONDS,
        metavar="SECONDS",
        help="inject the stall this long after the start (default: %(default)g)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=MAX_SECONDS,
        metavar="SECONDS",
        help="end by then whatever happened (default: %(default)g)",
    )
    parser.add_argument(
        "--docs-image",
        type=Path,
        default=None,
        metavar="PATH",
        help="also copy the picture here after a successful sandbox run (the README's is "
        f"{DOCS_IMAGE.relative_to(REPO_ROOT)}; `make demo-picture`); default: nowhere",
    )
    args = parser.parse_args(argv)
    if args.max_seconds < 60 or args.fault_after < 0:
        parser.error("--max-seconds must be at least 60 and --fault-after not negative")
    return args


def choose_backend(plain: bool) -> tuple[Backend, str]:
    """The sandbox where it can run, else plain processes; plus the reason for plain."""
    if plain:
        return PlainBackend(), "--plain was given"
    reason = skip_reason()
    if reason is not None:
        return PlainBackend(), reason
    return SandboxBackend(), ""


def prepare_output(out: Path) -> Path:
    """The output directory, emptied of what an earlier demo run wrote there."""
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_NAMES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return out.resolve()


def _rel(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


class DemoRun:
    """One run of the demo: the stack, the watchdog, the traffic, the story, the picture."""

    def __init__(
        self,
        backend: Backend,
        out: Path,
        *,
        fault_after_seconds: float,
        max_seconds: float,
        terminal: Terminal,
        timings: Overrides = DEMO_TIMINGS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend = backend
        self.out = out
        self.fault_after_seconds = fault_after_seconds
        self.terminal = terminal
        self.timings = timings
        self.clock = clock
        self.t0 = clock()
        self.deadline = self.t0 + max_seconds - TEARDOWN_RESERVE_SECONDS
        self.narrator = Narrator(self.t0)
        self.story = Story(acting=backend.acting)
        self.events: list[LogEvent] = []
        self.markers: list[Marker] = []
        self.traffic: LightTraffic | None = None
        self.ended_at: float | None = None
        self.abort_reason = ""
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ output helpers
    def say(self, text: str, style: str = "") -> None:
        """A line of the demo's own (not from the watchdog's log)."""
        self.terminal.print(self.narrator.line(self.clock(), text), style)

    def _demo_event(self, name: str, **fields: object) -> None:
        with (self.out / "demo-events.jsonl").open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"event": name, "at": self.clock(), **fields}) + "\n")

    # ------------------------------------------------------------------ phases
    async def run(self) -> None:
        """Everything up to the end of the story; the caller stops the processes."""
        backend = self.backend
        self.say("starting the simulated PD stack (prefill, decode, the real sglang-router) ...")
        await backend.start_stack(self.out)
        target = backend.target
        self.say(
            f"stack serving: router {target.urls['router']}, prefill {target.urls['prefill']}, "
            f"decode {target.urls['decode']}"
        )
        (metrics_port,) = free_ports(1)
        config = self.out / "watchdog.toml"
        config.write_text(
            config_toml(
                target,
                state_dir=self.out / "state",
                metrics_listen=f"127.0.0.1:{metrics_port}",
                timings=self.timings,
            ),
            encoding="utf-8",
        )
        where = "as a systemd unit in the sandbox" if backend.acting else "with --dry-run"
        self.say(f"starting the watchdog {where} (config {_rel(config)}) ...")
        await backend.start_watchdog(config, self.out / "recording.jsonl")
        with (self.out / "traffic.jsonl").open("w", encoding="utf-8") as traffic_log:
            self.traffic = LightTraffic(target.urls["router"], log=traffic_log)
            async with asyncio.TaskGroup() as tasks:
                reader = tasks.create_task(self._follow_watchdog())
                load = tasks.create_task(self.traffic.run())
                reporter = tasks.create_task(self._report_traffic())
                try:
                    await self._drive()
                finally:
                    self.ended_at = self.clock()
                    load.cancel()
                    reporter.cancel()
                    # The reader ends by itself once the watchdog has stopped and its log is read.
                    await backend.stop_watchdog()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(10):
                            await asyncio.shield(reader)
                    reader.cancel()

    async def _drive(self) -> None:
        story = self.story
        self.say("light traffic: one completion through the router every 0.5 s")
        if not await self._wait_for(lambda: story.healthy_at is not None):
            return
        assert story.healthy_at is not None
        inject_at = max(
            self.t0 + self.fault_after_seconds, story.healthy_at + HEALTHY_BEFORE_FAULT_SECONDS
        )
        await asyncio.sleep(max(0.0, inject_at - self.clock()))
        prefill = self.backend.target.urls["prefill"]
        await asyncio.to_thread(inject_transfer_stall, prefill)
        now = self.clock()
        story.note_fault(now)
        self.markers.append(Marker(now, "transfer stall injected", "fault"))
        self._demo_event("fault_injected", kind="transfer_stall", role="prefill")
        self.say(
            "injecting a transfer stall on prefill (pdsim fault transfer_stall): KV transfers "
            "never finish, /health stays 200 everywhere",
            "note",
        )
        if not await self._wait_for(lambda: story.detected_at is not None):
            return
        if not self.backend.acting:
            if not await self._wait_for(lambda: story.sequence_done_at is not None):
                return
            await self._lift_fault()
        done = await self._wait_for(
            lambda: story.verified_at is not None or story.verification_failed_at is not None
        )
        if done and story.verified_at is not None:
            self.say(f"letting traffic flow {TAIL_SECONDS:g} s more for the picture ...")
            await asyncio.sleep(min(TAIL_SECONDS, max(0.0, self.deadline - self.clock())))

    async def _lift_fault(self) -> None:
        """Dry run: nothing was restarted, so the stall would last; end it the simulator's way."""
        urls = self.backend.target.urls
        stuck = await asyncio.to_thread(lift_transfer_stall, urls["prefill"], urls["decode"])
        now = self.clock()
        self.markers.append(Marker(now, "demo lifts the fault (instead of a restart)", "operator"))
        self._demo_event("fault_lifted", released=stuck)
        self.say(
            f"dry run: nothing was restarted. The demo lifts the fault instead ({stuck} stuck "
            "transfers released), so the rehearsal's verification has a recovered stack to check",
            "note",
        )

    async def _wait_for(self, condition: Callable[[], bool]) -> bool:
        """Until `condition` holds (True), or the deadline passes or the watchdog dies (False)."""
        last_check = 0.0
        while not condition():
            now = self.clock()
            if now >= self.deadline:
                self.abort_reason = "the demo's time limit was reached"
                return False
            if now - last_check > 2.0:
                last_check = now
                code = await asyncio.to_thread(self.backend.watchdog_exit_code)
                if code is not None:
                    self.abort_reason = f"the watchdog exited early (status {code})"
                    return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(1.0, self.deadline - now)):
                    await self._changed.wait()
        return True

    async def _follow_watchdog(self) -> None:
        with (self.out / "watchdog.log").open("w", encoding="utf-8") as log:
            async for line in self.backend.watchdog_lines():
                log.write(line + "\n")
                log.flush()
                event = parse_log_line(line, self.clock())
                if event is None:
                    continue
                self.events.append(event)
                self.story.observe(event)
                for text in self.narrator.narrate(event):
                    self.terminal.print(text, style_of(text))
                self._changed.set()

    async def _report_traffic(self) -> None:
        while True:
            await asyncio.sleep(TRAFFIC_REPORT_SECONDS)
            if self.traffic is None:
                continue
            since = self.clock() - TRAFFIC_REPORT_SECONDS
            ok, failed = self.traffic.summary_since(since)
            self.say(
                f"traffic, last {TRAFFIC_REPORT_SECONDS:g} s: {ok} completed, {failed} failed, "
                f"{self.traffic.pending} waiting",
                "dim",
            )

    # ------------------------------------------------------------------ after the processes stop
    def draw(self, path: Path) -> Path | None:
        """The timeline PNG from the recording, the log events and the client traffic."""
        try:
            observations = list(read_recording(self.out / "recording.jsonl"))
        except RecordingError as exc:
            self.say(f"no recording to draw from: {exc}", "bad")
            observations = []
        traffic_path = self.out / "traffic.jsonl"
        traffic = read_traffic(traffic_path) if traffic_path.exists() else []
        if not observations and not self.events:
            return None
        mode = (
            "systemd sandbox: the watchdog co-restarts the units over D-Bus"
            if self.backend.acting
            else "dry run against plain processes, nothing restarted"
        )
        timeline = build_timeline(
            observations,
            self.events,
            t0=self.t0,
            end=self.ended_at,
            traffic=traffic,
            extra_markers=self.markers,
            title=f"sglang-watchdog demo: a silent KV-transfer stall ({mode})",
        )
        return render_timeline(timeline, path)


def _summary(run: DemoRun, png: Path | None, docs_png: Path | None, report: Path | None) -> None:
    story, say = run.story, run.terminal.print

    def at(value: float | None) -> str:
        return "-" if value is None else f"t+{value - run.t0:.1f}s"

    def since_fault(value: float | None) -> str:
        if value is None or story.fault_at is None:
            return ""
        return f"  ({value - story.fault_at:.1f} s after the fault)"

    say()
    say("─── summary " + "─" * 60)
    if run.backend.acting:
        say("mode: systemd sandbox; the watchdog restarted the units itself over D-Bus")
    else:
        say("mode: DRY RUN against plain processes; the watchdog restarted nothing", "note")
    say(f"stall injected       {at(story.fault_at)}")
    say(f"stall detected       {at(story.detected_at)}{since_fault(story.detected_at)}")
    if run.backend.acting:
        say(f"co-restart done      {at(story.sequence_done_at)}")
    else:
        say(f"co-restart planned   {at(story.sequence_done_at)}  (dry run: not carried out)")
    say(f"verification passed  {at(story.verified_at)}{since_fault(story.verified_at)}")
    if report is not None:
        say(f"incident report      {_rel(report)}")
        if story.report_path is not None:
            say(f"                     (from {_rel(story.report_path)})")
    if png is not None:
        say(f"timeline             {_rel(png)}" + (f" and {_rel(docs_png)}" if docs_png else ""))
    say(f"recording            {_rel(run.out / 'recording.jsonl')}")
    say(
        f"                     (replay: .venv/bin/watchdog replay --config "
        f"{_rel(run.out / 'watchdog.toml')} {_rel(run.out / 'recording.jsonl')})"
    )
    say(f"watchdog log         {_rel(run.out / 'watchdog.log')}")


def usage_problem(args: argparse.Namespace, backend: Backend) -> str | None:
    """Why this command line cannot do what it asks here (None when it can)."""
    if args.docs_image is not None and not backend.acting:
        # The README's picture shows the real loop: a dry run's picture must not replace it.
        return (
            "--docs-image needs the systemd sandbox (root, unshare, systemd), which cannot run here"
        )
    return None


async def _main_async(args: argparse.Namespace, backend: Backend, terminal: Terminal) -> int:
    out = prepare_output(args.output)
    run = DemoRun(
        backend,
        out,
        fault_after_seconds=args.fault_after,
        max_seconds=args.max_seconds,
        terminal=terminal,
    )
    error: BaseException | None = None
    try:
        await run.run()
    except SandboxUnavailable:
        raise  # main() falls back to plain processes (nothing of the sandbox is left running)
    except Exception as exc:  # reported below, after every process is stopped
        error = exc
    finally:
        run.say("stopping every process the demo started ...")
        await backend.stop()
    problems = run.story.missing()
    if error is not None:
        problems.insert(0, f"{type(error).__name__}: {error}")
    elif run.abort_reason and problems:
        problems.insert(0, run.abort_reason)
    png = report = docs_png = None
    try:
        png = run.draw(out / "timeline.png")
        if run.story.report_path is not None and run.story.report_path.exists():
            report = out / "incident-report.md"
            shutil.copyfile(run.story.report_path, report)
        if png is not None and not problems and backend.acting and args.docs_image is not None:
            docs_png = args.docs_image
            docs_png.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, docs_png)
    except (OSError, ValueError) as exc:  # the processes are stopped; say what failed
        problems.append(f"writing the results failed: {type(exc).__name__}: {exc}")
    _summary(run, png, docs_png, report)
    if not backend.acting and run.story.verified_at is None and not problems:
        terminal.print("note: verification did not pass after the demo's own co-restart", "note")
    if problems:
        terminal.print("the story did not happen:", "bad")
        for problem in problems:
            terminal.print(f"  - {problem}", "bad")
        terminal.print(f"see {_rel(out / 'watchdog.log')} and {_rel(out / 'stack-logs')}")
        return EXIT_UNHEALTHY
    if args.docs_image is not None and docs_png is None:
        # e.g. the sandbox did not boot and the demo fell back to a dry run
        terminal.print(f"{_rel(args.docs_image)} was not refreshed: no sandbox run", "bad")
        return EXIT_UNHEALTHY
    terminal.print("every process the demo started is stopped.")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    args = parse_args(argv)
    terminal = Terminal()
    backend, plain_reason = choose_backend(args.plain)
    problem = usage_problem(args, backend)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    announce(terminal, backend, plain_reason)
    interrupted = False
    try:
        try:
            return asyncio.run(_main_async(args, backend, terminal))
        except SandboxUnavailable as exc:
            backend.stop_now()
            backend = PlainBackend()
            announce(terminal, backend, f"the systemd sandbox did not start: {exc}")
            return asyncio.run(_main_async(args, backend, terminal))
    except KeyboardInterrupt:
        interrupted = True
        return EXIT_INTERRUPTED
    finally:
        backend.stop_now()  # no-op after a normal run; the last resort after an interrupt
        if interrupted:
            terminal.print("interrupted; every process the demo started is stopped", "bad")


def announce(terminal: Terminal, backend: Backend, plain_reason: str) -> None:
    """Say at the start which mode runs, and why it is a dry run when it is one."""
    if backend.acting:
        terminal.print(
            "mode: systemd sandbox. A private systemd (PID 1 of its own namespace) runs prefill, "
            "decode and the real router as units, and the watchdog as a unit next to them; its "
            "co-restart is real RestartUnit calls over D-Bus."
        )
    else:
        terminal.print(
            f"mode: DRY RUN against plain processes ({plain_reason}). The watchdog detects, "
            "captures evidence and logs its co-restart plan, but restarts nothing; the demo then "
            "lifts the fault. As root, with unshare and systemd installed, the demo runs the real "
            "self-healing loop in a systemd sandbox instead.",
            "note",
        )
