"""The container's termination message: the attempt's verdict where the engine shows it.

Kubernetes reads the file at the container's ``terminationMessagePath`` (by default
``/dev/termination-log``) when the container ends, keeps at most 4,096 bytes of it, and
shows it in ``kubectl describe pod`` and in the pod's status. ``run`` writes one line of
JSON there as it exits: the exit status and its name (``fsm.exits``), the marker's class
and rule, the marker's path when it was published, and the one-line reason the process
ends with, redacted like every text that leaves the process.

``FLASH_TERMINATION_LOG`` in the runner's own environment names another file (empty: off).
The default file is written only when it exists (Kubernetes creates it; a container that
has none gets no file in ``/dev``); a named one is created. A file that is absent, or
cannot be written (read-only, a directory, a FIFO nobody reads), is no error: the attempt
has ended, and this is the one write that may fail without a word.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Mapping
from typing import Any

from fsm import exits
from fsm.output.redact import Redactor

DEFAULT_PATH = "/dev/termination-log"
ENV_KEY = "FLASH_TERMINATION_LOG"
#: Kubernetes keeps at most this many bytes of the message (``terminationMessagePath``).
MAX_BYTES = 4096


def path(environ: Mapping[str, str]) -> tuple[str, bool] | None:
    """The file to write and whether it may be created, or None when off."""
    named = environ.get(ENV_KEY)
    if named is None:
        return DEFAULT_PATH, False
    return (named, True) if named else None


def message(fields: Mapping[str, Any], redactor: Redactor, limit: int = MAX_BYTES) -> bytes:
    """``fields`` as one line of JSON, redacted, at most ``limit`` bytes: the ``reason``
    is cut (never a key) until the line fits."""
    data = redactor.deep(dict(fields))
    assert isinstance(data, dict)
    reason = str(data.get("reason") or "")

    def encoded(text: str) -> bytes:
        line = json.dumps({**data, "reason": text}, ensure_ascii=False, default=str)
        return redactor.text(line).encode("utf-8") + b"\n"

    out = encoded(reason)
    if len(out) <= limit:
        return out
    # The longest prefix of the reason that fits, cut with "..." (none fits: the empty one).
    fits = bisect.bisect_right(range(len(reason) + 1), limit,
                               key=lambda n: len(encoded(reason[:n] + "...")))
    return encoded(reason[: max(0, fits - 1)] + "...")[:limit]


def write(
    environ: Mapping[str, str], redactor: Redactor, *, status: int, reason: str,
    verdict: str | None = None, rule: str | None = None, marker: str | None = None,
) -> bool:
    """Write the termination message (module docstring); True when it was written."""
    where = path(environ)
    if where is None:
        return False
    row = exits.by_code(status)
    fields = {"status": status, "name": row.name if row else None, "class": verdict,
              "rule": rule, "marker": marker, "reason": reason}
    create = os.O_CREAT if where[1] else 0
    flags = os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY | create
    try:
        data = message(fields, redactor)
        fd = os.open(where[0], flags, 0o644)
        try:
            os.write(fd, data)  # far below a pipe's or a file's one-write size
        finally:
            os.close(fd)
    except (OSError, ValueError):  # absent, unwritable, a FIFO nobody reads, a NUL in it
        return False
    return True
