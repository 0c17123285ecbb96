"""A bounded load through the real routers, from threads inside the sandbox's network namespace."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from realsglang.stack import RealSandbox, completion_body, http_post
from sandbox.netns import join_netns


@dataclass
class LoadReport:
    """What a load run saw: completions by HTTP status (0: no answer in time)."""

    statuses: dict[int, int] = field(default_factory=dict)


@contextmanager
def load(
    real: RealSandbox,
    routers: list[str],
    *,
    concurrency: int,
    max_tokens: int,
    timeout_seconds: float = 120.0,
) -> Iterator[LoadReport]:
    """Completions through `routers` from `concurrency` threads in the sandbox's namespace, each
    sending one after another until the block ends (then each finishes its request in flight)."""
    report = LoadReport()
    stop = threading.Event()
    lock = threading.Lock()
    netns = real.sandbox.netns_path

    def worker(index: int) -> None:
        join_netns(netns)
        router = routers[index % len(routers)]
        body = completion_body(f"Load {index}: the quick brown fox", max_tokens)
        while not stop.is_set():
            # This thread is in the namespace already: no thread per request.
            status, _ = http_post(real.stack.url(router) + "/v1/completions", body, timeout_seconds)
            with lock:
                report.statuses[status] = report.statuses.get(status, 0) + 1
            if status != 200:
                time.sleep(1.0)

    threads = [
        threading.Thread(target=worker, args=(i,), name=f"load-{i}", daemon=True)
        for i in range(concurrency)
    ]
    for thread in threads:
        thread.start()
    try:
        yield report
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=timeout_seconds + 10)
