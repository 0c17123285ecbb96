"""DP attention in one simulated server: which of its `--dp-size` ranks serves a request.

SGLang's data-parallel controller sends a request carrying a rank straight to that rank's
scheduler and round-robins the rest (managers/data_parallel_controller.py:865-895 @ 0.5.23,
`maybe_external_dp_rank_routing` then `round_robin_scheduler`; :453-455 @ 0.5.5). The field that
carries the rank depends on the version (docs/sglang.md §7.10): `data_parallel_rank` up to 0.5.9
(managers/io_struct.py:204 @ 0.5.5, :240 @ 0.5.9), `routed_dp_rank` from 0.5.16
(io_struct.py:252 @ 0.5.16), with `data_parallel_rank` again accepted as a deprecated alias from
0.5.19 (io_struct.py:291 @ 0.5.19; copied over when routed_dp_rank is unset, :419-429 @ 0.5.23).
pdsim models the ranks as a label on each request: a fault can target one rank's requests, the
queues, metrics and /v1/loads stay the server's (pdsim/README.md "Known differences").
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from pdsim.api import RequestError
from pdsim.metrics import version_at_least


def rank_fields(version: str) -> tuple[str, ...]:
    """The request fields that pin a rank on `version`, the one that wins first."""
    if not version_at_least(version, "0.5.16"):
        return ("data_parallel_rank",)
    if not version_at_least(version, "0.5.19"):
        return ("routed_dp_rank",)
    return ("routed_dp_rank", "data_parallel_rank")


class DpRouter:
    """The controller of one server with `dp_size` ranks (1: no controller, no ranks)."""

    def __init__(self, dp_size: int, version: str) -> None:
        self.dp_size = dp_size
        self.fields = rank_fields(version)
        self._next = itertools.cycle(range(dp_size))

    def route(self, body: Mapping[str, Any]) -> int | None:
        """The rank that serves `body`; None without DP. An inactive rank is an error, as
        `ValueError("DP rank N is not active.")` (data_parallel_controller.py:865-876 @ 0.5.23)."""
        if self.dp_size <= 1:
            return None
        for field in self.fields:
            rank = body.get(field)
            if rank is None:
                continue
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise RequestError(f"{field} must be an integer, got {rank!r}")
            if not 0 <= rank < self.dp_size:
                raise RequestError(f"DP rank {rank} is not active.")
            return rank
        return next(self._next)
