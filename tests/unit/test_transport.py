"""The one httpx error classification, and the probe and scrape vocabularies derived from it."""

from __future__ import annotations

import httpx
import pytest

from watchdog.model import ProbeFailure, ScrapeFailure
from watchdog.observe.probes import transport_failure
from watchdog.observe.scrape import scrape_failure
from watchdog.observe.transport import TransportFault, classify_transport_error, describe


def refused_by_cause() -> httpx.ConnectError:
    """A ConnectError whose message hides the refusal; only its cause says so."""
    try:
        try:
            raise ConnectionRefusedError(111, "nope")
        except ConnectionRefusedError as exc:
            raise httpx.ConnectError("All connection attempts failed") from exc
    except httpx.ConnectError as error:
        return error


# (exception, fault, probe before headers, probe after headers, scrape)
TABLE: list[
    tuple[httpx.TransportError, TransportFault, ProbeFailure, ProbeFailure, ScrapeFailure]
] = [
    (
        httpx.ConnectError("[Errno 111] Connection refused"),
        TransportFault.REFUSED,
        ProbeFailure.CONNECT_REFUSED,
        ProbeFailure.CONNECT_REFUSED,
        ScrapeFailure.CONNECT_REFUSED,
    ),
    (
        refused_by_cause(),
        TransportFault.REFUSED,
        ProbeFailure.CONNECT_REFUSED,
        ProbeFailure.CONNECT_REFUSED,
        ScrapeFailure.CONNECT_REFUSED,
    ),
    (
        httpx.ConnectError("[Errno -2] Name or service not known"),
        TransportFault.CONNECT_ERROR,
        ProbeFailure.CONNECT_ERROR,
        ProbeFailure.CONNECT_ERROR,
        ScrapeFailure.CONNECT_ERROR,
    ),
    (
        httpx.ConnectTimeout("timed out"),
        TransportFault.CONNECT_TIMEOUT,
        ProbeFailure.CONNECT_ERROR,
        ProbeFailure.CONNECT_ERROR,
        ScrapeFailure.TIMEOUT,
    ),
    (
        httpx.PoolTimeout("no slot"),
        TransportFault.CONNECT_TIMEOUT,
        ProbeFailure.CONNECT_ERROR,
        ProbeFailure.CONNECT_ERROR,
        ScrapeFailure.TIMEOUT,
    ),
    (
        httpx.ReadTimeout("idle"),
        TransportFault.TIMEOUT,
        ProbeFailure.TIMEOUT_BEFORE_HEADERS,
        ProbeFailure.STALLED_MIDSTREAM,
        ScrapeFailure.TIMEOUT,
    ),
    (
        httpx.WriteTimeout("idle"),
        TransportFault.TIMEOUT,
        ProbeFailure.TIMEOUT_BEFORE_HEADERS,
        ProbeFailure.STALLED_MIDSTREAM,
        ScrapeFailure.TIMEOUT,
    ),
    (
        httpx.ReadError("reset"),
        TransportFault.BROKEN,
        ProbeFailure.CONNECT_ERROR,
        ProbeFailure.MALFORMED,
        ScrapeFailure.CONNECT_ERROR,
    ),
    (
        httpx.RemoteProtocolError("peer closed connection"),
        TransportFault.BROKEN,
        ProbeFailure.CONNECT_ERROR,
        ProbeFailure.MALFORMED,
        ScrapeFailure.CONNECT_ERROR,
    ),
    (
        httpx.WriteError("broken pipe"),
        TransportFault.BROKEN,
        ProbeFailure.CONNECT_ERROR,
        ProbeFailure.MALFORMED,
        ScrapeFailure.CONNECT_ERROR,
    ),
]


@pytest.mark.parametrize("row", TABLE, ids=[f"{type(row[0]).__name__}-{row[1]}" for row in TABLE])
def test_one_classification_two_vocabularies(
    row: tuple[httpx.TransportError, TransportFault, ProbeFailure, ProbeFailure, ScrapeFailure],
) -> None:
    """Each error gets one fault; probes add the phase (headers or not), scrapes do not."""
    exc, fault, before, after, scrape = row
    assert classify_transport_error(exc) is fault
    assert transport_failure(exc, headers_received=False) is before
    assert transport_failure(exc, headers_received=True) is after
    assert scrape_failure(exc) is scrape


def test_describe_names_the_type_and_the_message() -> None:
    """The detail line: type and message, or the type alone when there is no message."""
    assert describe(httpx.ReadTimeout("idle")) == "ReadTimeout: idle"
    assert describe(httpx.ReadTimeout("")) == "ReadTimeout"
