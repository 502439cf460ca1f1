"""Secret redaction for every text that leaves the process.

The values of secret-looking keys in the payload env (DESIGN, "Secrets") are replaced by
``***`` in log events, console tails, error texts and the marker.

A value can leak around a redactor that only knows whole values (TRAPS.md), so this one:

* knows each secret in the forms it is printed in: as is, URL-quoted (three ways),
  JSON-escaped (ASCII or not), backslash-escaped as by ``repr`` (both quote styles) and
  whitespace-collapsed; ``bytes`` knows the UTF-8 of each of these;
* knows each secret's bytes (its UTF-8; for a value read from an undecodable environment
  byte, that byte) encoded as secret scanners look for them: hex (lower and upper case) and
  base64 (the standard and the URL-safe alphabet, with and without ``=`` padding), alone
  or inside a longer base64 text (``user:token`` in a Basic header, a file, ``echo $TOKEN
  | base64``). There the secret's bytes start at one of three offsets in a 3-byte group,
  and for each the form is its *stable core*: the characters that encode the secret's bits
  alone, the same whatever surrounds it. The one character at each end of a core that
  mixes the secret's last (first) bits with a neighbour's, when it agrees with the secret,
  and the ``=`` padding that may follow, are masked with it: every character that carries
  a bit of the secret goes;
* masks every occurrence of every form whole, overlapping ones included (the union of all
  matches becomes masks; the text between matches is kept unchanged);
* masks credentials it was never told about: the userinfo of a URL
  (``scheme://user:password@host``, ``scheme://token@host``), the value of an HTTP
  ``Authorization`` header and a bare ``Bearer <token>``;
* redacts first and shortens afterwards (``keep_last``, ``keep_first``, ``line``,
  ``tail_of``), so no cut leaves a piece of a secret behind. ``tail_of`` reads ``longest``
  bytes more than it keeps, so a secret straddling the kept window is masked whole, and
  masks the piece of a secret that the read window itself cut at its start (and a secret's
  start still being written at the end of the file): a piece of any form, encoded ones
  included, that holds the form's last (first) 10 characters, or any piece of a form
  shorter than that.

Results never hold 10 or more consecutive characters of a known secret (or the whole
secret, when it is shorter) in any of those forms (each alignment's base64 core included),
for inputs that hold the secret whole (or, for ``tail_of``, cut by the read window: what a
cut leaves of a form at the window's start is masked from 10 characters on, so fewer may
stay, with the one mixed character after them). Not recognised: base64 wrapped over several
lines, encodings of an encoding (base64 of a URL-quoted secret, a URL-quoted base64), other
encodings (base32, ``\\x``-escaped bytes).

Matching is one ``find`` scan per form (not one regex alternation of them all): a secret
has a dozen or two forms, and the scans cost a fraction of a millisecond on a 64 KiB tail.
"""

from __future__ import annotations

import base64
import builtins
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from pathlib import Path
from typing import AnyStr, NamedTuple
from urllib.parse import quote, quote_plus, unquote, urlsplit

MASK = "***"
_BMASK = MASK.encode()
_SECRET_KEY = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
# Values (and printed forms) this short are not redacted: masking "1" or "ab" everywhere
# would shred the text, and such a value is no credential anyway.
_MIN_SECRET_LEN = 4
#: A piece of a secret this long (in characters) is treated as the secret; shorter pieces of
#: a longer secret carry too little of it to matter (and would match innocent text).
_FRAGMENT = 10
#: Settings that sit under secret-looking keys but are no secrets
#: (``TOKENIZERS_PARALLELISM=false``, ``MAX_TOKENS=4096``): boolean words and plain numbers.
_SETTING_VALUE = re.compile(
    r"\s*(?:true|false|yes|no|on|off|[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*",
    re.IGNORECASE,
)

