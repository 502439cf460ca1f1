"""Secret redaction for every text that leaves the process.

The values of secret-looking keys in the payload env (DESIGN, "Secrets") are replaced by
``***`` in log events, console tails, error texts and the marker.

A value can leak around a redactor that only knows whole values (TRAPS.md), so this one:

* knows each secret in the forms it is printed in: as is, URL-quoted (three ways),
  JSON-escaped (ASCII or not), backslash-escaped as by ``repr`` (both quote styles) and
  whitespace-collapsed; ``bytes`` knows the UTF-8 of each of these;
* masks every occurrence of every form whole, overlapping ones included (the union of all
  matches becomes masks; the text between matches is kept unchanged);
* masks credentials it was never told about: the userinfo of a URL
  (``scheme://user:password@host``, ``scheme://token@host``), the value of an HTTP
  ``Authorization`` header and a bare ``Bearer <token>``;
* redacts first and shortens afterwards (``keep_last``, ``keep_first``, ``line``,
  ``tail_of``), so no cut leaves a piece of a secret behind. ``tail_of`` reads ``longest``
  bytes more than it keeps, so a secret straddling the kept window is masked whole, and
  masks the piece of a secret that the read window itself cut at its start (and a secret's
  start still being written at the end of the file).

Results never hold 10 or more consecutive characters of a known secret (or the whole
secret, when it is shorter) in any of those forms, for inputs that hold the secret whole
(or, for ``tail_of``, cut by the read window).
"""

from __future__ import annotations

import builtins
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import AnyStr, NamedTuple
from urllib.parse import quote, quote_plus

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
    return {
        k
        for k, v in env.items()
        if k != LIST_KEY
        and (
            k in listed
            or (_SECRET_KEY.search(k) and not (isinstance(v, str) and _SETTING_VALUE.fullmatch(v)))
        )
    }


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
        try:
            form = encode(secret)
        except UnicodeError:  # a lone surrogate cannot be URL-quoted
            continue
        if len(form) >= _MIN_SECRET_LEN:
            forms.add(form)
    return forms


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
        for errors in ("strict", "surrogatepass", "surrogateescape"):
            try:
                data = form.encode("utf-8", errors)
                suffix = len(form[-_FRAGMENT:].encode("utf-8", errors))
                prefix = len(form[:_FRAGMENT].encode("utf-8", errors))
            except UnicodeError:
                continue
            if len(form) < _FRAGMENT:
                suffix = 1
            if len(form) <= _FRAGMENT:
                prefix = 0
            out.setdefault(data, _BytesForm(data, suffix, prefix))
            if errors == "strict":
                break
    return list(out.values())


def _cut_piece(forms: list[_BytesForm], window: builtins.bytes, at_end: bool = False) -> int:
    """The length of the longest piece of a form cut off at the start of ``window``: a
    proper suffix of the form, ``min_suffix`` bytes or more (0 if none). With ``at_end``,
    ``window`` comes reversed and the piece is a proper prefix, ``min_prefix`` bytes or more."""
    best = 0
    for form in forms:
        data, least = (form.data[::-1], form.min_prefix) if at_end else (form.data, form.min_suffix)
        if not least or len(window) < least:
            continue
        needle = window[:least]
        at = data.find(needle, 1)
        while 0 < at <= len(data) - least:
            if window.startswith(data[at:]):
                best = max(best, len(data) - at)
                break
            at = data.find(needle, at + 1)
    return best


def _alternation(forms: Iterable[AnyStr]) -> list[AnyStr]:
    """Longest first, so at any position the whole form is matched."""
    return sorted(set(forms), key=lambda f: (-len(f), f))


def _spans(pattern: re.Pattern[AnyStr] | None, value: AnyStr) -> list[tuple[int, int]]:
    """Every position where a form starts, with the longest form matching there
    (overlapping matches included, so the union of the spans covers every occurrence)."""
    spans: list[tuple[int, int]] = []
    if pattern is None:
        return spans
    found = pattern.search(value)
    while found is not None:
        spans.append(found.span())
        found = pattern.search(value, found.start() + 1)
    return spans


def _masked(
    value: AnyStr,
    spans: list[tuple[int, int]],
    mask: AnyStr,
    credentials: list[tuple[re.Pattern[AnyStr], AnyStr]],
) -> AnyStr:
    """``value`` with each union of overlapping spans replaced by one ``mask``, then the
    credentials nobody named masked."""
    if spans:
        parts: list[AnyStr] = []
        pos = 0
        ordered = sorted(spans)
        start, end = ordered[0]
        for s, e in ordered[1:]:
            if s < end:
                end = max(end, e)
                continue
            parts += [value[pos:start], mask]
            pos = end
            start, end = s, e
        parts += [value[pos:start], mask, value[end:]]
        value = value[:0].join(parts)
    for pattern, repl in credentials:
        value = pattern.sub(repl, value)
    return value


class Redactor:
    """Replaces every known secret value by ``***``, in text and in bytes (see the module)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets: set[str] = set()
        self._pattern: re.Pattern[str] | None = None
        self._bpattern: re.Pattern[builtins.bytes] | None = None
        self._bforms: list[_BytesForm] = []
        self.add(secrets)

    def learn(self, env: Mapping[str, str], extra_keys: Iterable[str] = ()) -> set[str]:
        """Mask the values of ``secret_keys(env, extra_keys)`` from now on and return those
        keys (also the keys of values too short to be masked). The one way an env's secrets
        become known: the attempt's redactor learns the payload's env with it.
        """
        keys = secret_keys(env, extra_keys)
        self.add(env[k] for k in keys)
        return keys

    def add(self, secrets: Iterable[str]) -> None:
        """Mask these values too (values shorter than 4 characters are ignored)."""
        new = {s for s in secrets if isinstance(s, str) and len(s) >= _MIN_SECRET_LEN}
        if new <= self._secrets:
            return
        self._secrets |= new
        forms = _alternation(f for s in self._secrets for f in _forms(s))
        self._bforms = _byte_forms(forms)
        self._pattern = re.compile("|".join(re.escape(f) for f in forms))
        self._bpattern = re.compile(
            b"|".join(re.escape(b) for b in _alternation(f.data for f in self._bforms))
        )

    def __bool__(self) -> bool:
        return bool(self._secrets)

    @property
    def longest(self) -> int:
        """The length in bytes of the longest text a secret form matches (0 when none): read
        this much more than you keep and a secret across the cut is masked whole."""
        return max((len(f.data) for f in self._bforms), default=0)

    def text(self, value: str) -> str:
        return _masked(value, _spans(self._pattern, value), MASK, _TEXT_CREDENTIALS)

    def bytes(
        self, value: builtins.bytes, *, cut_start: bool = False, cut_end: bool = False
    ) -> builtins.bytes:
        """``cut_start`` (``cut_end``): ``value`` was read from a longer text that may go on
        before (after) it, so a piece of a secret it starts (ends) with is masked too."""
        spans = _spans(self._bpattern, value)
        if cut_start and (piece := _cut_piece(self._bforms, value)):
            spans.append((0, piece))
        if cut_end and (piece := _cut_piece(self._bforms, value[::-1], at_end=True)):
            spans.append((len(value) - piece, len(value)))
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
        if limit <= 0:
            return ""
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
