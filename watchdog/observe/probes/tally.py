"""The tokens one probe has received so far, counted as its streams deliver them.

The detector reads decode's token counters as progress only beyond what it can prove is its own
(docs/decisions.md, "Progress"), so the count must be exact, not an upper bound: a slow server
whose requests get a token or two a second would otherwise read as flat. The probe scheduler
gives each probe task a `ProbeTally` through a context variable (set in the task, so every
exchange of that probe and no other one sees it); each streamed exchange (`stream_exchange`:
completion probes, every round of a multi-round probe, direct and pinned probes) reports its
running count to it. Outside the scheduler (`watchdog check`) there is no tally and nothing is
reported: the finished result's `tokens` is the count there.

What a stream's count is (watchdog/observe/probes/completion.py, `_StreamReader.tokens`):
- `/generate`: `meta_info.completion_tokens`, which SGLang puts in every streamed chunk
  (srt/managers/tokenizer_manager.py:2552-2557 @ 0.5.23): exact at every moment.
- OpenAI paths: one per chunk that carried text while the stream runs (SGLang streams one chunk
  per `--stream-interval` decode steps, default 1: one token a chunk), then the final chunk's
  `usage.completion_tokens` (we ask for `include_usage`; srt/entrypoints/openai/
  serving_completions.py:479 @ 0.5.23), which is exact. Mid-stream the chunk count can fall
  short of the tokens (a longer stream interval, or a token that completes no character);
  never over them.
A stream's count is kept monotonic: a final usage below the chunks seen changes nothing.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(slots=True)
class ProbeTally:
    """One probe's streams: tokens received so far and streams that got a first token."""

    received: int = 0
    first: int = 0


@dataclass(slots=True)
class StreamCount:
    """One streamed exchange's running count, added to its probe's tally as it grows."""

    tally: ProbeTally | None
    seen: int = 0

    def update(self, tokens: int) -> None:
        """The exchange has received `tokens` in all so far (only growth is counted)."""
        if tokens <= self.seen:
            return
        if self.tally is not None:
            if self.seen == 0:
                self.tally.first += 1
            self.tally.received += tokens - self.seen
        self.seen = tokens


CURRENT_TALLY: ContextVar[ProbeTally | None] = ContextVar("watchdog_probe_tally", default=None)


def stream_count() -> StreamCount:
    """The counter of a new exchange, reporting to the running probe's tally (if any)."""
    return StreamCount(CURRENT_TALLY.get())
