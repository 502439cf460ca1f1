"""Signatures: the texts that say who is at fault, one type and one matcher for all of them.

A :class:`Signature` is a family of texts defined by what they mean: its id, its family
(the class of cause the marker's ``fault.family`` names), whose fault it is (``blame``:
the host's GPU, driver or interconnect, the network an installer reached, or the job), its
witness (the text it is read from: the worker's ``console``, ``pip``'s or ``uv``'s output)
and the public sources that show it. A :class:`Table` holds the signatures of one witness
and matches them, two ways:

* :meth:`Table.first`: the first row, in table order, found anywhere in a text (an
  installer's output: the specific cause before the generic wrapper);
* :meth:`Table.lines`: each line's first matching row, in line order (a console, which
  ``fsm.policy.families`` reads to its verdict).

The installers' network tables live here too (``PIP_NETWORK``, ``UV_NETWORK``): this
module imports nothing of the runner, so the policy that prints the tables loads no
process, store or installer code.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import NamedTuple

__all__ = ["PIP_NETWORK", "UV_NETWORK", "Match", "Signature", "Table"]

#: The evidence shows at most this much of the deciding line.
EVIDENCE_LINE_CHARS = 300
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


class Signature(NamedTuple):
    """A family of texts that says whose fault a failure is."""

    id: str
    #: the class of cause, as the marker's ``fault.family`` names it (``gpu-ecc``, ``xid``,
    #: ``network``, ``job-oom``, ...)
    family: str
    pattern: str
    meaning: str
    #: ``gpu``, ``driver`` or ``interconnect`` (the host's), ``network`` (an installer's
    #: index), ``job``; or ``shm``, ``disk``, ``nccl-timeout``: words that name no cause by
    #: themselves (the policy's ``HOST_EVIDENCE`` rows decide them)
    blame: str
    #: True: a fresh host would not see it (retried); False: the job's, fatal
    retriable: bool
    #: what it is read from: ``console`` (the worker's), ``pip``, ``uv``
    witness: str = "console"
    #: public threads and documents that show the family's texts and its cause
    sources: tuple[str, ...] = ()
    #: a consequence rather than a cause (an NCCL watchdog's timeout): it decides only when
    #: no other row matches, so a cause beside it wins
    weak: bool = False

    @property
    def name(self) -> str:
        """The installers' tables call the id a name (their error messages print it)."""
        return self.id


class Match(NamedTuple):
    signature: Signature
    #: the deciding line, stripped and cut to ``EVIDENCE_LINE_CHARS`` around the match
    line: str

    def evidence(self) -> dict[str, str]:
        return {"signature": self.signature.id, "line": self.line}


class Table:
    """The signatures of one witness, compiled on first use (start-up does not pay)."""

    def __init__(self, rows: tuple[Signature, ...], *, ignore_case: bool,
                 skip: str | None = None) -> None:
        self.rows = rows
        self._flags = re.IGNORECASE if ignore_case else 0
        self._skip = skip

    def __iter__(self) -> Iterator[Signature]:
        return iter(self.rows)

    @functools.cached_property
    def _compiled(self) -> tuple[re.Pattern[str], tuple[re.Pattern[str], ...],
                                 re.Pattern[str] | None]:
        rows = tuple(re.compile(sig.pattern, self._flags) for sig in self.rows)
        anyone = re.compile("|".join(f"(?:{sig.pattern})" for sig in self.rows), self._flags)
        skip = re.compile(self._skip) if self._skip else None
        return anyone, rows, skip

    def first(self, text: str) -> Signature | None:
        """The first row, in table order, found anywhere in ``text``."""
        _, rows, _ = self._compiled
        return next((sig for sig, row in zip(self.rows, rows, strict=True)
                     if row.search(text)), None)

    def lines(self, text: str, *, last: int | None = None) -> Iterator[Match]:
        """Each line's first matching row, in line order (only the ``last`` lines when
        given; lines the table's ``skip`` pattern finds are passed over)."""
        anyone, rows, skip = self._compiled
        lines = _LINE_BREAK.split(text)
        if lines and lines[-1] == "":
            lines.pop()
        for line in lines[-last:] if last else lines:
            if anyone.search(line) is None or (skip is not None and skip.search(line)):
                continue
            for sig, row in zip(self.rows, rows, strict=True):
                found = row.search(line)
                if found is not None:
                    yield Match(sig, shown_line(line, found.start()))
                    break


