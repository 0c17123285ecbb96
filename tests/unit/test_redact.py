"""The redaction policy: each pattern it masks, the near-misses it must leave alone, and its users
(logs, environ and argv capture, journal tails)."""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import pytest
import structlog

from watchdog import redact
from watchdog.evidence.journal import interpret_journalctl, summarise_journal
from watchdog.evidence.procinfo import filter_environ, redact_cmdline
from watchdog.logs import configure_logging
from watchdog.redact import (
    REDACTED,
    is_secret_name,
    redact_argv,
    redact_text,
    redact_url,
    redact_value,
)

# SGLang's start-up line, as the Python repr of its ServerArgs dataclass (single quotes).
SERVER_ARGS = (
    "server_args=ServerArgs(model_path='/models/dsv4', tokenizer_path='/models/dsv4', "
    "api_key='sk-123', admin_api_key='adm-456', max_total_tokens=None, watchdog_timeout=300, "
    "ssl_keyfile=None, ssl_keyfile_password=None, skip_tokenizer_init=False)"
)

MASKED: list[tuple[str, str]] = [
    # URL userinfo: user and password, a token as the user name, any scheme.
    ("http://user:pass@127.0.0.1:30001/v1", "http://***@127.0.0.1:30001/v1"),
    ("https://sk-tok@router.example/health", "https://***@router.example/health"),
    ("etcd://mc:p@ss@10.0.0.1:2379 next", "etcd://***@10.0.0.1:2379 next"),
    ("GET http://u:p@h/x -> 401", "GET http://***@h/x -> 401"),
    # Bearer and Basic credentials, with and without the header name.
    ("Authorization: Bearer sk-abc.def", "Authorization: Bearer ***"),
    ("authorization=Bearer sk-abc", "authorization=Bearer ***"),
    ("rejected Bearer sk-abc", "rejected Bearer ***"),
    ("Basic dXNlcjpwYXNz", "Basic ***"),
    ("x-api-key: sk-abc", "x-api-key: ***"),
    # key=value, key: value, JSON and Python-repr spellings.
    ("api_key=sk-1 token=t-2", "api_key=*** token=***"),
    ("password: hunter2, secret=s3", "password: ***, secret=***"),
    ('{"api_key": "sk-1", "tokens": 3}', '{"api_key": "***", "tokens": 3}'),
    ('{"authorization": "Bearer z"}', '{"authorization": "***"}'),
    ("{'api_key': 'sk-1'}", "{'api_key': '***'}"),
    ("api_key='sk-123', admin_api_key=None", "api_key='***', admin_api_key=None"),
    ('detail: "api_key=\\"sk-1\\""', 'detail: "api_key=\\"***\\""'),
    ('body: "{\\"api_key\\": \\"sk-1\\"}"', 'body: "{\\"api_key\\": \\"***\\"}"'),
    ("self.api_key=sk-1", "self.api_key=***"),
    ("https://h/login?user=a&password=p1", "https://h/login?user=a&password=***"),
    # argv inside one string (a journal line, a `sh -c` script), both spellings.
    ("sglang --api-key sk-1 --tp 8", "sglang --api-key *** --tp 8"),
    ("router --auth=a1 --token  t1", "router --auth=*** --token  ***"),
    ("sglang --admin-api-key 'k 1' --tp 8", "sglang --admin-api-key *** --tp 8"),
    ("HF_TOKEN=hf_abc AWS_SECRET_ACCESS_KEY=a", "HF_TOKEN=*** AWS_SECRET_ACCESS_KEY=***"),
]

# Must come through unchanged: counts, paths and settings whose names only look like secrets.
NEAR_MISSES = [
    "max_tokens=32",
    "num_tokens: 5",
    "max_new_tokens=128, max_total_tokens=4096",
    "tokenizer_path='/models/dsv4', skip_tokenizer_init=False",
    "Prefill batch. #new-seq: 1, #new-token: 7, #cached-token: 0, token usage: 0.00, "
    "#running-req: 0, #queue-req: 0",
    "Decode batch. #running-req: 1, #token: 45, token usage: 0.12, gen throughput (token/s): 12.3",
    "api_key=None admin_api_key=None ssl_keyfile_password=None",
    '"api_key": null',
    "http://127.0.0.1:30000/v1/completions",
    "key=value pass=1 PWD=/srv",
    "--max-total-tokens 4096 --tokenizer-path /m --ssl-keyfile /k.pem",
    "--token --next-flag",
    "user@example.com wrote",
    'sglang:num_used_tokens{model_name="dsv4",tp_rank="0"} 5',
]


@pytest.mark.parametrize(("text", "expected"), MASKED)
def test_masks_each_pattern(text: str, expected: str) -> None:
    """Every credential pattern of the policy is masked, its surroundings kept."""
    assert redact_text(text) == expected


@pytest.mark.parametrize("text", NEAR_MISSES)
def test_leaves_near_misses_alone(text: str) -> None:
    """Counts, paths and unset values whose names look secret are not masked."""
    assert redact_text(text) == text


