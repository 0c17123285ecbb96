"""Light client traffic through the router: one small completion every ~0.5 s, each outcome kept."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import httpx

from watchdog.clock import Clock


@dataclass(frozen=True)
class TrafficSample:
    """One client request: when it was sent, when it ended, and whether it completed."""

    sent_at: float
    ended_at: float
    ok: bool
    detail: str = ""


def read_traffic(path: Path) -> list[TrafficSample]:
    """The samples a LightTraffic wrote to `path` (JSON Lines)."""
    samples = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                samples.append(TrafficSample(**json.loads(line)))
    return samples


RATE_WINDOW_SECONDS = 4.0


def completion_rate(
    samples: Sequence[TrafficSample], at: float, window_seconds: float = RATE_WINDOW_SECONDS
) -> float:
    """Completions per second over the `window_seconds` before `at`."""
    done = sum(1 for s in samples if s.ok and at - window_seconds < s.ended_at <= at)
    return done / window_seconds


WAITING_AGE_SECONDS = 1.0


def waiting_at(
    samples: Sequence[TrafficSample], at: float, min_age_seconds: float = WAITING_AGE_SECONDS
) -> int:
    """Client requests unanswered at `at` after waiting at least `min_age_seconds` (a healthy
    request takes ~50 ms; counting those would only show where the samples happen to fall)."""
    return sum(1 for s in samples if s.sent_at <= at - min_age_seconds and at < s.ended_at)


class LightTraffic:
    """Sends a completion through the router every `interval_seconds` without waiting for the
    previous one (a stalled request must not stop the flow: that is what a user sees)."""

    def __init__(
        self,
        router_url: str,
        *,
        model: str = "pdsim",
        interval_seconds: float = 0.5,
        timeout_seconds: float = 15.0,
        log: TextIO | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.url = router_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.interval_seconds = interval_seconds
        self.timeout_seconds = timeout_seconds
        self.samples: list[TrafficSample] = []
        self.pending = 0
        self._log = log
        self._clock = clock

    async def run(self) -> None:
        """Send until cancelled; requests still pending are cancelled with it."""
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=20)
        async with (
            httpx.AsyncClient(trust_env=False, timeout=self.timeout_seconds, limits=limits) as http,
            asyncio.TaskGroup() as tasks,
        ):
            while True:
                tasks.create_task(self._one(http))
                await asyncio.sleep(self.interval_seconds)

    async def _one(self, http: httpx.AsyncClient) -> None:
        body = {"model": self.model, "prompt": "Say something short.", "max_tokens": 8}
        sent = self._clock()
        self.pending += 1
        try:
            response = await http.post(self.url, json=body)
            ok, detail = response.status_code == 200, f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            ok, detail = False, type(exc).__name__
        except asyncio.CancelledError:
            # The demo ended with this request still waiting: it counts as waiting until then.
            self._record(TrafficSample(sent, self._clock(), False, "cancelled"))
            raise
        finally:
            self.pending -= 1
        self._record(TrafficSample(sent, self._clock(), ok, detail))

    def _record(self, sample: TrafficSample) -> None:
        self.samples.append(sample)
        if self._log is not None:
            self._log.write(json.dumps(asdict(sample)) + "\n")
            self._log.flush()

    def summary_since(self, since: float) -> tuple[int, int]:
        """(completed, failed) among the requests that ended after `since`."""
        recent = [s for s in self.samples if s.ended_at > since]
        ok = sum(1 for s in recent if s.ok)
        return ok, len(recent) - ok
