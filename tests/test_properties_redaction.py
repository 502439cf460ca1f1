"""Secrets never leave the process: arbitrary secret values, regex metacharacters and
non-ASCII included, are masked in text, in bytes, in nested events and by the log chain; in
every form they get printed in (URL-quoted, JSON- and backslash-escaped, whitespace-collapsed)
and encoded in (hex, base64 alone and inside a longer base64 text, issue 38); through every
cut of a tail, a line or a console file; credentials in URLs and Authorization headers are
masked though nobody named them; settings under secret-looking keys are not secrets
(issue 11)."""

from __future__ import annotations

import base64
import io
import json
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import structlog
from conftest import printed_forms
from hypothesis import assume, given
from hypothesis import strategies as st
from test_redact import carrying, encoded_forms

from fsm.output import log
from fsm.output.redact import MASK, Redactor

METACHARS = ".^$+?{}[]\\|()-#&~:<>=!/\"'\n\t "
#: A secret value: at least 4 characters (shorter values are never masked, by design),
#: regex metacharacters and non-ASCII welcome. Never containing "*": the mask is made of
#: stars, so a secret with stars could be re-formed by the mask and its neighbours.
SECRETS = st.text(
    alphabet=st.characters(exclude_characters="*", exclude_categories=["Cs"])
    | st.sampled_from(METACHARS),
    min_size=4,
    max_size=40,
)
#: Surrounding text: anything, stars included.
TEXT = st.text(max_size=60)


@st.composite
def texts_with(draw: st.DrawFn, secrets: list[str]) -> str:
    """Text that holds each secret at least once, between arbitrary text."""
    parts = [draw(TEXT)]
    for secret in draw(st.permutations(secrets)):
        for _ in range(draw(st.integers(1, 2))):
            parts += [secret, draw(TEXT)]
    return "".join(parts)


@given(st.lists(SECRETS, min_size=1, max_size=4, unique=True), st.data())
def test_no_secret_survives_redacting_a_text(secrets: list[str], data: st.DataObject) -> None:
    text = data.draw(texts_with(secrets))
    redacted = Redactor(secrets).text(text)
    for secret in secrets:
        assert secret not in redacted
    assert MASK in redacted


@given(st.lists(SECRETS, min_size=1, max_size=4, unique=True), TEXT)
def test_a_text_without_secrets_is_left_alone(secrets: list[str], text: str) -> None:
    """The redactor masks nothing that is not secret: no printed form of a secret, no URL
    credentials, no Authorization value, no bearer token in the text, no change."""
    assume(not any(form in text for secret in secrets for form in all_forms(secret)))
    assume("://" not in text and not re.search("authorization|bearer", text, re.IGNORECASE))
    assert Redactor(secrets).text(text) == text


@given(st.lists(SECRETS, min_size=1, max_size=4, unique=True), st.data())
def test_no_secret_survives_redacting_console_bytes(
    secrets: list[str], data: st.DataObject
) -> None:
    """The console is bytes, maybe binary: the secrets' UTF-8 never survives."""
    chunks = [data.draw(st.binary(max_size=40))]
    for secret in secrets:
        chunks += [secret.encode(), data.draw(st.binary(max_size=40))]
    redacted = Redactor(secrets).bytes(b"".join(chunks))
    for secret in secrets:
        assert secret.encode() not in redacted


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda children: st.lists(children, max_size=4)
    | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _plant(value: Any, secret: str, draw: Callable[[st.SearchStrategy[Any]], Any]) -> Any:
    """``value`` with the secret planted into some of its strings."""
    if isinstance(value, str):
        return value + secret + value if draw(st.booleans()) else value
    if isinstance(value, dict):
        return {k: _plant(v, secret, draw) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plant(v, secret, draw) for v in value)
    return value


@given(SECRETS, JSONISH, st.data())
def test_no_secret_survives_in_a_nested_event_and_its_shape_is_kept(
    secret: str, value: Any, data: st.DataObject
) -> None:
    planted = {"error": f"boom {secret}", "nested": _plant(value, secret, data.draw)}
    redacted = Redactor([secret]).deep(planted)
    for text in _strings(redacted):
        assert secret not in text
    assert _shape(redacted) == _shape(planted)