def shown_line(line: str, at: int) -> str:
    """The line around position ``at``, stripped, at most ``EVIDENCE_LINE_CHARS`` long."""
    text = line.strip()
    if len(text) <= EVIDENCE_LINE_CHARS:
        return text
    at -= len(line) - len(line.lstrip())  # where the match is in the stripped text
    start = max(0, min(at - 60, len(text) - EVIDENCE_LINE_CHARS))
    return text[start:start + EVIDENCE_LINE_CHARS]


# --- the installers' network failures ----------------------------------------------------


def _network(witness: str, sig_id: str, meaning: str, pattern: str) -> Signature:
    return Signature(sig_id, "network", pattern, meaning, "network", True, witness)


# pip's: checked in order; the first match names the failure in the error message, so the
# specific causes come before the generic wrappers (NewConnectionError, pip's "Retrying"
# warning). Case-sensitive on purpose: these are the exact spellings of urllib3, requests,
# pip and the OS; a build log that merely mentions "timeout" must not turn a build error
# retriable. Any match wins over the failure's last line: with an unreachable index pip
# ends with "Could not find a version that satisfies the requirement", which alone is
# "other". The cost of that choice: a blip pip recovered from, followed by a real failure,
# is tried again and ends retriable; the opposite mistake would kill a run an outage
# interrupted.
PIP_NETWORK = Table(tuple(_network("pip", *row) for row in (
    ("connection-refused", "connection refused to the package index",
     r"Connection refused|ConnectionRefusedError|\[Errno 111\]"),
    ("connection-reset", "connection reset",
     r"Connection reset by peer|ConnectionResetError|\[Errno 104\]|RemoteDisconnected"
     r"|Connection aborted"),
    ("read-timeout", "read timed out", r"ReadTimeoutError|Read timed out"),
    ("connect-timeout", "connect timed out",
     r"ConnectTimeoutError|Connection to \S+ timed out|TimeoutError: \[Errno 110\]"),
    ("name-resolution", "the index host name did not resolve",
     r"Name or service not known|Temporary failure in name resolution|NameResolutionError"
     r"|nodename nor servname provided|getaddrinfo failed|No address associated with hostname"
     r"|\[Errno -[235]\]"),
    ("network-unreachable", "network unreachable",
     r"Network is unreachable|No route to host|\[Errno 101\]|\[Errno 113\]"),
    ("server-error", "the package index answered 5xx",
     r"too many 5\d\d error responses|HTTP error 5\d\d"
     r"|\b5\d\d (?:Server Error|Service Unavailable|Bad Gateway|Gateway Time-?out"
     r"|Internal Server Error)"),
    ("connection-broken", "connection broken mid-transfer",
     r"ProtocolError|IncompleteRead|ChunkedEncodingError|Connection broken"),
    ("new-connection", "could not connect to the package index",
     r"NewConnectionError|Failed to establish a new connection"),
    ("pip-retrying", "pip retried a broken connection", r"Retrying \(Retry\(total="),
)), ignore_case=False)

# uv's error chain, as uv 0.13 prints it for each failure (tests/test_uv.py keeps the real
# messages): "error: Failed to fetch: URL" then "cause:" lines down to the OS error. Checked
# in order, the specific causes first; case-sensitive, exact spellings of uv (reqwest,
# hyper, tokio) and the OS. A TLS failure ("invalid peer certificate") is in none of them:
# a fresh host would fail the same way. So is git's own "Couldn't connect to server" for a
# VCS requirement, as with pip.
UV_NETWORK = Table(tuple(_network("uv", *row) for row in (
    ("connection-refused", "connection refused to the package index",
     r"Connection refused|\(os error 111\)"),
    ("connection-reset", "the index reset or closed the connection before answering",
     r"Connection reset by peer|\(os error 104\)|connection closed before message completed"),
    ("connect-timeout", "connect timed out (UV_HTTP_CONNECT_TIMEOUT)", r"deadline has elapsed"),
    ("timeout", "no answer from the package index within UV_HTTP_TIMEOUT",
     r"operation timed out"),
    ("name-resolution", "the index host name did not resolve",
     r"dns error|failed to lookup address information|Name or service not known"
     r"|Temporary failure in name resolution|No address associated with hostname"),
    ("network-unreachable", "network unreachable",
     r"Network is unreachable|No route to host|\(os error 10[01]\)|\(os error 113\)"),
    ("server-error", "the package index answered 5xx", r"HTTP status server error \(5\d\d"),
    ("connection-broken", "connection broken mid-transfer",
     r"error decoding response body|end of file before message length reached"
     r"|error reading a body from connection"),
    ("uv-retrying", "uv retried a failing request and gave up",
     r"Request failed after \d+ retr(?:y|ies)"),
)), ignore_case=False)
