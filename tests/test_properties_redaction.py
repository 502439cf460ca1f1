"""Secrets never leave the process: arbitrary secret values, regex metacharacters and
non-ASCII included, are masked in text, in bytes, in nested events and by the log chain."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import structlog
from hypothesis import assume, given
from hypothesis import strategies as st

from fsm import log
from fsm.redact import MASK, Redactor, secret_keys

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
    assume(not any(secret in text for secret in secrets))
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


@given(
    st.dictionaries(SECRET_KEY_NAMES, SECRETS, min_size=1, max_size=3),
    st.dictionaries(st.sampled_from(["DB_DSN", "WANDB_ENTITY", "PLAIN"]), SECRETS, max_size=2),
    st.booleans(),
)
def test_every_secret_looking_or_listed_key_of_the_env_is_masked(
    secret_env: dict[str, str], listed_env: dict[str, str], with_hf: bool
) -> None:
    env = {**secret_env, **listed_env}
    if with_hf:
        env["HF_TOKEN"] = "hf_" + "x" * 20
    redactor = Redactor.from_env(env, extra_keys=list(listed_env))
    assert set(env) == secret_keys(env, list(listed_env))
    text = " | ".join(f"{k}={v}" for k, v in env.items())
    redacted = redactor.text(text)
    for value in env.values():
        assert value not in redacted


# --- the structlog chain ---------------------------------------------------------------------


@contextmanager
def chain_to(buffer: io.StringIO, secrets: list[str], *, json_lines: bool) -> Iterator[None]:
    """The project's real log chain writing to ``buffer``, its redactor knowing only
    ``secrets``; structlog's configuration and the shared redactor are restored after."""
    saved = structlog.get_config()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(log, "REDACTOR", Redactor(secrets))
        log.configure(buffer, json=json_lines)
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