def _strings(value: Any) -> Iterator[str]:
    """Every string value (not dict keys: events and markers have fixed, secret-free keys)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _shape(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return (type(value).__name__, [_shape(v) for v in value])
    return type(value).__name__


SECRET_KEY_NAMES = st.builds(
    lambda pre, word, post: pre + word + post,
    st.text(alphabet="ABCXYZ_", max_size=4),
    st.sampled_from(["TOKEN", "token", "Key", "SECRET", "PassWord", "API_KEY"]),
    st.text(alphabet="ABCXYZ_", max_size=4),
)


def _looks_like_a_setting(value: str) -> bool:
    """A boolean word or a number (those are settings, not secrets)."""
    return re.fullmatch(r"\s*(true|false|yes|no|on|off|[-+0-9.eE]+)\s*", value, re.I) is not None


#: A value that is no boolean word and no number (those are settings, not secrets).
NOT_SETTINGS = SECRETS.filter(lambda v: not _looks_like_a_setting(v))


@given(
    st.dictionaries(SECRET_KEY_NAMES, NOT_SETTINGS, min_size=1, max_size=3),
    st.dictionaries(st.sampled_from(["DB_DSN", "WANDB_ENTITY", "PLAIN"]), SECRETS, max_size=2),
    st.booleans(),
)
def test_every_secret_looking_or_listed_key_of_the_env_is_masked(
    secret_env: dict[str, str], listed_env: dict[str, str], with_hf: bool
) -> None:
    env = {**secret_env, **listed_env}
    if with_hf:
        env["HF_TOKEN"] = "hf_" + "x" * 20
    redactor = Redactor()
    assert redactor.learn(env, list(listed_env)) == set(env)
    text = " | ".join(f"{k}={v}" for k, v in env.items())
    redacted = redactor.text(text)
    for value in env.values():
        assert value not in redacted


# --- printed forms, cuts and credentials nobody named (issue 11) ------------------------------

#: Characters of the text around a secret in the properties below. They are never part of a
#: secret and no encoding produces them, and neither does the mask: a text built from these
#: around a secret's forms cannot overlap the secret, so what the redactor must keep is exact.
AROUND_CHARS = "ÆØÅæøåÐÞßŒœ"
#: Characters printed in URLs, JSON and shells that redactors trip over.
SPECIAL = "@/:?#&=+%\"'\\!$;,[]{}<> \t\n\r"
#: A secret: any Unicode text (no lone surrogates, no stars, no AROUND_CHARS), URL-special
#: characters, whitespace and newlines welcome; 8 to 200 characters.
LONG_SECRETS = st.text(
    alphabet=st.characters(exclude_characters=AROUND_CHARS + "*", exclude_categories=["Cs"])
    | st.sampled_from(SPECIAL),
    min_size=8,
    max_size=200,
)
#: Text between secrets: starts and ends with an AROUND_CHARS character, whitespace only
#: single and between them (so no secret form can extend into it, and collapsing it is exact).
AROUND = st.builds(
    lambda first, middle: first + "".join(middle),
    st.sampled_from(AROUND_CHARS),
    st.lists(
        st.sampled_from(AROUND_CHARS)
        | st.tuples(st.sampled_from(" \n\t"), st.sampled_from(AROUND_CHARS)).map("".join),
        max_size=6,
    ),
)
FRAGMENT = 10
_OUTSIDE = re.compile(f"[^{re.escape(AROUND_CHARS)}*]+")


def all_forms(secret: str) -> list[str]:
    """Every form the redactor must know: printed (conftest) and encoded (test_redact)."""
    return sorted({*printed_forms(secret), *encoded_forms(secret)}, key=len)


def leak(output: str, secret: str) -> str | None:
    """A piece of ``output`` that gives the secret away: 10 or more consecutive characters of
    one of its printed or encoded forms (the whole form when it is shorter), or None.

    Neither the mask nor the text around the secret (AROUND_CHARS) has a character of any
    form, so such a piece can only lie inside a run of other characters: only those runs
    are searched."""
    forms = all_forms(secret)
    runs: list[str] = _OUTSIDE.findall(output)
    for run in runs:
        for form in forms:
            if len(form) < FRAGMENT:
                if form in run:
                    return form
                continue
            for i in range(len(run) - FRAGMENT + 1):
                if run[i : i + FRAGMENT] in form:
                    return run[i : i + FRAGMENT]
    return None


def around_each(forms: list[str], data: st.DataObject) -> tuple[str, str]:
    """A text with each form once between AROUND text, and that text redacted (each form
    becomes the mask, everything else stays)."""
    parts = [data.draw(AROUND) for _ in range(len(forms) + 1)]
    text = parts[0] + "".join(f + p for f, p in zip(forms, parts[1:], strict=True))
    return text, parts[0] + "".join(MASK + p for p in parts[1:])


@given(LONG_SECRETS, st.data())
def test_every_printed_form_of_a_secret_is_masked_whole_and_its_surroundings_kept(
    secret: str, data: st.DataObject
) -> None:
    """URL-quoted, JSON-escaped, backslash-escaped and whitespace-collapsed forms, hex and
    base64 (alone, and the stable core of each alignment inside a longer base64 text) are
    masked like the secret itself, in text and in UTF-8 bytes; the text around them is
    unchanged."""
    text, expected = around_each(all_forms(secret), data)
    assert leak(text, secret), "the leak check sees the unredacted text"
    redactor = Redactor([secret])
    assert redactor.text(text) == expected
    assert redactor.bytes(text.encode()) == expected.encode()
    assert leak(redactor.text(text), secret) is None


def _cuts(size: int, data: st.DataObject, every: int = 1_500) -> Iterable[int]:
    """Every cut offset of a text this long, or (for long ones) both ends and a sample."""
    if size <= every:
        return range(size + 1)
    sample = data.draw(st.lists(st.integers(0, size), min_size=150, max_size=150))
    return sorted({0, 1, 2, size - 2, size - 1, size, *sample})


@given(LONG_SECRETS, st.data())
def test_keeping_the_last_or_first_characters_never_cuts_a_secret_into_a_leak(
    secret: str, data: st.DataObject
) -> None:
    """Redact, then shorten: at every cut offset (through every printed form) the result is
    the redacted text's end (start), with no piece of the secret, where cutting first would
    have left one."""
    text, expected = around_each(all_forms(secret), data)
    redactor = Redactor([secret])
    for n in _cuts(len(text), data):
        last, first = redactor.keep_last(text, n), redactor.keep_first(text, n)
        assert last == (expected[-n:] if n else "")
        assert first == expected[:n]
        assert leak(last, secret) is None and leak(first, secret) is None
    raw = text.encode()
    for n in _cuts(len(raw), data):
        kept = redactor.keep_last_bytes(raw, n)
        assert kept == (expected.encode()[-n:] if n else b"")
        assert leak(kept.decode("utf-8", "replace"), secret) is None


@given(LONG_SECRETS, st.data())
def test_the_one_line_form_redacts_before_collapsing_whitespace_and_cutting(
    secret: str, data: st.DataObject
) -> None:
    """A secret with newlines (a PEM key) is masked before its whitespace is collapsed; the
    line is the redacted text on one line, cut at any length."""
    text, expected = around_each(all_forms(secret), data)
    one_line = " ".join(expected.split())
    redactor = Redactor([secret])
    for n in _cuts(len(text), data, every=400):
        line = redactor.line(text, n)
        assert line == one_line[:n]
        assert leak(line, secret) is None


@given(LONG_SECRETS, st.data())
def test_a_console_tail_cut_through_a_secret_holds_no_piece_of_it(
    secret: str, data: st.DataObject
) -> None:
    """The file's read window starts inside a printed form (at every offset of short forms,
    at the sensitive ones and a sample of long forms), with enough masked copies after it
    that the kept bytes reach back into the cut piece: the piece is masked or shorter than 10
    characters, and the text after it is kept."""
    redactor = Redactor([secret])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "console.txt"
        for form in all_forms(secret):
            raw = form.encode()
            copies = min(64, redactor.longest // max(1, len(raw) - len(MASK)) + 2)
            head = data.draw(AROUND).encode()
            gaps = [data.draw(AROUND) for _ in range(copies)]
            end = data.draw(AROUND)
            short = redactor.longest + 1 - len(("".join(gap + form for gap in gaps)).encode())
            end += AROUND_CHARS[0] * max(0, short)  # the window can start anywhere in ``raw``
            after = ("".join(gap + form for gap in gaps) + end).encode()
            after_redacted = ("".join(gap + MASK for gap in gaps) + end).encode()
            path.write_bytes(head + raw + after)
            size = len(head) + len(raw) + len(after)
            if len(raw) <= 40:
                offsets: Iterable[int] = range(len(raw))
            else:
                edge = len(raw) - len(form[-FRAGMENT:].encode())
                sample = data.draw(st.lists(st.integers(0, len(raw) - 1), max_size=12))
                offsets = {0, 1, edge - 1, edge, edge + 1, len(raw) - 1, *sample}
            for at in offsets:
                limit = size - redactor.longest - (len(head) + at)
                assert limit > 0
                tail = redactor.tail_of(path, limit)
                assert tail.endswith(after_redacted[-limit:]), (at, tail)
                assert leak(tail.decode("utf-8", "replace"), secret) is None, (at, tail)


# --- inside a longer base64 text (issue 38) ----------------------------------------------------

ALPHABETS = {"standard": base64.b64encode, "url-safe": base64.urlsafe_b64encode}


@st.composite
def in_base64(draw: st.DrawFn, secret: str) -> tuple[str, str]:
    """A base64 text (either alphabet, padded or not) holding the secret's bytes after
    3k + 0, 1 or 2 other bytes, then maybe more bytes; and that text as it must come out of
    the redactor: the characters that carry a bit of the secret (the two it shares with its
    neighbours included) and the padding right after them become one mask.

    The other bytes are none of the secret's (0xFF is never in UTF-8), and a text where a
    form of the secret shows up elsewhere by chance (a secret of slashes in the base64 of
    0xFF bytes) is no example: what must be masked is exact."""
    raw = secret.encode()
    others = st.binary(max_size=10).map(lambda b: bytes(x for x in b if x not in raw))
    offset = draw(st.integers(0, 2))
    before = draw(others)
    before += b"\xff" * ((offset - len(before)) % 3)
    after = draw(others)
    blob = ALPHABETS[draw(st.sampled_from(sorted(ALPHABETS)))](before + raw + after).decode()
    if not draw(st.booleans()):
        blob = blob.rstrip("=")
    first, last = carrying(len(before), len(raw))
    if not after:
        last = len(blob)  # the padding goes with it
    assume(not any(form in blob for form in printed_forms(secret)))
    for form in encoded_forms(secret):
        at = blob.find(form)
        while at >= 0:
            assume(first <= at and at + len(form) <= last)
            at = blob.find(form, at + 1)
    return blob, blob[:first] + MASK + blob[last:]


@given(LONG_SECRETS, st.data())
def test_a_secret_inside_a_longer_base64_text_loses_every_character_that_carries_its_bits(
    secret: str, data: st.DataObject
) -> None:
    """At each alignment, in either alphabet, padded or not, with or without bytes after
    it: exactly the characters that carry the secret's bits are masked (so no 10 of its
    stable core remain), in text, in bytes and on a line; the text around is kept."""
    blob, expected_blob = data.draw(in_base64(secret))
    left, right = data.draw(AROUND), data.draw(AROUND)
    text, expected = left + blob + right, left + expected_blob + right
    assert leak(text, secret), "the leak check sees the unredacted text"
    redactor = Redactor([secret])
    assert redactor.text(text) == expected
    assert redactor.bytes(text.encode()) == expected.encode()
    assert redactor.line(text, 10_000) == " ".join(expected.split())
    assert leak(expected, secret) is None


@given(LONG_SECRETS, st.data())
def test_a_console_tail_cut_through_a_base64_text_holding_a_secret_holds_no_piece_of_it(
    secret: str, data: st.DataObject
) -> None:
    """The read window starts anywhere in a longer base64 text holding the secret (at any
    alignment), with masked copies after it that make the kept bytes reach back to the
    window's first byte: what is left of the secret's characters is masked or shorter than
    10 characters, and the text after it is kept as redacted."""
    blob, expected_blob = data.draw(in_base64(secret))
    redactor = Redactor([secret])
    copies = min(64, redactor.longest // max(1, len(blob) - len(expected_blob)) + 2)
    gaps = [data.draw(AROUND) for _ in range(copies)]
    after = "".join(gap + blob for gap in gaps) + AROUND_CHARS[0] * (redactor.longest + 1)
    after_redacted = ("".join(gap + expected_blob for gap in gaps)
                      + AROUND_CHARS[0] * (redactor.longest + 1)).encode()
    head = data.draw(AROUND).encode()
    content = head + blob.encode() + after.encode()
    sample = data.draw(st.lists(st.integers(0, len(blob) - 1), max_size=16))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "console.txt"
        path.write_bytes(content)
        for at in sorted({0, 1, len(blob) - 1, *sample}):
            limit = len(content) - redactor.longest - (len(head) + at)
            tail = redactor.tail_of(path, limit)
            assert tail.endswith(after_redacted[-limit:]), (at, tail[:200])
            assert leak(tail.decode("utf-8", "replace"), secret) is None, (at, tail[:200])


# --- credentials nobody named ------------------------------------------------------------

SCHEMES = st.from_regex(r"[a-z][a-z0-9+.\-]{0,8}", fullmatch=True).filter(
    lambda s: not s.endswith(("+", ".", "-"))
)
HOSTS = st.from_regex(r"[a-z0-9]{1,10}(\.[a-z0-9]{1,10}){0,2}(:[0-9]{2,5})?", fullmatch=True)
PATHS = st.from_regex(r"(/[A-Za-z0-9._~@%\-]{0,10}){0,3}", fullmatch=True)
#: Userinfo characters as typed into a URL without quoting ("@" and ":" included).
RAW_USERINFO = st.text(
    alphabet=st.characters(
        exclude_characters="/?#\"'<>\\`*", exclude_categories=["Cs", "Cc", "Zs", "Zl", "Zp"]
    ),
    min_size=1,
    max_size=30,
)


@given(
    SCHEMES, st.text(max_size=20), st.text(max_size=30), RAW_USERINFO, HOSTS, PATHS,
    st.booleans(),
)
def test_url_credentials_are_masked_though_nobody_named_them(
    scheme: str, user: str, password: str, raw: str, host: str, path: str, quoted: bool
) -> None:
    """``scheme://user:password@host``, quoted as a URL must be or typed raw ("@" and ":"
    in the password included), keeps its scheme, host and path; the userinfo becomes the
    mask, in text and bytes."""
    userinfo = quote(user, safe="") + ":" + quote(password, safe="") if quoted else raw
    text = f"clone {scheme}://{userinfo}@{host}{path} failed"
    expected = f"clone {scheme}://{MASK}@{host}{path} failed"
    assert Redactor().text(text) == expected
    assert Redactor().bytes(text.encode()) == expected.encode()


@given(SCHEMES, RAW_USERINFO, HOSTS, PATHS)
def test_a_token_alone_before_the_host_is_masked(
    scheme: str, token: str, host: str, path: str
) -> None:
    text = f"pip: {scheme}://{token}@{host}{path}\n"
    assert Redactor().text(text) == f"pip: {scheme}://{MASK}@{host}{path}\n"


TOKEN68 = st.from_regex(r"[A-Za-z0-9\-._~+/]{1,60}=*", fullmatch=True)
AUTH_SCHEMES = st.sampled_from(["Bearer", "bearer", "Basic", "Token", "Digest", "AWS4"])


@given(AUTH_SCHEMES, TOKEN68, st.sampled_from(["header", "query", "json", "repr", "bare"]))
def test_an_authorization_value_and_a_bearer_token_never_survive(
    auth_scheme: str, token: str, shape: str
) -> None:
    """An Authorization value (header line, query, JSON, a dict's repr) and a bare bearer
    token become the mask, though nobody named them; the text around them stays."""
    value = f"{auth_scheme} {token}"
    text, expected = {
        "header": (f"GET /x\r\nAuthorization: {value}\r\nAccept: */*\r\n",
                   f"GET /x\r\nAuthorization: {MASK}\r\nAccept: */*\r\n"),
        "query": (f"authorization={token}&page=2", f"authorization={MASK}&page=2"),
        "json": (json.dumps({"Authorization": value, "page": 2}),
                 json.dumps({"Authorization": MASK, "page": 2})),
        "repr": (repr({"authorization": value, "page": 2}),
                 repr({"authorization": MASK, "page": 2})),
        "bare": (f"sent Bearer {token} to the Hub", f"sent Bearer {MASK} to the Hub"),
    }[shape]
    assert Redactor().text(text) == expected
    assert Redactor().bytes(text.encode()) == expected.encode()


# --- what a secret is -------------------------------------------------------------------------

SETTINGS = (
    st.sampled_from(["true", "false", "yes", "no", "on", "off"]).flatmap(
        lambda w: st.sampled_from([w, w.upper(), w.capitalize()])
    )
    | st.integers().map(str)
    | st.floats(allow_nan=False, allow_infinity=False).map(repr)
).flatmap(lambda v: st.sampled_from([v, f" {v}", f"{v}\n", f"\t{v} "]))


@given(st.dictionaries(SECRET_KEY_NAMES, SETTINGS, min_size=1, max_size=4))
def test_booleans_and_numbers_under_secret_looking_keys_are_no_secrets(
    env: dict[str, str],
) -> None:
    """``TOKENIZERS_PARALLELISM=false`` or ``MAX_TOKENS=4096`` would make "false" or "4096"
    vanish from every log line: such values are settings, not secrets."""
    redactor = Redactor()
    assert redactor.learn(env) == set()
    assert not redactor
    text = " ".join(f"{k}={v}" for k, v in env.items())
    assert redactor.text(text) == text


@given(
    st.dictionaries(
        st.from_regex(r"[A-Z][A-Z_]{0,12}", fullmatch=True), SETTINGS | SECRETS, min_size=1,
        max_size=4,
    )
)
def test_keys_listed_in_flash_secret_env_keys_are_secrets_whatever_their_value(
    env: dict[str, str],
) -> None:
    """FLASH_SECRET_ENV_KEYS names secrets outright, booleans and numbers included (values
    shorter than 4 characters are still never masked)."""
    listed = [f" {k} " for k in env]
    redactor = Redactor()
    assert redactor.learn(env, listed) == set(env)
    for value in env.values():
        assert redactor.text(value) == (MASK if len(value) >= 4 else value)


#: Keys that neither look secret nor are listed: their values are no secrets.
PLAIN_KEYS = st.sampled_from(["WANDB_ENTITY", "MODEL_NAME", "PLAIN", "DB_HOST"])
#: A value that holds no printed form of a LONG_SECRETS secret (nor a URL or a header).
PLAIN_VALUES = st.text(alphabet=AROUND_CHARS, min_size=4, max_size=20)


@given(
    st.dictionaries(SECRET_KEY_NAMES, LONG_SECRETS.filter(lambda v: not _looks_like_a_setting(v)),
                    min_size=1, max_size=3),
    st.dictionaries(PLAIN_KEYS, PLAIN_VALUES, max_size=3),
    LONG_SECRETS,
)
def test_learning_an_env_adds_its_secrets_only_to_what_the_redactor_knew(
    secret_env: dict[str, str], plain_env: dict[str, str], known: str
) -> None:
    """``learn`` (what LoadPayload teaches the attempt's redactor) returns exactly the
    secret keys, masks their values from then on, keeps masking what it knew before and
    leaves the other values of the env alone."""
    redactor = Redactor([known])
    assert redactor.learn({**plain_env, **secret_env}) == set(secret_env)
    for value in [known, *secret_env.values()]:
        assert redactor.text(f"ÆØ{value}ÆØ") == f"ÆØ{MASK}ÆØ"
    for value in plain_env.values():
        assert redactor.text(value) == value


# --- the structlog chain ---------------------------------------------------------------------


@contextmanager
def chain_to(buffer: io.StringIO, secrets: list[str], *, json_lines: bool) -> Iterator[None]:
    """The project's real log chain writing to ``buffer``, its redactor knowing only
    ``secrets``; structlog's configuration is restored after."""
    saved = structlog.get_config()
    log.configure(buffer, json=json_lines)
    log.attach(Redactor(secrets))
    try:
        yield
    finally:
        structlog.configure(**saved)


@given(SECRETS, st.booleans())
def test_the_log_chain_masks_a_secret_in_message_fields_nested_values_and_tracebacks(
    secret: str, json_lines: bool
) -> None:
    buffer = io.StringIO()
    with chain_to(buffer, [secret], json_lines=json_lines):
        logger = structlog.get_logger("test.redaction")
        logger.info(f"message with {secret}", field=secret, nested={"a": [secret, 1]},
                    _event=f"evt {secret}")
        try:
            raise RuntimeError(f"failed with {secret}")
        except RuntimeError:
            logger.exception("crashed", token=secret)
    output = buffer.getvalue()
    if json_lines:
        assert output.count("\n") == 2
        for line in output.splitlines():
            decoded = json.dumps(json.loads(line), ensure_ascii=False)
            assert secret not in decoded
            assert MASK in decoded
    else:
        assert secret not in output


# --- what the properties found -----------------------------------------------------------------


@given(st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=2),
       st.text(alphabet="abcdef", min_size=4, max_size=8))
def test_a_secret_holding_a_lone_surrogate_is_masked_not_a_crash(
    surrogates: str, rest: str
) -> None:
    secret = surrogates + rest
    assume(any(not 0xDC80 <= ord(c) <= 0xDCFF for c in surrogates))
    assert secret not in Redactor([secret]).text(f"x{secret}x")
