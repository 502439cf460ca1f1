"""The attempt marker's format (CONTRACT section 4): its file name, how it is built, read
and checked. One owner: the runner builds its marker here (:func:`build`), and whatever
reads one (the next attempt's verification, the fleet view and ``explain``, the lease's
reader, a persisted result) finds it by :data:`NAME_RE` or :func:`name` and reads it
through :func:`parse` and :func:`problem`.

How a marker is kept (``fsm.attempt.result``) and published (``fsm.attempt.publish``) is
not its format.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fsm.files import JsonProblem, json_object

if TYPE_CHECKING:
    from fsm.output.redact import Redactor
    from fsm.payload import Destination

__all__ = ["MARKER_MAX_BYTES", "MAX_ERROR_CHARS", "NAME_RE", "MarkerFile", "build", "listed",
           "name", "parse", "problem", "verdict"]

MAX_ERROR_CHARS = 2_000
#: A marker is at most a few KiB (its ``error`` at most ``MAX_ERROR_CHARS``); a reader (the
#: fleet view, the next attempt's verification) reads no more of one than this, and takes a
#: longer one as unreadable.
MARKER_MAX_BYTES = 1 << 20
#: An attempt marker directly in the prefix: ``<arm>_attempt<N>.json`` (the arm as the
#: payload's ``flash_arm`` allows it), ``N`` as the runner writes it: ASCII digits without a
#: leading zero, at most 1,000,000 (``attempt01`` is no marker of attempt 1, nor of any).
NAME_RE = re.compile(
    r"([A-Za-z0-9][A-Za-z0-9._-]{0,63})_attempt(0|[1-9][0-9]{0,5}|1000000)\.json", re.ASCII)


def name(arm: str, attempt: int) -> str:
    """The file name of ``arm``'s attempt ``attempt``'s marker."""
    return f"{arm}_attempt{attempt}.json"


def build(*, ok: bool, retriable: bool, error: str, dest: Destination, redactor: Redactor,
          evidence: dict[str, Any]) -> dict[str, Any]:
    """The marker of CONTRACT section 4 plus evidence, redacted, error capped."""
    marker: dict[str, Any] = {
        "ok": ok,
        "ts": time.time(),
        "attempt": dest.attempt,
        "retriable": bool(retriable) and not ok,
        "error": "" if ok else redactor.line(error, MAX_ERROR_CHARS),
    }
    for key, value in evidence.items():
        marker.setdefault(key, redactor.deep(value))
    return marker


def problem(record: object, attempt: int) -> str | None:
    """Why ``record`` is not a well-formed marker of ``attempt`` (CONTRACT section 4)."""
    if not isinstance(record, dict):
        return "not an object"
    for key in ("ok", "retriable"):
        if not isinstance(record.get(key), bool):
            return f"{key!r} is not true/false"
    number = record.get("attempt")
    if not isinstance(number, int) or isinstance(number, bool) or number != attempt:
        return f"'attempt' is not {attempt}"
    ts = record.get("ts")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or ts != ts:
        return "'ts' is not a number"
    if not isinstance(record.get("error", ""), str):
        return "'error' is not text"
    return None


def verdict(record: Mapping[str, Any]) -> Literal["succeeded", "retriable", "fatal"]:
    """What a readable marker says (CONTRACT section 10, rule 1): succeeded, retriable or
    fatal; what the control plane, the fleet view and the runner's last event call it."""
    if record.get("ok") is True:
        return "succeeded"
    return "retriable" if record.get("retriable") is True else "fatal"


@dataclass(frozen=True)
class MarkerFile:
    name: str
    arm: str
    attempt: int


def listed(names: Iterable[str]) -> list[MarkerFile]:
    """The attempt markers among a folder's file names, by attempt then arm."""
    matches = [m for m in map(NAME_RE.fullmatch, names) if m is not None]
    found = [MarkerFile(m.string, m.group(1), int(m.group(2))) for m in matches]
    return sorted(found, key=lambda m: (m.attempt, m.arm, m.name))


def parse(data: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(the marker, None), or (None, why it cannot be read as one)."""
    try:
        value = json_object(data, limit=MARKER_MAX_BYTES)
    except JsonProblem as exc:
        return None, str(exc)
    if not isinstance(value.get("ok"), bool):
        return None, "no boolean 'ok'"
    return value, None
