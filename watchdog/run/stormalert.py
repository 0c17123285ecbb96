"""The storm alert's life on Alertmanager: posted when the fleet arbiter declares a storm, renewed
while it lasts (its annotations follow the storm: the groups acted on and held), resolved when it
ends. Like a silence, each post lives `silence_seconds`, so a watchdog that dies lets it lapse.

One task per storm, beside the group loops: posting never delays a cycle, and an Alertmanager
that is down, slow or failing is counted and logged by the client (never raised).
"""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections.abc import Callable

import structlog

from watchdog.act.alertmanager import GroupAlerts, storm_alert
from watchdog.decide.fleet import Storm

log = structlog.get_logger()


class StormAlert:
    """Posts, renews and resolves the alert of the storm in progress (at most one at a time)."""

    def __init__(
        self,
        alerts: GroupAlerts,
        current: Callable[[], Storm | None],
        count_internal_error: Callable[[], None],
    ) -> None:
        self.alerts = alerts
        self.current = current  # the arbiter's storm now (None once it ended)
        self.count_internal_error = count_internal_error
        self._ended = asyncio.Event()
        self._task: asyncio.Task[None] | None = None  # the newest storm's
        self._tasks: set[asyncio.Task[None]] = set()  # with a previous one still resolving

    def declared(self, storm: Storm) -> None:
        """A storm was declared: post its alert (in a task of its own)."""
        if self._task is not None and not self._task.done() and not self._ended.is_set():
            return  # one storm at a time: the running task follows current()
        # A storm declared while the last one's alert is being resolved: the new task waits for
        # that resolve first (the same labels: a late resolve would end the new alert).
        previous = self._task
        self._ended = ended = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._follow(storm, ended, previous))
        self._tasks.add(self._task)
        self._task.add_done_callback(self._tasks.discard)

    def ended(self) -> None:
        """The storm ended: resolve its alert now."""
        self._ended.set()

    async def close(self) -> None:
        """Stop following (shutdown): the last post lapses by itself after silence_seconds."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(
        self, storm: Storm, ended: asyncio.Event, previous: asyncio.Task[None] | None
    ) -> None:
        if previous is not None:
            await asyncio.wait({previous})  # its own errors are its own (logged there)
        lifetime = self.alerts.settings.silence_seconds
        started = self.alerts.clock()
        labels, annotations = storm_alert(storm)
        try:
            while not ended.is_set():
                latest = self.current()
                if latest is not None:
                    labels, annotations = storm_alert(latest)
                await self.alerts.post(
                    labels, annotations, starts_at=started, ends_at=self.alerts.clock() + lifetime
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ended.wait(), lifetime / 2)
            await self.alerts.post(
                labels, annotations, starts_at=started, ends_at=self.alerts.clock()
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the alert is optional; the fleet goes on
            self.count_internal_error()
            log.error(
                "internal_error",
                where="storm_alert",
                error=repr(exc),
                effect="the storm alert is not renewed; it lapses by itself",
                traceback=traceback.format_exc(),
            )
