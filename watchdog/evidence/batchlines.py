"""SGLang scheduler batch log lines: which lines are batches, and which are only /health's (pure).

Only TP rank 0 prints them; 0.4.10 wrote "Prefill batch.", later versions "Prefill batch,", and
SGLANG_LOG_FORWARD_ITERS=1 adds the iteration ("Decode batch [N],"): docs/sglang.md §5, §7.5.
"""

from __future__ import annotations

import re

BATCH_LINE = re.compile(r"\b(Prefill|Decode) batch(?: \[\d+\])?[.,]")
# Every /health (and /health_generate) runs a fake one-token request (input_ids=[0]) through
# prefill, which prints a batch line like any other: "Prefill batch, #new-seq: 1, #new-token: 1,
# #cached-token: 0, ...". It shows the loop runs, not that user requests progress: during a
# transfer stall such lines keep coming once per health check (docs/sglang.md §7.5).
_HEALTH_SIZED = re.compile(
    r"\bPrefill batch(?: \[\d+\])?[.,] #new-seq: 1, #new-token: 1\b(?!,? #cached-token: [1-9])"
)


def is_batch_line(line: str) -> bool:
    """Whether `line` is a Prefill or Decode batch line of any SGLang version."""
    return BATCH_LINE.search(line) is not None


def is_health_batch_line(line: str) -> bool:
    """Whether `line` is a batch line the size of a /health check's (one sequence, one new token,
    nothing cached): not evidence of progress."""
    return _HEALTH_SIZED.search(line) is not None


def is_progress_batch_line(line: str) -> bool:
    """A batch line that is not health-sized: real requests were scheduled."""
    return is_batch_line(line) and not is_health_batch_line(line)
