"""The redactor on the cases of issue 11, one example each: a token across the console
tail's 64,000-byte boundary, a URL-special password printed quoted and escaped, text cut or
collapsed before redaction, "false" taken for a secret; and the rules around them. Then
issue 38's: a token printed base64-encoded (alone or inside a longer base64 text, at each
alignment, in either alphabet) or hex-encoded."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

import pytest

from fsm.output.redact import MASK, Redactor

TOKEN = "hf_Zq8XwV3nP0rT6yLmK2bC9dF4gH7jS1aQe"  # 37 characters, like the one that leaked
PASSWORD = 'p@ss/w"rd!{x} 100%&more'
PEM = (
    "-----BEGIN PRIVATE KEY-----\n"
    "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7\n"
    "VJTUt9Us8cKjMzEfYyjiWA4R4/M2bS1GB4t7NXp98C3SC6dVMvDuic\n"
    "-----END PRIVATE KEY-----\n"
)


def fragments(secret: str, size: int = 10) -> list[str]:
    return [secret[i : i + size] for i in range(len(secret) - size + 1)]


def encoded_forms(secret: str) -> list[str]:
    """How programs print a secret's bytes encoded, worked out by brute force (not by the
    redactor's arithmetic): hex in both cases; base64 in the standard and the URL-safe
    alphabet, alone with and without padding, and inside a longer base64 text for each of
    the 3 offsets of its first byte in a 3-byte group: the characters that stay the same
    whatever bytes surround it (encoded between zero bytes and between 0xFF bytes, the run
    of characters both agree on; a character that mixes in a neighbour's bits differs)."""
    data = secret.encode("utf-8", "surrogateescape")
    forms = {data.hex(), data.hex().upper()}
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        alone = encode(data).decode()
        forms |= {alone, alone.rstrip("=")}
        for offset in range(3):
            zeros = encode(bytes(offset) + data + bytes(2)).decode()
            ones = encode(b"\xff" * offset + data + b"\xff\xff").decode()
            forms |= set("".join(z if z == o else " " for z, o in zip(zeros, ones, strict=True))
                         .split())
    return sorted((f for f in forms if len(f) >= 4), key=len)


def encoded_leaks(text: str, secret: str) -> list[str]:
    """The 10-character pieces of an encoded form of ``secret`` (the whole form when
    shorter) that ``text`` holds."""
    return sorted({piece for form in encoded_forms(secret)
                   for piece in (fragments(form) if len(form) >= 10 else [form])
                   if piece in text})


def carrying(before: int, size: int) -> tuple[int, int]:
    """The characters of a base64 text that carry a bit of the ``size`` bytes that follow
    the first ``before`` bytes: from the first through the last, as a slice."""
    return 8 * before // 6, -(-8 * (before + size) // 6)


def test_a_token_printed_across_the_tail_boundary_is_masked_whole(tmp_path: Path) -> None:
    """The tail starts 64,000 bytes before the end; a token printed 7 characters before that
    point used to be uploaded as its last 30 characters."""
    path = tmp_path / "console.txt"
    before, after = b"x" * 5_000, b"y" * (64_000 - 30) + b"\n"
    path.write_bytes(before + TOKEN.encode() + after)
    tail = Redactor([TOKEN]).tail_of(path, 64_000)
    assert len(tail) == 64_000
    assert not any(f.encode() in tail for f in fragments(TOKEN))
    assert tail.endswith(after)


def test_a_token_cut_by_the_read_window_is_masked_even_when_masks_shorten_the_tail(
    tmp_path: Path,
) -> None:
    """Masks after the cut make the redacted window shorter than it was read, so the kept
    bytes reach back to the window's first byte: the piece of the token there is masked."""
    redactor = Redactor([TOKEN])
    path = tmp_path / "console.txt"
    rest = (". " + TOKEN) * 5 + "\n"
    content = ("x" * 500 + TOKEN + rest).encode()
    path.write_bytes(content)
    for at in range(1, len(TOKEN)):
        limit = len(content) - redactor.longest - (500 + at)
        tail = redactor.tail_of(path, limit)
        assert not any(f.encode() in tail for f in fragments(TOKEN)), at
        assert tail.endswith(rest.replace(TOKEN, MASK).encode())


def test_what_is_left_of_a_short_secret_at_the_start_of_a_cut_window_is_masked(
    tmp_path: Path,
) -> None:
    secret = "pw:73!x"  # shorter than 10 characters: any remaining part counts
    redactor = Redactor([secret])
    path = tmp_path / "console.txt"
    content = ("z" * 100 + secret + (" " + secret) * 40 + " end").encode()
    path.write_bytes(content)
    start = 100 + 4  # the window starts at "!x"
    limit = len(content) - redactor.longest - start
    tail = redactor.tail_of(path, limit)
    assert tail.startswith(MASK.encode() + b" ***")
    assert b"!x" not in tail


def test_a_secret_still_being_written_at_the_end_of_the_console_is_masked(
    tmp_path: Path,
) -> None:
    """A block-buffered worker flushes at any byte: the tail read in between holds the
    token's first characters at its very end."""
    path = tmp_path / "console.txt"
    path.write_bytes(b"loading token=" + TOKEN[:20].encode())
    assert Redactor([TOKEN]).tail_of(path, 1_000) == b"loading token=***"


#: This thread's I/O counters (Linux): what a call read, measured by the kernel.
THREAD_IO = Path("/proc/thread-self/io")


def _bytes_read() -> int:
    """How many bytes this thread has read so far (``rchar``)."""
    for line in THREAD_IO.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "rchar":
            return int(value)
    raise AssertionError(f"no rchar in {THREAD_IO}")


@pytest.mark.skipif(not THREAD_IO.exists(), reason="needs Linux's per-thread I/O counters")
def test_the_tail_is_read_by_seeking_not_by_reading_the_file(tmp_path: Path) -> None:
    """A 50 MB console costs no more than its tail: ``limit + longest`` bytes are read, as
    the kernel counts them (whatever way the file is opened or read)."""
    path = tmp_path / "console.txt"
    with open(path, "wb") as f:
        f.truncate(50_000_000)
        f.seek(0, 2)
        f.write(b"done with " + TOKEN.encode() + b"\n")
    redactor = Redactor([TOKEN])
    # reading the counter reads too: what two readings in a row cost is taken off
    first = _bytes_read()
    counting = _bytes_read() - first
    before = _bytes_read()
    tail = redactor.tail_of(path, 100)
    read = _bytes_read() - before - counting
    assert tail.endswith(b"done with ***\n")
    # the counter's own text can grow by a digit or two between readings
    assert abs(read - (100 + redactor.longest)) <= 8, read


@pytest.mark.parametrize(
    "printed",
    [
        quote(PASSWORD, safe=""),
        quote(PASSWORD),
        quote_plus(PASSWORD),
        json.dumps(PASSWORD)[1:-1],
        json.dumps(PASSWORD, ensure_ascii=False)[1:-1],
        repr(PASSWORD)[1:-1],
        " ".join(PASSWORD.split()),
    ],
    ids=["quote-safe-none", "quote", "quote-plus", "json", "json-unicode", "repr", "collapsed"],
)
def test_a_url_special_password_is_masked_however_it_was_printed(printed: str) -> None:
    redactor = Redactor([PASSWORD])
    assert redactor.text(f"db={printed}; retry") == f"db={MASK}; retry"
    assert redactor.bytes(f"db={printed}; retry".encode()) == f"db={MASK}; retry".encode()


def test_a_json_document_holding_a_secret_keeps_its_shape() -> None:
    redactor = Redactor([PASSWORD, "sécret-ünïcode"])
    doc = json.dumps({"password": PASSWORD, "user": "ann", "other": "sécret-ünïcode"})
    assert json.loads(redactor.text(doc)) == {"password": MASK, "user": "ann", "other": MASK}


def test_keeping_the_first_characters_of_a_message_never_keeps_a_token_prefix() -> None:
    redactor = Redactor([TOKEN])
    message = "401 for token " + TOKEN + " on org/x"
    for limit in range(len(message) + 1):
        assert not any(f in redactor.keep_first(message, limit) for f in fragments(TOKEN))
        assert not any(f in redactor.keep_last(message, limit) for f in fragments(TOKEN))
    assert redactor.keep_first(message, 20) == "401 for token *** on"
    assert redactor.keep_last(message, 12) == "*** on org/x"
    assert redactor.keep_last_bytes(message.encode(), 12) == b"*** on org/x"
    assert redactor.keep_first(message, 0) == redactor.keep_last(message, 0) == ""


def test_a_pem_key_is_masked_before_the_line_collapses_its_newlines() -> None:
    redactor = Redactor([PEM])
    error = f"bad key:\n{PEM}\nin   /etc/key.pem"
    assert redactor.line(error, 2_000) == "bad key: *** in /etc/key.pem"
    assert redactor.line(error, 12) == "bad key: ***"
    # a key already collapsed by someone else is still known
    assert redactor.line("got " + " ".join(PEM.split()), 100) == "got ***"


def test_the_line_masks_a_secret_that_collapsing_whitespace_forms() -> None:
    redactor = Redactor(["open sesame"])
    assert redactor.line("said open\n\tsesame twice", 100) == "said *** twice"


def test_overlapping_secrets_are_masked_as_one() -> None:
    """Masking one match at a time would leave the tail of the second secret."""
    first, second = "AAAA-shared-middle-part", "shared-middle-part-ZZZZZZZZZZ"
    redactor = Redactor([first, second])
    assert redactor.text("x AAAA-shared-middle-part-ZZZZZZZZZZ y") == "x *** y"


def test_text_around_a_secret_is_kept_exactly() -> None:
    redactor = Redactor([TOKEN])
    assert redactor.text(f"a{TOKEN}b {TOKEN}\n") == f"a{MASK}b {MASK}\n"
    assert redactor.text("nothing secret here: 1 2 3") == "nothing secret here: 1 2 3"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("git+https://user:pa55@github.com/x", "git+https://***@github.com/x"),
        ("pip install git+https://ghp_abc123@github.com/o/r.git",
         "pip install git+https://***@github.com/o/r.git"),
        ("postgres://u:p@ss@db:5432/x?sslmode=1", "postgres://***@db:5432/x?sslmode=1"),
        ("https://example.com/a@b and mail@example.com",
         "https://example.com/a@b and mail@example.com"),
        ("Authorization: Bearer hf_abc\r\nHost: x", "Authorization: ***\r\nHost: x"),
        ("proxy-authorization=Basic dXNlcjpwdw==&x=1", "proxy-authorization=***&x=1"),
        ('{"Authorization": "token abc", "a": 1}', '{"Authorization": "***", "a": 1}'),
        ("{'authorization': 'Bearer abc'}", "{'authorization': '***'}"),
        ("curl -H 'Authorization: Bearer abc' x", "curl -H 'Authorization: ***' x"),
        ("retrying with Bearer eyJhbGciOi.J9x-_ now", "retrying with Bearer *** now"),
        ("Authorization failed for org/x", "Authorization failed for org/x"),
    ],
)
def test_credentials_nobody_named_are_masked_in_text_and_bytes(text: str, expected: str) -> None:
    assert Redactor().text(text) == expected
    assert Redactor().bytes(text.encode()) == expected.encode()


