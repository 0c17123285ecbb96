"""How often the router answers a decode stream cut mid-way with no answer at all.

    PDSIM_ROUTER=sglang-router .venv/bin/python -m tests.integration.router_cut_race 200

The fake decode of tests/unit/fakerouter.py streams a few events and closes its connection
(mode "truncated"), behind the real router as `test_bad_streams_through_the_real_router` runs it;
the completion probe asks `tries` times in a row and this prints how many times it read each
reason. Under sglang-router 0.3.2 some read `connect_error` ("Server disconnected without sending
a response") and the rest `malformed`; under smg every one reads `http_error` (docs/sglang.md
§7.9). A measurement, not a test: how many depends on the machine.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
from collections import Counter
from pathlib import Path

import httpx

from pdsim.stack import default_router
from tests.integration.test_probes_pdsim import fakes_behind_router
from watchdog.observe.probes.completion import run_completion_probe


async def count_cut_stream_reasons(tries: int, log: Path) -> Counter[str]:
    """The probe's reason for each of `tries` cut streams through the real router."""
    reasons: Counter[str] = Counter()
    async with fakes_behind_router(log) as (decode, group):
        probe = group.probe.model_copy(update={"path": "/v1/chat/completions"})
        chat = group.model_copy(update={"probe": probe})
        decode.mode = "truncated"
        async with httpx.AsyncClient(trust_env=False) as client:
            for _ in range(tries):
                result = await run_completion_probe(client, chat, api_key=None)
                reasons[result.reason.value] += 1
    return reasons


def main(argv: list[str]) -> int:
    """Run the tries (argv[0], default 100) and print the reasons counted."""
    tries = int(argv[0]) if argv else 100
    # smg's worker detection tries HTTP/2 first (a `PRI` preface), which the HTTP/1 fake
    # refuses with a logged traceback each time: noise here, where only the count is read.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="router-cut-") as work:
        reasons = asyncio.run(count_cut_stream_reasons(tries, Path(work) / "router.log"))
    counted = ", ".join(f"{reason} {count}" for reason, count in reasons.most_common())
    print(f"{default_router()}: {tries} cut streams: {counted}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
