"""The one redaction policy: what the watchdog masks before any text leaves the process.

Every line of output (logs, `check`, `plan`, `validate`, incident files, the audit log) passes
through here, because any of it may carry a credential the watchdog never meant to show:

- URL userinfo, `scheme://user:pass@host` and `scheme://token@host` -> `scheme://***@host`: a
  config URL, an httpx error naming it, an `etcd://` or `http://` URL in a `MC_`/`NIXL_` variable.
- Bearer and Basic credentials (`Authorization: Bearer x`, `Bearer x`): error bodies from
  endpoints that echo the request's headers, a proxy's 401 page.
- The value of a secret-named key, in every spelling a log line or a body uses: `api_key=x`,
  `--api-key x`, `--api-key=x`, `"api_key": "x"`, `api_key='x'` (the Python repr of SGLang's
  `server_args`, which a server logs at start-up, keys included), `Authorization: x`.
- The configured secrets themselves, wherever they appear and whatever surrounds them: the
  contents of `api_key_file` and `admin_api_key_file` (`remember_secret`, when a key is read) and
  the credentials of configured URLs with the Basic credential built from them
  (`remember_url_credentials`, when the config is parsed).

Names are judged by `is_secret_name`, once for environment variables, argv flags, JSON keys and
key=value text, so that counts and settings such as `max_tokens=32`, `#new-token: 7`,
`tokenizer_path=...`, `token usage: 0.31` or `NCCL_IB_PKEY` stay readable evidence.

Pure functions over text and JSON-shaped values; the only state is the set of known secret values,
which only grows (a rotated key is remembered when it is read).
"""

from __future__ import annotations

import base64
import functools
import re
import string
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

REDACTED = "***"

# A known secret shorter than this is not searched for as a substring: it would mask every word
# that contains it (a URL password `pass` would turn `"passed": true` into `"***ed": true`). The
# patterns still mask it where they find it (in its URL, after `password=`).
MIN_KNOWN_SECRET_LENGTH = 8