def test_settings_under_secret_looking_keys_are_not_secrets() -> None:
    env = {
        "TOKENIZERS_PARALLELISM": "false",
        "MAX_TOKENS": "4096",
        "KEY_FRACTION": " 0.25\n",
        "USE_SECRET_MANAGER": "Yes",
        "HF_TOKEN": "hf_real_token_value",
        "WANDB_API_KEY": "0123abcd" * 5,
        "DB_DSN": "postgres://u:pw@db/x",
        "FLAG": "true",
    }
    redactor = Redactor()
    learnt = redactor.learn(env, ["DB_DSN", " FLAG "])
    assert learnt == {"HF_TOKEN", "WANDB_API_KEY", "DB_DSN", "FLAG"}
    assert redactor.text("parallelism=false tokens=4096") == "parallelism=false tokens=4096"
    assert redactor.text("flag is true") == "flag is ***"  # listed: a secret whatever it is
    assert redactor.text(env["HF_TOKEN"]) == MASK


def test_values_shorter_than_four_characters_are_never_masked() -> None:
    """Masking "1" or "ab" everywhere would shred every line and hide no credential."""
    redactor = Redactor(["ab", "x1y"])
    assert not redactor
    assert redactor.longest == 0
    assert redactor.text("ab x1y") == "ab x1y"