# Credentials nobody named. The lookbehind keeps a scheme from starting inside a longer word
# (and the scan linear); the userinfo runs to the last "@" before the host.
_URL_USERINFO = (
    r"(?P<scheme>(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]{0,31}://)"
    r"(?P<userinfo>[^\s/?#\"'<>\\`]+)@"
)
_AUTH_HEADER = (
    r"(?P<key>\b(?:proxy-)?authorization)"
    r"(?P<sep>\\?[\"']?[ \t]*[:=][ \t]*(?:\\?[\"'])?)"
    r"(?P<value>(?:[A-Za-z][A-Za-z0-9\-]*[ \t]+)?[^\s\"'\\,;&]+)"
)
_BEARER = r"(?P<key>\bbearer[ \t]+)(?P<value>[^\s\"'\\,;&]+)"
_CREDENTIALS: tuple[tuple[str, str], ...] = (
    (_URL_USERINFO, r"\g<scheme>***@"),
    (_AUTH_HEADER, r"\g<key>\g<sep>***"),
    (_BEARER, r"\g<key>***"),
)
_TEXT_CREDENTIALS = [(re.compile(p, re.IGNORECASE), r) for p, r in _CREDENTIALS]
_BYTES_CREDENTIALS = [(re.compile(p.encode(), re.IGNORECASE), r.encode()) for p, r in _CREDENTIALS]

#: The setting that names extra secret keys: a list of names, no secret itself.
LIST_KEY = "FLASH_SECRET_ENV_KEYS"


def secret_keys(env: Mapping[str, str], extra: Iterable[str] = ()) -> set[str]:
    """The keys of ``env`` whose values are secrets.

    A key named in ``extra`` (FLASH_SECRET_ENV_KEYS) always is. A key that looks secret
    (``TOKEN``, ``KEY``, ``SECRET`` or ``PASSWORD`` in it, any case) is, unless its value is
    a boolean word or a plain number: masking "false" everywhere would shred the text and
    hide nothing.
    """
    listed = {k.strip() for k in extra if k.strip()}
    looking_secret = {
        k for k, v in env.items()
        if _SECRET_KEY.search(k) and not (isinstance(v, str) and _SETTING_VALUE.fullmatch(v))
    }
    return (listed & env.keys() | looking_secret) - {LIST_KEY}


def _url_password(value: str) -> str | None:
    """The password of ``scheme://user:password@host...``, decoded, or None."""
    with suppress(ValueError):  # not a URL
        password = urlsplit(value.strip()).password
        return unquote(password) if password else None
    return None


def _backslashed(secret: str, quote_char: str) -> str:
    """The inside of ``repr(secret)`` written between ``quote_char`` quotes."""
    return "".join("\\" + c if c == quote_char else repr(c)[1:-1] for c in secret)


_ENCODERS: tuple[Callable[[str], str], ...] = (
    lambda s: s,
    lambda s: quote(s, safe=""),
    quote,
    quote_plus,
    lambda s: json.dumps(s)[1:-1],
    lambda s: json.dumps(s, ensure_ascii=False)[1:-1],
    lambda s: _backslashed(s, "'"),
    lambda s: _backslashed(s, '"'),
    lambda s: " ".join(s.split()),
    # pip lowercases the URL it names in its errors (a token in a URL's path, say)
    str.lower,
)


def _forms(secret: str) -> set[str]:
    """Every printed form of ``secret`` long enough to be masked."""
    forms = set()
    for encode in _ENCODERS:
        with suppress(UnicodeError):  # a lone surrogate cannot be URL-quoted
            forms.add(encode(secret))
    return {form for form in forms if len(form) >= _MIN_SECRET_LEN}


_BASE64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_URL_SAFE = str.maketrans("+/", "-_")


class _Around(NamedTuple):
    """What a match of an encoded form may take with it: the character just before it when
    it is in ``before``, then the one just after it when it is in ``after`` (``None``: no
    such character, the padding may follow at once), then up to ``pad`` ``=``."""

    before: frozenset[str]
    after: frozenset[str] | None
    pad: int


_NOTHING = frozenset[str]()


