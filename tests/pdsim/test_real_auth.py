"""--api-key and --admin-api-key as SGLang 0.5.23 enforces them (sglang/srt/utils/auth.py:74-211,
entrypoints/http_server.py:2886-2898 @ 0.5.23): probes and scrapes never need a key; NORMAL
endpoints need the plain key when one is set; /abort_request (ADMIN_OPTIONAL,
http_server.py:1722-1723) needs the admin key when one is set; a refusal is 401
{"error": "Unauthorized"}."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from pdsim.stack import WorkerProcess

KEY = "plain-key"
ADMIN = "admin-key"
UNAUTHORIZED = {"error": "Unauthorized"}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client shared by one test, closed after it."""
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _status(
    client: httpx.AsyncClient, method: str, url: str, key: str | None = None, **kw: object
) -> int:
    resp = await client.request(method, url, headers=_auth(key), **kw)  # type: ignore[arg-type]
    if resp.status_code == 401:
        assert resp.json() == UNAUTHORIZED
    return resp.status_code


async def test_probes_and_scrapes_need_no_key(
    pd_worker_factory: Callable[..., WorkerProcess], client: httpx.AsyncClient
) -> None:
    """/health*, /ready*, /metrics* and OPTIONS pass without a key (auth.py:98-106 @ 0.5.23)."""
    w = pd_worker_factory("prefill", extra=("--api-key", KEY, "--admin-api-key", ADMIN))
    assert await _status(client, "GET", w.url + "/health") == 200
    assert await _status(client, "GET", w.url + "/health_generate") == 200
    assert await _status(client, "GET", w.url + "/metrics") == 200
    assert await _status(client, "OPTIONS", w.url + "/server_info") != 401


async def test_both_keys(
    pd_worker_factory: Callable[..., WorkerProcess], client: httpx.AsyncClient
) -> None:
    """Both keys: NORMAL endpoints take only the plain key (auth.py:148-151), /abort_request
    only the admin key (auth.py:133-137); a missing, malformed or wrong key is 401."""
    w = pd_worker_factory("prefill", extra=("--api-key", KEY, "--admin-api-key", ADMIN))
    for path in ("/server_info", "/v1/loads", "/v1/models", "/model_info"):
        assert await _status(client, "GET", w.url + path) == 401, path
        assert await _status(client, "GET", w.url + path, "wrong") == 401, path
        assert await _status(client, "GET", w.url + path, ADMIN) == 401, path
        assert await _status(client, "GET", w.url + path, KEY) == 200, path
    basic = await client.get(w.url + "/server_info", headers={"Authorization": f"Basic {KEY}"})
    assert basic.status_code == 401
    gen = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
    assert await _status(client, "POST", w.url + "/generate", json=gen) == 401
    abort = {"rid": "nothing"}
    assert await _status(client, "POST", w.url + "/abort_request", json=abort) == 401
    assert await _status(client, "POST", w.url + "/abort_request", KEY, json=abort) == 401
    assert await _status(client, "POST", w.url + "/abort_request", ADMIN, json=abort) == 200
    assert await _status(client, "GET", w.url + "/no_such_route") == 401


async def test_admin_key_only(
    pd_worker_factory: Callable[..., WorkerProcess], client: httpx.AsyncClient
) -> None:
    """Only --admin-api-key: NORMAL endpoints are open (auth.py:148-151), /abort_request needs
    the admin key (auth.py:133-137)."""
    w = pd_worker_factory("prefill", extra=("--admin-api-key", ADMIN))
    assert await _status(client, "GET", w.url + "/server_info") == 200
    abort = {"rid": "nothing"}
    assert await _status(client, "POST", w.url + "/abort_request", json=abort) == 401
    assert await _status(client, "POST", w.url + "/abort_request", ADMIN, json=abort) == 200


async def test_api_key_only(
    pd_worker_factory: Callable[..., WorkerProcess], client: httpx.AsyncClient
) -> None:
    """Only --api-key: every endpoint but probes needs it, /abort_request included
    (auth.py:138-141)."""
    w = pd_worker_factory("prefill", extra=("--api-key", KEY))
    assert await _status(client, "GET", w.url + "/server_info") == 401
    assert await _status(client, "GET", w.url + "/server_info", KEY) == 200
    abort = {"rid": "nothing"}
    assert await _status(client, "POST", w.url + "/abort_request", json=abort) == 401
    assert await _status(client, "POST", w.url + "/abort_request", KEY, json=abort) == 200
    assert await _status(client, "GET", w.url + "/health") == 200