# Name parts (split at anything but letters and digits) that make a name secret anywhere.
_SECRET_ANYWHERE = ("SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "APIKEY", "JWT")
# Last parts that make a name secret: `HF_TOKEN`, `AWS_SESSION_TOKEN`, `--auth`, `*_KEY`, `*_PASS`.
# Only the last part: `TOKEN_USAGE` is a gauge, `TOKENIZER_PATH` a path, `MAX_TOKENS` a count.
_SECRET_LAST = ("TOKEN", "AUTH", "AUTHORIZATION", "COOKIE")
# Last parts that are secret only after a prefix: `API_KEY`, `MC_ETCD_PASS`, `DB_PWD`; alone,
# `key` is a dict key, `pass` a compiler pass and `PWD` the working directory. Every `*_KEY` is
# masked, a `cache_key` too: a guessed list of key kinds would miss the one that mattered.
_SECRET_LAST_WITH_PREFIX = ("KEY", "PASS", "PWD")
# Values that say "not set" rather than hide something: `api_key=None` in server_args.
_UNSET_VALUES = frozenset({"", "None", "none", "null", "NULL", "nil", REDACTED})

_known: set[str] = set()


def remember_secret(value: str | None) -> None:
    """Add a configured secret (a key file's contents) to those masked wherever they appear."""
    if value and len(value) >= MIN_KNOWN_SECRET_LENGTH:
        _known.add(value)


def remember_url_credentials(url: str) -> None:
    """Add the credentials of a configured URL's userinfo to the known secrets: the password, a
    token used as the user name, and the Basic credential httpx sends for them, which an echoing
    endpoint returns bare, without the URL around it."""
    try:
        parts = urlsplit(url)
        user, password = parts.username, parts.password
    except ValueError:
        return
    if user is None and password is None:
        return
    for value in (password, unquote(password or "")) if password is not None else (user,):
        remember_secret(value)
    pair = f"{unquote(user or '')}:{unquote(password or '')}"
    remember_secret(base64.b64encode(pair.encode()).decode())


def known_secrets() -> frozenset[str]:
    """The secret values registered so far."""
    return frozenset(_known)


def forget_secrets() -> None:
    """Drop every registered value (tests only: a process never forgets a key)."""
    _known.clear()


def _name_parts(name: str) -> list[str]:
    return [p for p in re.split(r"[^A-Za-z0-9]+", name.upper()) if p]


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Whether a variable, flag or key of this name holds a credential (see the module docstring).

    >>> [is_secret_name(n) for n in ("HF_TOKEN", "--api-key", "max_tokens", "tokenizer_path")]
    [True, True, False, False]
    """
    parts = _name_parts(name)
    if not parts:
        return False
    if any(marker in part for part in parts for marker in _SECRET_ANYWHERE):
        return True
    last = parts[-1]
    if last in _SECRET_LAST or last.endswith("TOKEN"):  # ACCESSTOKEN, HFTOKEN
        return True
    return len(parts) > 1 and last in _SECRET_LAST_WITH_PREFIX


# Every pattern below runs over untrusted text (journal tails, error bodies, 2 MiB metrics pages):
# each starts only where a word starts (the lookbehinds) and never backtracks through a word
# (possessive quantifiers), so a hostile line costs linear time, not quadratic.

# scheme://userinfo@ : the userinfo runs to the last `@` before the path, so a password with an
# unescaped `@` in it is masked whole.
_URL_USERINFO = re.compile(r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]*+://)([^\s/?#'\"<>\\]*)@")
# The credential after an auth scheme; token68 characters (RFC 7235) plus what API keys use.
_AUTH_SCHEME = re.compile(r"\b(Bearer|Basic)(\s++)[A-Za-z0-9._~+/=:-]++", re.IGNORECASE)
# A name worth asking is_secret_name about contains one of these (`tokens` is a count).
_HINT = r"key|token(?!s)|secret|pass|pwd|auth|jwt|cookie|credential"
# The key=value pattern is tried only at the start of words holding a hint: most of a metrics
# page or a journal tail is never looked at twice.
_HINT_SEARCH = re.compile(_HINT)  # over ASCII-lowered text: ten times faster than (?i)
_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)
_WORD = re.compile(r"[\w.-]*+")
_AUTH_SEARCH = re.compile(r"(?i:bearer|basic)")
# The start of `key = value` / `key: value` / `"key": value` / `--flag value` / `--flag=value`.
# A key starts a word: `#new-token: 7` (an SGLang batch line) is not the key `token`.
_KEY_THEN_SEPARATOR = re.compile(
    rf"(?<![#\w.-])(?P<quote>[\"']?+)(?=[A-Za-z_])(?=[\w.-]*?(?i:{_HINT}))(?P<key>[\w.-]++)\\?+(?P=quote)"
    r"(?P<sep>\s*+[=:]\s*+)"
    rf"|(?<![\w-])--?+(?=[A-Za-z])(?=[\w-]*?(?i:{_HINT}))(?P<flag>[\w-]++)(?P<flagsep>=|[ \t]++)"
)
_SCHEME_VALUE = re.compile(r"(Bearer|Basic)(\s++)[^\s,;'\"<>()\[\]{}\\]++", re.IGNORECASE)
_PLAIN_VALUE = re.compile(r"[^\s,;&'\"<>()\[\]{}\\]++")
_QUOTED_VALUE = {q: re.compile(rf"{q}((?:[^{q}\\]++|\\.)*+)") for q in ("'", '"')}


def _value_span(text: str, start: int) -> tuple[int, int]:
    """(start, end) of the value at `start`: the part to replace, quotes and auth scheme kept."""
    if text.startswith(('\\"', "\\'"), start):  # a value quoted inside a JSON string
        close = text.find(text[start : start + 2], start + 2)
        end = close if close != -1 else len(text)
        return start + 2, end
    quoted = _QUOTED_VALUE.get(text[start : start + 1])
    match = None if quoted is None else quoted.match(text, start)
    if match is not None:  # up to the closing quote, or to the end of a line cut short
        return match.start(1), match.end(1)
    scheme = _SCHEME_VALUE.match(text, start)
    if scheme is not None:  # `Authorization: Bearer x` keeps its scheme
        return start + len(scheme[1]) + len(scheme[2]), scheme.end()
    plain = _PLAIN_VALUE.match(text, start)
    return start, start if plain is None else plain.end()


def _key_starts(text: str) -> Iterator[int]:
    """Where a secret-looking key may start: each word holding a hint (once), and a quote
    before it; in increasing order, in linear time."""
    word_end = 0
    for hint in _HINT_SEARCH.finditer(text.translate(_ASCII_LOWER)):
        if hint.start() < word_end:
            continue  # the word was tried already
        start = hint.start()
        while start > 0 and (text[start - 1].isalnum() or text[start - 1] in "_.-"):
            start -= 1
        if start > 0 and text[start - 1] in "\"'":
            yield start - 1
        yield start
        word = _WORD.match(text, hint.start())
        word_end = hint.end() if word is None else max(word.end(), hint.end())


def _redact_key_values(text: str) -> str:
    out: list[str] = []
    done = 0  # text[:done] is already in `out`
    for position in _key_starts(text):
        match = None if position < done else _KEY_THEN_SEPARATOR.match(text, position)
        if match is None:
            continue  # not a key, or inside a value already masked
        name = match["key"] or match["flag"]
        if not is_secret_name(name):
            continue
        start, end = _value_span(text, match.end())
        value = text[start:end]
        if value in _UNSET_VALUES or value.startswith(REDACTED):
            continue
        if match["flagsep"] and match["flagsep"] != "=" and value.startswith("-"):
            continue  # `--token --next-flag`: a flag with no value
        if match["flag"] and text[match.end() : match.end() + 1] in ("'", '"'):
            start, end = match.end(), min(end + 1, len(text))  # a shell word: quotes go too
        out.append(text[done:start])
        out.append(REDACTED)
        done = end
    out.append(text[done:])
    return "".join(out)


def redact_url(url: str) -> str:
    """`url` with its userinfo (user, password or a token as the user name) replaced by ***."""
    if "://" not in url or "@" not in url:
        return url
    return _URL_USERINFO.sub(_mask_userinfo, url)


def _mask_userinfo(match: re.Match[str]) -> str:
    scheme, userinfo = match.group(1), match.group(2)
    # An ssh:// user is a login name, not a credential (the config refuses ssh passwords), and
    # `plan`, `check` and `validate` must show which account the watchdog uses on each host.
    if scheme.lower() == "ssh://" and ":" not in userinfo:
        return match.group(0)
    return f"{scheme}{REDACTED}@"


def redact_text(text: str, secrets: Iterable[str] | None = None) -> str:
    """`text` with every credential of the policy masked; `secrets` defaults to the known ones."""
    values = known_secrets() if secrets is None else secrets
    for secret in sorted(values, key=len, reverse=True):
        if len(secret) >= MIN_KNOWN_SECRET_LENGTH:
            text = text.replace(secret, REDACTED)
    text = redact_url(text)
    text = _redact_key_values(text)
    if _AUTH_SEARCH.search(text):
        text = _AUTH_SCHEME.sub(rf"\1\2{REDACTED}", text)
    return text


def redact_value(value: Any, secrets: Iterable[str] | None = None) -> Any:
    """`value` made JSON-shaped and redacted: strings through `redact_text`, the string values of
    secret-named keys replaced, tuples as lists, numbers, booleans and None as they are, and any
    other object as its redacted str() (what a JSON dump with default=str would have written)."""
    values = known_secrets() if secrets is None else frozenset(secrets)
    return _redact(value, values)


def _redact(value: Any, secrets: frozenset[str]) -> Any:
    if isinstance(value, str):
        return redact_text(value, secrets)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, Mapping):
        return {
            key: (
                REDACTED
                if isinstance(item, str)
                and isinstance(key, str)
                and is_secret_name(key)
                and item not in _UNSET_VALUES
                else _redact(item, secrets)
            )
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_redact(item, secrets) for item in value]
    return redact_text(str(value), secrets)


def redact_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """argv with the values of secret flags (`--api-key X`, `--api-key=X`, inside `sh -c "..."`
    scripts too) and every other credential masked. SGLang and the router take `--api-key` on
    the command line: a raw cmdline is not safe to store."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next and not arg.startswith("-"):
            out.append(REDACTED)
            mask_next = False
            continue
        mask_next = False
        flag, eq, _ = arg.partition("=")
        if arg.startswith("-") and not arg.startswith("---") and is_secret_name(flag):
            if eq:
                out.append(f"{flag}={REDACTED}")
            else:
                out.append(arg)
                mask_next = True
            continue
        out.append(redact_text(arg))
    return tuple(out)
