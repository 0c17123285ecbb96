"""Reading HTTP bodies under a byte cap that also bounds what decompression may produce.

httpx's own readers are not bounded: `.text`, `.json()` and `.content` hold the whole body,
`aiter_lines()` buffers a line without a newline whole, and `aiter_bytes()` inflates each network
chunk in one zlib call (a 64 KiB gzip chunk can expand to 64 MiB, a doubly gzipped one to
gigabytes). Here raw bytes are inflated in pieces of at most `_PIECE_BYTES`, so a cap is
checked before memory grows past it. Each endpoint's caps: docs/architecture.md, "Bounded reads".
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import threading
import zlib
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import httpx

T = TypeVar("T")
R = TypeVar("R")

_KIB = 1024
_MIB = 1024 * _KIB
# The most a single zlib call may produce: the memory one inflation step can take.
_PIECE_BYTES = 64 * _KIB
# What the decoders below can undo; sent on every request, so a server that honours it never
# answers in an encoding (br, zstd) that would have to be decoded unbounded.
ACCEPT_ENCODING = {"Accept-Encoding": "gzip, deflate"}
# Bodies up to this size are parsed on the event loop (well under a millisecond per KiB); larger
# ones in a worker thread, so a 15 MiB metrics page cannot hold every other fetch for seconds.
PARSE_ON_LOOP_MAX_BYTES = 256 * _KIB
# Big parses running at once in this process. A page near the 16 MiB cap takes several times its
# size while it is parsed (its text, its lines, the samples), so eight workers' pages parsed side
# by side reached the unit's 1 GiB MemoryMax (tests/unit/test_hostile_load.py). The parse is
# pure Python and holds the GIL, so running more at once gains no speed; the others wait in their
# threads, each holding only its page.
PARSES_AT_ONCE = 1
_PARSE_PERMITS = threading.BoundedSemaphore(PARSES_AT_ONCE)


@dataclass(frozen=True, slots=True)
class CappedBody:
    """The first `limit` (decoded) bytes of a body, and whether the server sent more."""

    data: bytes
    truncated: bool  # the body went on past `limit`; the rest was never read
    limit: int

    def text(self) -> str:
        """The kept bytes as UTF-8 text (invalid bytes replaced)."""
        return self.data.decode("utf-8", errors="replace")


class CapExceeded(Exception):
    """A stream went past a cap (`what`: "line" or "body") of `limit` bytes or characters."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"{what} exceeds the {size_text(limit)} cap")
        self.what = what
        self.limit = limit


def size_text(limit: int) -> str:
    """A cap for humans: "64 KiB", "16 MiB", "300 bytes"."""
    for unit, size in (("GiB", 1024 * _MIB), ("MiB", _MIB), ("KiB", _KIB)):
        if limit >= size and limit % size == 0:
            return f"{limit // size} {unit}"
    return f"{limit} bytes"


class BodyCutShort(httpx.DecodingError):
    """A compressed body ended before its compressed stream did: the rest never arrived."""


