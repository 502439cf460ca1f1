"""The runner's own files: written whole or not at all, and read as untrusted JSON.

One of each: :func:`atomic_file` (and :func:`write_atomic` for text) for every file the
runner writes that a crash or a reader must never see half-written (the persisted result
and start, the local store's copies, the model cache's ref, the Hub client's downloads);
:func:`json_object` for every JSON document the runner reads from outside (a marker, a
lease, a heartbeat, a persisted result or start, a previous attempt's marker, the
payload): bounded, and a problem named in one line, never an exception.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["JsonProblem", "atomic_file", "json_object", "json_type", "write_atomic"]


@contextlib.contextmanager
def atomic_file(path: Path, *, durable: bool = False, mode: int = 0o600,
                suffix: str = "") -> Iterator[BinaryIO]:
    """A new file that becomes ``path`` whole or not at all: created beside it (its folder
    made), as ``.<name>.<random><suffix>`` with ``mode`` (the umask applies), renamed over
    ``path`` when the block ends, removed when the block raises. ``durable`` flushes it to
    disk before the rename (the persisted result must survive a host crash)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        aside = path.with_name(f".{path.name}.{os.urandom(6).hex()}{suffix}")
        try:
            file = open(aside, "xb", opener=lambda p, flags: os.open(p, flags, mode))  # noqa: SIM115
            break
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
    try:
        with file:
            yield file
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(aside, path)
    finally:
        aside.unlink(missing_ok=True)


def write_atomic(path: Path, text: str, *, durable: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all (:func:`atomic_file`)."""
    with atomic_file(path, durable=durable) as file:
        file.write(text.encode("utf-8"))


class JsonProblem(ValueError):
    """Why bytes are not a JSON object, in one line ("not JSON: Expecting value at line 1
    column 1", "not a JSON object but an array"); ``got``: what they hold instead, when it
    is JSON."""

    def __init__(self, problem: str, got: str | None = None) -> None:
        super().__init__(problem)
        self.got = got


def json_object(data: bytes, *, limit: int | None = None,
                parse_int: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """The JSON object ``data`` holds; :class:`JsonProblem` when it is more than ``limit``
    bytes, not UTF-8, not JSON (the decoder's message and place), nested too deeply for the
    decoder, or not an object."""
    if limit is not None and len(data) > limit:
        raise JsonProblem(f"larger than {limit:,} bytes")
    try:
        value = json.loads(data.decode("utf-8"), parse_int=parse_int)
    except UnicodeDecodeError:
        raise JsonProblem("not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise JsonProblem(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise JsonProblem("not JSON: nested too deeply") from None
    except ValueError as exc:  # anything else the decoder refuses (a too long integer)
        raise JsonProblem(f"not usable JSON: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(value, dict):
        raise JsonProblem(f"not a JSON object but {json_type(value)}", json_type(value))
    return value


def finite_number(value: object) -> float | None:
    """A decoded JSON number as a float when it is one and finite as a float; None for
    anything else: a boolean, not a number, infinite, or an integer too large for a float
    (which ``math.isfinite`` and ``float`` would raise on)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    with contextlib.suppress(OverflowError):
        number = float(value)
        return number if math.isfinite(number) else None
    return None


def json_type(value: object) -> str:
    """What a decoded JSON value is, in words ("an array", "null")."""
    names = {bool: "a boolean", int: "a number", float: "a floating-point number",
             str: "a string", list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)