def test_longest_is_the_longest_printed_or_encoded_form_in_bytes() -> None:
    assert Redactor().longest == 0
    # URL-quoted, 30 bytes: longer than its hex (20) and its base64 (16)
    assert Redactor(["ééééé"]).longest == len(quote("ééééé").encode()) == 30
    redactor = Redactor(["abcd"])
    redactor.add([PASSWORD])
    # hex, two characters a byte: longer than any quoted form (41)
    assert max(len(quote(PASSWORD, safe="")), len(quote_plus(PASSWORD))) == 41
    assert redactor.longest == len(PASSWORD.encode().hex()) == 46


def test_a_secret_with_an_undecodable_byte_is_masked_in_console_bytes() -> None:
    secret = "tok\udcff-value"  # how Python reads the byte 0xFF from an environment variable
    redactor = Redactor([secret])
    assert redactor.bytes(b"[tok\xff-value]") == b"[***]"
    assert redactor.text(f"[{secret}]") == "[***]"
    # encoded, it is the bytes the program read that show
    for form in (base64.b64encode(b"tok\xff-value").decode(), b"tok\xff-value".hex()):
        assert redactor.text(f"[{form}]") == "[***]"
        assert redactor.bytes(f"[{form}]".encode()) == b"[***]"


def test_deep_redacts_nested_events_and_keeps_their_shape() -> None:
    redactor = Redactor([TOKEN])
    event: dict[str, Any] = {
        "msg": f"using {TOKEN}",
        "args": (1, [f"x{TOKEN}", None], {"k": quote(TOKEN)}),
    }
    assert redactor.deep(event) == {"msg": "using ***", "args": (1, ["x***", None], {"k": MASK})}