class _Inflater:
    """One gzip or deflate layer, inflated in pieces of at most _PIECE_BYTES."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._fed = False
        self._gzip = encoding in ("gzip", "x-gzip")
        # deflate: zlib-wrapped as the RFC says, or raw as some servers send it (tried on failure).
        self._raw_fallback = not self._gzip
        self._inflater = zlib.decompressobj(zlib.MAX_WBITS | 16 if self._gzip else zlib.MAX_WBITS)

    @property
    def cut_short(self) -> bool:
        """Fed, and its stream not ended: gzip and deflate mark their end (gzip checks its
        length too), so a body cut anywhere, even at a line boundary, shows here."""
        return self._fed and not self._inflater.eof

    def feed(self, data: bytes) -> Iterator[bytes]:
        self._fed = self._fed or bool(data)
        while True:
            try:
                piece = self._inflater.decompress(data, _PIECE_BYTES)
            except zlib.error as exc:
                if not self._raw_fallback:
                    raise httpx.DecodingError(f"cannot inflate the body: {exc}") from None
                self._raw_fallback = False
                self._inflater = zlib.decompressobj(-zlib.MAX_WBITS)
                continue
            self._raw_fallback = False
            data = self._inflater.unconsumed_tail
            if piece:
                yield piece
            # A full piece may leave output pending inside zlib even once the input is consumed.
            if self._inflater.eof or (not data and len(piece) < _PIECE_BYTES):
                return


def _layers(headers: httpx.Headers) -> list[_Inflater]:
    """The decoders for Content-Encoding, outermost (applied last by the server) first."""
    out = []
    for value in reversed(headers.get_list("content-encoding", split_commas=True)):
        encoding = value.strip().lower()
        if encoding in ("", "identity"):
            continue
        if encoding not in ("gzip", "x-gzip", "deflate"):
            raise httpx.DecodingError(f"unsupported Content-Encoding {encoding!r}")
        out.append(_Inflater(encoding))
    return out


def _decode(layers: Sequence[_Inflater], data: bytes) -> Iterator[bytes]:
    if not layers:
        if data:
            yield data
        return
    for piece in layers[0].feed(data):
        yield from _decode(layers[1:], piece)


async def aiter_decoded(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    """The body of a streamed response, decoded, in pieces no larger than a network read.

    Raises httpx.DecodingError for a corrupt or unsupported encoding, like httpx itself, and
    BodyCutShort (one) for a compressed body whose stream the connection ended early: a
    close-delimited body has no other sign of it.
    """
    if response.is_stream_consumed:
        # Already read whole before we got it (a test's in-memory transport): nothing to bound.
        if response.content:
            yield response.content
        return
    layers = _layers(response.headers)
    raws = response.aiter_raw()
    try:
        async for raw in raws:
            for piece in _decode(layers, raw):
                yield piece
    finally:
        if isinstance(raws, AsyncGenerator):  # closed now, not whenever it is collected
            await raws.aclose()
    cut = next((layer for layer in layers if layer.cut_short), None)
    if cut is not None:
        raise BodyCutShort(f"the {cut.encoding} body ends before its compressed stream does")


async def read_into(response: httpx.Response, body: bytearray, limit: int) -> bool:
    """Append `response`'s decoded body to `body` up to `limit` bytes; True when there was more.

    What was read stays in `body` when the read fails or is cancelled half-way (for evidence).
    """
    async with contextlib.aclosing(aiter_decoded(response)) as pieces:
        async for piece in pieces:
            room = limit - len(body)
            body += piece[:room]
            if len(piece) > room:
                return True
    return False


async def read_capped(response: httpx.Response, limit: int) -> CappedBody:
    """The first `limit` decoded bytes of `response`; reading stops as soon as more arrive."""
    body = bytearray()
    truncated = await read_into(response, body, limit)
    return CappedBody(bytes(body), truncated, limit)


class _LineSplitter:
    """httpx's line splitting (str.splitlines, a trailing CR held back), with a length cap."""

    _NEWLINES = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"

    def __init__(self, max_chars: int) -> None:
        self._max_chars = max_chars
        self._buffer: list[str] = []
        self._buffered = 0
        self._trailing_cr = False

    def feed(self, text: str) -> list[str]:
        if self._trailing_cr:
            text, self._trailing_cr = "\r" + text, False
        if text.endswith("\r"):
            text, self._trailing_cr = text[:-1], True
        if not text:
            return []
        complete = text[-1] in self._NEWLINES
        lines = text.splitlines()
        if len(lines) == 1 and not complete:
            # Still the same line: kept in pieces (joined once, when it ends) and measured.
            self._keep(lines[0])
            return []
        if self._buffer:
            lines[0] = "".join(self._buffer) + lines[0]
            self._buffer, self._buffered = [], 0
        if not complete:
            self._keep(lines.pop())
        if any(len(line) > self._max_chars for line in lines):
            raise CapExceeded("line", self._max_chars)
        return lines

    def _keep(self, part: str) -> None:
        self._buffer.append(part)
        self._buffered += len(part)
        if self._buffered > self._max_chars:
            raise CapExceeded("line", self._max_chars)

    def flush(self) -> list[str]:
        if not self._buffer and not self._trailing_cr:
            return []
        line = "".join(self._buffer)
        self._buffer, self._buffered, self._trailing_cr = [], 0, False
        return [line]