def test_server_args_keeps_everything_but_the_keys() -> None:
    """SGLang's server_args line loses its two keys and nothing else."""
    assert redact_text(SERVER_ARGS) == SERVER_ARGS.replace("sk-123", REDACTED).replace(
        "adm-456", REDACTED
    )


def test_redaction_is_idempotent() -> None:
    """Redacting twice changes nothing more (outputs pass through several layers)."""
    for text, _ in MASKED:
        once = redact_text(text)
        assert redact_text(once) == once


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("HUGGING_FACE_HUB_TOKEN", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("AWS_SESSION_TOKEN", True),
        ("MC_ETCD_PASS", True),
        ("NIXL_DB_PASSWORD", True),
        ("SGLANG_ROUTER_JWT", True),
        ("NIXL_AUTH_TOKEN", True),
        ("GITHUB_ACCESSTOKEN", True),
        ("SGLANG_API_KEY", True),
        ("DB_PWD", True),
        ("--admin-api-key", True),
        ("--auth", True),
        ("Authorization", True),
        ("client_secret_id", True),
        ("MAX_TOKENS", False),
        ("TOKENIZER_PATH", False),
        ("TOKEN_USAGE", False),
        ("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", False),
        ("NCCL_IB_PKEY", False),
        ("KEY", False),
        ("PWD", False),
        ("PASS", False),
        ("--ssl-keyfile", False),
        ("", False),
    ],
)
def test_secret_names(name: str, secret: bool) -> None:
    """Names are judged by their parts: the last one for TOKEN/KEY/PASS, any for SECRET/PASSWORD."""
    assert is_secret_name(name) is secret


def test_known_secrets_are_masked_in_any_form() -> None:
    """A registered key is masked wherever it appears; short values are not registered."""
    redact.remember_secret("sk-watchdog-9f3e")
    redact.remember_secret("ab")
    assert redact.known_secrets() == frozenset({"sk-watchdog-9f3e"})
    assert redact_text("got sk-watchdog-9f3e (len 16)") == "got *** (len 16)"
    assert redact_text("no secret here: ab") == "no secret here: ab"
    assert redact_text("x sk-other", secrets=["sk-other"]) == "x ***"


def test_redact_url() -> None:
    """URL userinfo goes whole; a URL without it is unchanged."""
    assert redact_url("http://user:pw@h:1") == "http://***@h:1"
    assert redact_url("http://tok@h") == "http://***@h"
    assert redact_url("http://h:1/p") == "http://h:1/p"


def test_redact_value_walks_json_shapes() -> None:
    """Strings are redacted, secret-named string values replaced, other objects stringified."""
    value = {
        "api_key": "sk-1",
        "admin_api_key": None,
        "max_tokens": 32,
        "tokens": [1, 2],
        "detail": "GET http://u:p@h/ -> 401",
        "nested": ({"password": "p"}, httpx.URL("http://tok@h/")),
    }
    assert redact_value(value) == {
        "api_key": "***",
        "admin_api_key": None,
        "max_tokens": 32,
        "tokens": [1, 2],
        "detail": "GET http://***@h/ -> 401",
        "nested": [{"password": "***"}, "http://***@h/"],
    }


# ------------------------------------------------------------------ environ and argv capture


def test_environ_denies_by_pattern_inside_the_allowlist() -> None:
    """Allowlisted names matching a deny pattern are redacted; URL credentials in values masked."""
    env = {
        "HF_TOKEN": "hf_live",
        "HUGGING_FACE_HUB_TOKEN": "hf_live2",
        "AWS_SECRET_ACCESS_KEY": "aws1",
        "AWS_SESSION_TOKEN": "aws2",
        "SGLANG_HF_TOKEN": "hf_live3",
        "MC_ETCD_PASS": "etcdpass",
        "NIXL_ROUTER_JWT": "jwt1",
        "MC_S3_SECRET_KEY_ID": "s3",
        "MC_METADATA_SERVER": "etcd://mc:mcpass@10.0.0.1:2379",
        "NIXL_ETCD_ENDPOINTS": "http://tok-abc@10.0.0.2:2379",
        "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "4096",
        "NCCL_IB_PKEY": "0",
    }
    assert filter_environ(env) == {
        "MC_ETCD_PASS": "***",
        "MC_METADATA_SERVER": "etcd://***@10.0.0.1:2379",
        "MC_S3_SECRET_KEY_ID": "***",
        "NCCL_IB_PKEY": "0",
        "NIXL_ETCD_ENDPOINTS": "http://***@10.0.0.2:2379",
        "NIXL_ROUTER_JWT": "***",
        "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "4096",
        "SGLANG_HF_TOKEN": "***",
    }


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["r", "--auth", "a1", "--tp", "8"], ("r", "--auth", "***", "--tp", "8")),
        (["r", "--auth=a1"], ("r", "--auth=***")),
        (["s", "--admin-api-key", "k"], ("s", "--admin-api-key", "***")),
        (["s", "--admin-api-key=k"], ("s", "--admin-api-key=***")),
        (["s", "--password", "p", "--token=t"], ("s", "--password", "***", "--token=***")),
        (["s", "--token", "--tp", "8"], ("s", "--token", "--tp", "8")),
        (["s", "--max-total-tokens", "4096"], ("s", "--max-total-tokens", "4096")),
        (["s", "--tokenizer-path", "/m"], ("s", "--tokenizer-path", "/m")),
        (
            ["s", "--dist-init-addr", "http://u:p@h:5000"],
            ("s", "--dist-init-addr", "http://***@h:5000"),
        ),
        (["sh", "-c", "exec r --auth a1 --x 1"], ("sh", "-c", "exec r --auth *** --x 1")),
    ],
)
def test_argv(argv: list[str], expected: tuple[str, ...]) -> None:
    """Secret flag values are masked in both spellings; other flags and their values are kept."""
    assert redact_argv(argv) == expected
    assert redact_cmdline(argv) == expected


