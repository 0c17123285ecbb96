"""What an httpx transport error says about the wire, classified once for probes and scrapes.

Probes and scrapes each report in their own vocabulary (ProbeFailure, ScrapeFailure); both derive
it from the one TransportFault here, so "refused" or "timed out" means the same thing in each.
"""

from __future__ import annotations

from enum import StrEnum

import httpx


class TransportFault(StrEnum):
    """The part of an HTTP exchange an httpx.TransportError broke."""

    REFUSED = "refused"  # nothing listens on the port (ECONNREFUSED)
    CONNECT_ERROR = "connect_error"  # no connection for another reason (unreachable, reset, DNS)
    CONNECT_TIMEOUT = "connect_timeout"  # no connection, or no pool slot, within the timeout
    TIMEOUT = "timeout"  # connected, then a read or write went idle past the timeout
    BROKEN = "broken"  # connected, then the peer closed, reset or garbled the exchange


def classify_transport_error(exc: httpx.TransportError) -> TransportFault:
    """The TransportFault of an httpx transport error."""
    if isinstance(exc, httpx.ConnectError):
        return (
            TransportFault.REFUSED if is_connection_refused(exc) else TransportFault.CONNECT_ERROR
        )
    if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
        return TransportFault.CONNECT_TIMEOUT
    if isinstance(exc, httpx.TimeoutException):
        return TransportFault.TIMEOUT
    # Read, write, close, protocol, proxy, unsupported-protocol errors.
    return TransportFault.BROKEN


def is_connection_refused(exc: BaseException) -> bool:
    """Whether an httpx connect error was caused by a refused TCP connection."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ConnectionRefusedError):
            return True
        # httpcore keeps the OS error only in the message on some paths (e.g. "[Errno 111] ...").
        if "Connection refused" in str(current) or "Errno 111" in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def describe(exc: BaseException) -> str:
    """A one-line description of an exception, for a result's detail (never carries headers)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