async def aiter_lines_capped(
    response: httpx.Response, *, max_line_chars: int, max_body_bytes: int
) -> AsyncGenerator[str, None]:
    """The text lines of a streamed response, as httpx's aiter_lines() splits them.

    Raises CapExceeded("line") as soon as one line (terminated or not) is longer than
    `max_line_chars`, and CapExceeded("body") past `max_body_bytes` decoded bytes in all.
    """
    text = codecs.getincrementaldecoder(response.encoding or "utf-8")(errors="replace")
    splitter = _LineSplitter(max_line_chars)
    total = 0
    async with contextlib.aclosing(aiter_decoded(response)) as pieces:
        async for piece in pieces:
            total += len(piece)
            if total > max_body_bytes:
                raise CapExceeded("body", max_body_bytes)
            for line in splitter.feed(text.decode(piece)):
                yield line
    for line in splitter.feed(text.decode(b"", final=True)) + splitter.flush():
        yield line


class ParseBusy(Exception):
    """The previous off-loop parse of this target's bodies is still running; none was started."""


class ParseSlot:
    """Room for one off-loop parse of one target's bodies at a time.

    A thread cannot be stopped: a parse abandoned at the observation deadline runs on, holding
    its page. Without the slot every later cycle would start one more beside it, and the pages
    would pile up towards MemoryMax; with it, at most one page per target is being parsed and
    the thread frees the slot when its parse ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held by the parsing thread, released from it
        self.refused = 0  # parses not started because the previous one was still running

    @property
    def busy(self) -> bool:
        """True while a parse holds the slot."""
        return self._lock.locked()

    def refusal(self) -> str:
        """Count one refused parse (or fetch) and say why, for the failed scrape's detail."""
        self.refused += 1
        return (
            "the previous parse of this target's page is still running "
            f"({self.refused} refused so far); not fetching or parsing another until it ends"
        )

    def take(self) -> None:
        """Hold the slot for one parse; ParseBusy (counted) while another one holds it."""
        if not self._lock.acquire(blocking=False):
            raise ParseBusy(self.refusal())

    def release(self) -> None:
        """Free the slot (called from the parsing thread when it ends)."""
        self._lock.release()


async def _in_thread(parse: Callable[[T], R], data: T, slot: ParseSlot | None) -> R:
    """`parse(data)` in a fresh daemon thread, once one of the PARSES_AT_ONCE permits is free;
    the slot is freed when the parse ends, whether or not anyone still waits for it.

    Not the default executor: an abandoned parse there would queue the next ones behind it
    (holding their pages) and hold up asyncio.run()'s shutdown.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[R] = loop.create_future()

    def succeed(result: R) -> None:
        if not future.done():  # done: the awaiting scrape was cancelled at the deadline
            future.set_result(result)

    def fail(error: BaseException) -> None:
        if not future.done():
            future.set_exception(error)

    def target() -> None:
        outcome: Callable[[], None]
        try:
            with _PARSE_PERMITS:
                result = parse(data)
        except BaseException as exc:  # handed to the awaiting coroutine
            outcome = functools.partial(fail, exc)
        else:
            outcome = functools.partial(succeed, result)
        finally:
            if slot is not None:
                slot.release()
        # RuntimeError: the loop closed while the parse ran; nobody waits any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(outcome)

    try:
        threading.Thread(target=target, name="watchdog-parse", daemon=True).start()
    except BaseException:
        if slot is not None:
            slot.release()
        raise
    return await future


async def parse_sized(
    parse: Callable[[T], R], data: T, size: int, slot: ParseSlot | None = None
) -> R:
    """`parse(data)`, in a worker thread when `size` is over PARSE_ON_LOOP_MAX_BYTES.

    `parse` must be pure (no shared state): it may run concurrently with the event loop. With a
    `slot`, ParseBusy instead of a second thread while the previous parse still runs.
    """
    if size <= PARSE_ON_LOOP_MAX_BYTES:
        return parse(data)
    if slot is not None:
        slot.take()
    return await _in_thread(parse, data, slot)