def _utf8(text: str) -> dict[str, builtins.bytes]:
    """The bytes a program holding ``text`` encodes, by error handler: its UTF-8, or, for a
    text holding lone surrogates, the bytes they stand for (``surrogateescape``) or their
    UTF-8 encoding as written by ``surrogatepass`` (each where it applies)."""
    with suppress(UnicodeError):
        return {"strict": text.encode()}
    out = {}
    for errors in ("surrogateescape", "surrogatepass"):
        with suppress(UnicodeError):
            out[errors] = text.encode("utf-8", errors)
    return out


def _agreeing(value: int, bits: int, low: bool) -> frozenset[str]:
    """The base64 characters whose ``bits`` low (else high) bits are those of ``value``'s."""
    def key(index: int) -> int:
        return index & ((1 << bits) - 1) if low else index >> (6 - bits)

    return frozenset(c for i, c in enumerate(_BASE64) if key(i) == key(value))


def _base64_cores(data: builtins.bytes) -> Iterable[tuple[str, _Around]]:
    """For each offset of ``data`` in a 3-byte group, the characters of a base64 text that
    encode ``data``'s bits alone (standard alphabet), and what may go with them."""
    for offset in range(3):
        # Zero bytes stand in for the neighbours: only the characters made of data's bits
        # alone are kept, and the mixed ones at the ends become sets of what agrees.
        encoded = base64.b64encode(bytes(offset) + data + bytes(2)).decode()
        start, end = 8 * offset, 8 * (offset + len(data))  # data's bits in ``encoded``
        first, last = -(-start // 6), end // 6  # the characters of data's bits alone
        before = (
            _agreeing(_BASE64.index(encoded[first - 1]), 6 * first - start, low=True)
            if start % 6 else _NOTHING
        )
        after = (
            _agreeing(_BASE64.index(encoded[last]), end - 6 * last, low=False)
            if end % 6 else _NOTHING
        )
        yield encoded[first:last], _Around(before, after, -(offset + len(data)) % 3)


def _add_encoded_forms(secret: str, forms: dict[str, list[_Around]]) -> None:
    """Add to ``forms`` every encoded form of ``secret`` long enough to be masked (see the
    module), with what a match of each may take with it (each once)."""

    def add(form: str, around: _Around | None = None) -> None:
        if len(form) >= _MIN_SECRET_LEN:
            known = forms.setdefault(form, [])
            if around is not None and around not in known:
                known.append(around)

    for data in _utf8(secret).values():
        add(data.hex())
        add(data.hex().upper())
        alone = base64.b64encode(data).decode()
        pad = len(alone) - len(alone.rstrip("="))
        for core, around in _base64_cores(data):
            add(core, around)
            url = _Around(
                frozenset(c.translate(_URL_SAFE) for c in around.before),
                frozenset(c.translate(_URL_SAFE) for c in around.after or ()),
                around.pad,
            )
            add(core.translate(_URL_SAFE), url)
        for form in (alone, alone.translate(_URL_SAFE)):
            add(form)
            add(form.rstrip("="), _Around(_NOTHING, None, pad))


class _BytesForm(NamedTuple):
    """One printed form as bytes, with how many of its last (first) bytes a piece of it cut
    at the start (end) of a read window must keep to count as the secret: those of its last
    (first) 10 characters; for a shorter form, any piece at the start (the start of a read
    window can only be cut through a secret) and none at the end."""

    data: builtins.bytes
    min_suffix: int
    min_prefix: int


def _byte_forms(forms: Iterable[str]) -> list[_BytesForm]:
    out: dict[builtins.bytes, _BytesForm] = {}
    for form in forms:
        for errors, data in _utf8(form).items():  # what encodes the form encodes its pieces
            suffix = 1 if len(form) < _FRAGMENT else len(form[-_FRAGMENT:].encode("utf-8", errors))
            prefix = 0 if len(form) <= _FRAGMENT else len(form[:_FRAGMENT].encode("utf-8", errors))
            out.setdefault(data, _BytesForm(data, suffix, prefix))
    return list(out.values())


def _cut_piece(
    forms: list[_BytesForm], window: builtins.bytes, at_end: bool = False
) -> tuple[int, list[builtins.bytes]]:
    """The length of the longest piece of a form cut off at the start of ``window``: a
    proper suffix of the form, ``min_suffix`` bytes or more (0 if none), and the forms it is
    a piece of. With ``at_end``, ``window`` comes reversed and the piece is a proper prefix,
    ``min_prefix`` bytes or more."""
    best, of = 0, list[builtins.bytes]()
    for form in forms:
        data, least = (form.data[::-1], form.min_prefix) if at_end else (form.data, form.min_suffix)
        if not least or len(window) < least:
            continue
        needle = window[:least]
        at = data.find(needle, 1)
        while 0 < at <= len(data) - least:
            if window.startswith(data[at:]):
                if len(data) - at > best:
                    best, of = len(data) - at, []
                if len(data) - at == best:
                    of.append(form.data)
                break
            at = data.find(needle, at + 1)
    return best, of


def _char(value: str | builtins.bytes, at: int) -> str:
    """The character (byte, as Latin-1) at ``at``; "" outside ``value``."""
    return _text_of(value[at : at + 1] if at >= 0 else value[:0])


def _widened(
    value: str | builtins.bytes, start: int, end: int, arounds: Iterable[_Around]
) -> tuple[int, int]:
    """The span of an encoded form's match, with what each of ``arounds`` lets it take:
    the mixed character before and after it, and the padding."""
    low, high = start, end
    for around in arounds:
        if _char(value, start - 1) in around.before:
            low = min(low, start - 1)
        stop = end
        if around.after is not None:
            if _char(value, stop) not in around.after:
                continue
            stop += 1
        for _ in range(around.pad):
            if _char(value, stop) != "=":
                break
            stop += 1
        high = max(high, stop)
    return low, high


def _spans(
    forms: Iterable[AnyStr], value: AnyStr, arounds: Mapping[str, list[_Around]]
) -> list[tuple[int, int]]:
    """Every occurrence of every form, overlapping ones included (so the union of the
    spans covers every occurrence), an encoded form's widened by what goes with it.

    One ``find`` scan per form: with a few dozen forms, ten times faster than one regex
    alternation of them all (whose first characters, base64's, are nearly any)."""
    spans: list[tuple[int, int]] = []
    for form in forms:
        around = arounds.get(_text_of(form))
        at = value.find(form)
        while at >= 0:
            end = at + len(form)
            spans.append(_widened(value, at, end, around) if around else (at, end))
            at = value.find(form, at + 1)
    return spans


def _text_of(form: str | builtins.bytes) -> str:
    """A matched form as the key of its ``arounds`` (encoded forms are ASCII)."""
    return form.decode("latin-1") if isinstance(form, builtins.bytes) else form


def _masked(
    value: AnyStr,
    spans: list[tuple[int, int]],
    mask: AnyStr,
    credentials: list[tuple[re.Pattern[AnyStr], AnyStr]],
) -> AnyStr:
    """``value`` with each union of overlapping spans replaced by one ``mask``, then the
    credentials nobody named masked."""
    parts: list[AnyStr] = []
    pos = 0  # where the text after the masks so far starts
    for start, end in sorted(spans):
        if start >= pos:  # not inside the mask before: the text between is kept
            parts += [value[pos:start], mask]
        pos = max(pos, end)
    value = value[:0].join(parts) + value[pos:]
    for pattern, repl in credentials:
        value = pattern.sub(repl, value)
    return value


class Redactor:
    """Replaces every known secret value by ``***``, in text and in bytes (see the module)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets: set[str] = set()
        self._forms: list[str] = []
        self._bforms: list[_BytesForm] = []
        #: what a match of each encoded form may take with it (see ``_Around``)
        self._arounds: dict[str, list[_Around]] = {}
        self.add(secrets)

    def learn(self, env: Mapping[str, str], extra_keys: Iterable[str] = ()) -> set[str]:
        """Mask the values of ``secret_keys(env, extra_keys)`` from now on and return those
        keys (also the keys of values too short to be masked). The one way an env's secrets
        become known: the attempt's redactor learns the payload's env with it.
        """
        keys = secret_keys(env, extra_keys)
        self.add(env[k] for k in keys)
        # A credential inside a URL-valued setting (a proxy's, an index's): its password
        # too, in case a library prints it apart from the URL.
        self.add(password for value in env.values() if isinstance(value, str) and "@" in value
                 for password in [_url_password(value)] if password)
        return keys

    def add(self, secrets: Iterable[str]) -> None:
        """Mask these values too (values shorter than 4 characters are ignored)."""
        new = {s for s in secrets if isinstance(s, str) and len(s) >= _MIN_SECRET_LEN}
        if new <= self._secrets:
            return
        self._secrets |= new
        for secret in new:
            _add_encoded_forms(secret, self._arounds)
        forms = {f for s in self._secrets for f in _forms(s)} | self._arounds.keys()
        self._forms = sorted(forms)
        self._bforms = _byte_forms(self._forms)

    def __bool__(self) -> bool:
        return bool(self._secrets)

    @property
    def longest(self) -> int:
        """The length in bytes of the longest text a secret form matches (0 when none): read
        this much more than you keep and a secret across the cut is masked whole."""
        return max((len(f.data) for f in self._bforms), default=0)

    def text(self, value: str) -> str:
        spans = _spans(self._forms, value, self._arounds)
        return _masked(value, spans, MASK, _TEXT_CREDENTIALS)

    def bytes(
        self, value: builtins.bytes, *, cut_start: bool = False, cut_end: bool = False
    ) -> builtins.bytes:
        """``cut_start`` (``cut_end``): ``value`` was read from a longer text that may go on
        before (after) it, so a piece of a secret it starts (ends) with is masked too."""
        spans = _spans((f.data for f in self._bforms), value, self._arounds)
        for cut, at_end in ((cut_start, False), (cut_end, True)):
            if not cut:
                continue
            piece, of = _cut_piece(self._bforms, value[::-1] if at_end else value, at_end)
            if piece:
                start, end = (len(value) - piece, len(value)) if at_end else (0, piece)
                arounds = [a for f in of for a in self._arounds.get(_text_of(f), ())]
                spans.append(_widened(value, start, end, arounds))
        return _masked(value, spans, _BMASK, _BYTES_CREDENTIALS)

    def deep(self, value: object) -> object:
        """Redact strings inside nested dicts, lists and tuples (log events, markers)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self.deep(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.deep(v) for v in value)
        return value

    # --- redact, then shorten --------------------------------------------------------------

    def keep_last(self, text: str, limit: int) -> str:
        return self.text(text)[-limit:] if limit > 0 else ""

    def keep_first(self, text: str, limit: int) -> str:
        return self.text(text)[:limit] if limit > 0 else ""

    def keep_last_bytes(self, data: builtins.bytes, limit: int) -> builtins.bytes:
        return self.bytes(data)[-limit:] if limit > 0 else b""

    def line(self, text: str, limit: int) -> str:
        """One line of at most ``limit`` characters (errors, the final stderr line): redacted,
        whitespace collapsed to single spaces (and redacted again: collapsing can form a
        secret's collapsed form), then cut."""
        return self.text(" ".join(self.text(text).split()))[:limit]

    def tail_of(self, path: Path, limit: int) -> builtins.bytes:
        """The redacted last ``limit`` bytes of the file at ``path`` (seeking, not reading it
        all; see the module for the window). Raises ``OSError`` when it cannot be read."""
        if limit <= 0:
            return b""
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - (limit + self.longest))
            f.seek(start)
            window = f.read(size - start)
        return self.bytes(window, cut_start=start > 0, cut_end=True)[-limit:]