# ------------------------------------------------------------------ journal tails


def test_journal_tail_is_redacted_and_still_summarised() -> None:
    """journalctl output loses server_args' keys; batch lines and failures still count."""
    stdout = (
        f"2026-11-29T07:40:00+0000 h python[2]: {SERVER_ARGS}\n"
        "2026-11-29T07:40:05+0000 h python[2]: Decode batch. #running-req: 1, #token: 45, "
        "token usage: 0.12, gen throughput (token/s): 12.3\n"
        "2026-11-29T07:40:06+0000 h python[2]: transfer failed for request rid=1\n"
    )
    excerpt = interpret_journalctl("d.service", 0, stdout, "")
    assert "sk-123" not in excerpt.text
    assert "adm-456" not in excerpt.text
    assert "api_key='***'" in excerpt.text
    summary = summarise_journal(excerpt.text)
    assert summary.last_batch_at is not None
    assert summary.failures == (("transfer_failed", 1),)


# ------------------------------------------------------------------ logs


@pytest.mark.parametrize("log_format", ["json", "console"])
def test_logs_are_redacted(log_format: str) -> None:
    """Every field of every event, exception text included, goes through the policy."""
    redact.remember_secret("sk-known-4242")
    out = io.StringIO()
    configure_logging(log_format, "debug", stream=out)  # type: ignore[arg-type]
    log = structlog.get_logger()
    log.warning(
        "probe_failed",
        url=httpx.URL("http://user:hunter2@127.0.0.1:30001/v1/completions"),
        detail='HTTP 401: {"authorization": "Bearer sk-echoed-1"} rejected sk-known-4242',
        fields={"api_key": "sk-in-a-dict", "max_tokens": 4},
        raw="saw sk-known-4242",
    )
    try:
        raise RuntimeError(f"cannot reach http://tok-xyz@h/: {SERVER_ARGS}")
    except RuntimeError:
        log.exception("cycle_failed")
    text = out.getvalue()
    for secret in ("hunter2", "sk-echoed-1", "sk-in-a-dict", "sk-known-4242", "tok-xyz", "sk-123"):
        assert secret not in text, secret
    assert "max_tokens" in text
    assert "RuntimeError" in text
    if log_format == "json":
        first = json.loads(text.splitlines()[0])
        assert first["url"] == "http://***@127.0.0.1:30001/v1/completions"


def test_url_credentials_become_known_secrets() -> None:
    """A configured URL's password, a token as its user, and their Basic form are remembered."""
    redact.remember_url_credentials("http://user:p%40ss-word@h:1")
    redact.remember_url_credentials("http://tok-abc123@h:2")
    redact.remember_url_credentials("http://h:3")
    basic = base64.b64encode(b"user:p@ss-word").decode()
    assert {"p%40ss-word", "p@ss-word", "tok-abc123", basic} <= redact.known_secrets()
    assert redact_text(f"echo {basic} p@ss-word tok-abc123") == "echo *** *** ***"
    redact.remember_url_credentials("http://u:pass@h:4")  # too short to search for bare
    assert "pass" not in redact.known_secrets()
    assert redact_text('"passed": true, http://u:pass@h:4') == '"passed": true, http://***@h:4'


@pytest.mark.parametrize(
    "hostile",
    [
        "a+" * 131072,  # scheme characters with no "://"
        "x://" * 65536,
        "http://" + "a:" * 131072,  # userinfo with no "@"
        "tokentoken" * 26214,  # one word, a hint every five characters
        "token= " * 37449,  # every word a secret key
        "Bearer " * 37449,
        "'" * 262144,
        '"api_key": "' + "\\\\" * 131072,
    ],
)
def test_hostile_text_costs_linear_time(hostile: str) -> None:
    """A 256 KiB line built against each pattern is redacted in seconds, not minutes: no pattern
    backtracks through a word (a quadratic one takes minutes here; the bound is generous)."""
    started = time.thread_time()  # CPU time: other work on the machine does not count
    redact_text(hostile)
    assert time.thread_time() - started < 10