# --- encoded (issue 38) ------------------------------------------------------------------------

#: A key whose base64 holds "+" and "/" at each of the three alignments: the URL-safe
#: alphabet writes it differently at every one.
KEY = "sk-live~Zq8?Xw>V3n~~P0rT6~yLm???K2?bC9dF4gH7j"
ALPHABETS: dict[str, Callable[[bytes], bytes]] = {
    "standard": base64.b64encode, "url-safe": base64.urlsafe_b64encode,
}


def test_the_key_is_written_differently_by_the_two_alphabets_at_every_alignment() -> None:
    """(What the tests below rely on.)"""
    for offset in range(3):
        std = base64.b64encode(bytes(offset) + KEY.encode()).decode()
        assert std != base64.urlsafe_b64encode(bytes(offset) + KEY.encode()).decode()
        assert {"+", "/"} & set(std[2:-3]), offset


@pytest.mark.parametrize("after", [b"", b"\n", b"\x00rest of the file"],
                         ids=["at-the-end", "echo-newline", "more-bytes"])
@pytest.mark.parametrize("alphabet", sorted(ALPHABETS))
@pytest.mark.parametrize("offset", [0, 1, 2])
def test_a_key_inside_a_longer_base64_text_loses_every_character_that_carries_its_bits(
    offset: int, alphabet: str, after: bytes
) -> None:
    """``user:key`` in a Basic header, a config file, ``echo $KEY | base64``: the key's
    bytes start at any of the three offsets of a 3-byte group. The characters made of its
    bits alone are masked, and so are the two that mix its first and last bits with a
    neighbour's (and the padding right after it); the rest of the text stays."""
    before = b"\x00\x9fuser:ab"[: 6 + offset]  # the key starts at ``offset`` in a group
    assert len(before) % 3 == offset
    blob = ALPHABETS[alphabet](before + KEY.encode() + after).decode()
    first, last = carrying(len(before), len(KEY.encode()))
    if not after:
        last = len(blob)  # the padding goes with it
    redactor = Redactor([KEY])
    line = f"creds={blob} (cached)"
    expected = f"creds={blob[:first]}{MASK}{blob[last:]} (cached)"
    assert encoded_leaks(line, KEY), "the leak check sees the unredacted text"
    assert redactor.text(line) == expected
    assert redactor.bytes(line.encode()) == expected.encode()
    assert encoded_leaks(expected, KEY) == []
    assert redactor.line(line, 1_000) == expected


@pytest.mark.parametrize(
    "printed",
    [
        base64.b64encode(KEY.encode()).decode(),
        base64.b64encode(KEY.encode()).decode().rstrip("="),
        base64.urlsafe_b64encode(KEY.encode()).decode(),
        base64.urlsafe_b64encode(KEY.encode()).decode().rstrip("="),
        KEY.encode().hex(),
        KEY.encode().hex().upper(),
    ],
    ids=["base64", "base64-unpadded", "url-safe", "url-safe-unpadded", "hex", "HEX"],
)
def test_a_key_printed_encoded_alone_is_masked_whole(printed: str) -> None:
    redactor = Redactor([KEY])
    assert redactor.text(f"key={printed}; retry") == f"key={MASK}; retry"
    assert redactor.bytes(f"key={printed}; retry".encode()) == f"key={MASK}; retry".encode()
    assert redactor.deep({"k": [f"x{printed}"]}) == {"k": [f"x{MASK}"]}


@pytest.mark.parametrize("upper", [False, True], ids=["hex", "HEX"])
def test_a_key_hex_encoded_inside_a_longer_hex_dump_is_masked(upper: bool) -> None:
    around = bytes(range(0x90, 0xA8))
    dump = (around + KEY.encode() + around).hex()
    dump = dump.upper() if upper else dump
    masked = Redactor([KEY]).text(f"dump {dump}\n")
    assert masked == f"dump {dump[:48]}{MASK}{dump[-48:]}\n"
    assert encoded_leaks(masked, KEY) == []


def test_encodings_of_short_values_and_settings_are_left_alone() -> None:
    """Values shorter than 4 characters and settings under secret-looking keys are no
    secrets: their encodings are as innocent as they are."""
    redactor = Redactor()
    redactor.learn({"TOKENIZERS_PARALLELISM": "false", "MAX_TOKENS": "4096", "AB_KEY": "ab"})
    assert not redactor
    text = " ".join(
        form
        for value in ("false", "4096", "ab")
        for form in (base64.b64encode(value.encode()).decode(), value.encode().hex(),
                     base64.b64encode(b"x" + value.encode()).decode())
    )
    assert redactor.text(text) == text
    assert redactor.bytes(text.encode()) == text.encode()


def test_base64_and_hex_that_do_not_hold_the_key_are_left_alone() -> None:
    """Nor does a value that is not the key (its last byte changed): like its plain text,
    its encoding holds a piece of the key, not the key."""
    redactor = Redactor([KEY, TOKEN])
    near = KEY.encode()[:-1] + b"k"
    for blob in (base64.b64encode(bytes(range(256))).decode(), bytes(range(256)).hex(),
                 base64.b64encode(near).decode(), near.hex()):
        assert redactor.text(blob) == blob
        assert redactor.bytes(blob.encode()) == blob.encode()


def test_a_base64_key_cut_by_the_read_window_is_masked_or_left_shorter_than_10(
    tmp_path: Path,
) -> None:
    """The read window starts anywhere inside a base64 text holding the key (each
    alignment), with masked copies after it that make the kept bytes reach back to the
    window's first byte: what is left of the key's characters there is masked, or shorter
    than 10 characters."""
    redactor = Redactor([KEY])
    path = tmp_path / "console.txt"
    for offset in range(3):
        blob = base64.b64encode(b"\x9f\x00"[:offset] + KEY.encode() + b"\x00more").decode()
        rest = (". " + blob) * 5 + "\n"
        expected_rest = redactor.text(rest)
        assert expected_rest.count(MASK) == 5
        content = ("x" * 500 + blob + rest).encode()
        path.write_bytes(content)
        for at in range(1, len(blob)):
            limit = len(content) - redactor.longest - (500 + at)
            tail = redactor.tail_of(path, limit).decode()
            assert encoded_leaks(tail, KEY) == [], (offset, at, tail[:80])
            assert tail.endswith(expected_rest), (offset, at)


def test_a_hex_key_still_being_written_at_the_end_of_the_console_is_masked(
    tmp_path: Path,
) -> None:
    path = tmp_path / "console.txt"
    path.write_bytes(b"key " + KEY.encode().hex()[:30].encode())
    assert Redactor([KEY]).tail_of(path, 1_000) == b"key ***"


def test_a_password_inside_a_url_valued_setting_is_learnt_as_a_secret() -> None:
    """A proxy's or an index's credentials (``scheme://user:password@host``): the password
    is masked wherever it shows, decoded, also apart from its URL (a library's message about
    a refused proxy login). The setting's name says nothing secret; its value does."""
    redactor = Redactor()
    keys = redactor.learn({"HTTPS_PROXY": "http://ops:pr%40xy-Pass-7@proxy.corp:3128",
                           "PIP_INDEX_URL": "https://u:idx-Secret-9@pypi.corp/simple",
                           "NO_PROXY": "localhost,127.0.0.1"})
    assert keys == set()
    shown = redactor.text("407 for ops with pr@xy-Pass-7; index idx-Secret-9; localhost")
    assert "pr@xy-Pass-7" not in shown and "idx-Secret-9" not in shown
    assert "localhost" in shown
