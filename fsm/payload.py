"""The payload (CONTRACT section 3): parsed once, validated strictly, typed.

Every violation is one ``PayloadError`` whose message names the key and the problem.
Unknown keys are ignored for forward compatibility.
"""

from __future__ import annotations

import json
import os
import re
import stat
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, TypeVar

from fsm.attempt import marker
from fsm.errors import PayloadError
from fsm.extras.pip import _bounded, refused_extra_pip
from fsm.files import JsonProblem, finite_number, json_object, json_type
from fsm.output.redact import LIST_KEY, Redactor

#: ``phase`` and ``flash_arm`` name files.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
DEFAULT_MAX_WALL_S = 86_400.0
MODES = ("train", "preload")
#: The attempt number names the marker: a JSON integer in this range (CONTRACT section 3).
MAX_ATTEMPT = 1_000_000
#: ``hf_prefix`` bounds, in UTF-8 bytes: the marker's repo path stays a usable path on the
#: Hub and a local filesystem (a file name is at most 255 bytes; a path well under 4096).
MAX_PREFIX_BYTES = 1_000
MAX_PART_BYTES = 255
#: Folders the Hub refuses to commit under (huggingface_hub ``FORBIDDEN_FOLDERS``).
HUB_FORBIDDEN_PARTS = (".git", ".cache")


@dataclass(frozen=True)
class Destination:
    """Where the attempt's marker goes: known as soon as these keys are, even when the
    rest of the payload is invalid."""

    hf_repo: str
    hf_prefix: str
    arm: str
    attempt: int
    token: str | None

    @property
    def marker_name(self) -> str:
        return marker.name(self.arm, self.attempt)

    def path(self, name: str) -> str:
        """The repo path of artifact ``name`` under this run's prefix."""
        return f"{self.hf_prefix}/{name}"


@dataclass(frozen=True)
class Payload:
    dest: Destination
    mode: str = "train"
    phase: str | None = None
    seed: int | None = None
    job_spec_json: str | None = None
    job_spec_in_hf: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    extra_pip: tuple[str, ...] = ()
    max_wall_s: float = DEFAULT_MAX_WALL_S
    deadline_at: float | None = None
    run_id: str | None = None
    models: tuple[str, ...] = ()
    cache_mount_marker: str | None = None
    cache_block_device: bool = False
    expect_gpus: int | None = None


def read_raw(path: Path) -> dict[str, Any]:
    """The payload file as a JSON object, or a PayloadError naming what is wrong.

    Only a regular file of at most :data:`MAX_PAYLOAD_BYTES` is read: a FIFO would block
    the runner forever (no signal gets it out of ``open``), ``/dev/zero`` would be read
    until memory runs out. It is opened without blocking and looked at before a byte is
    read."""
    shown = str(path) if str(path).isprintable() else repr(str(path))  # for one line
    try:
        data = _read_bounded(path, shown)
    except FileNotFoundError:
        raise PayloadError(f"payload file {shown} does not exist") from None
    except OSError as exc:
        raise PayloadError(
            f"payload file {shown} is unreadable: {' '.join((exc.strerror or str(exc)).split())}"
        ) from None
    try:
        raw = json_object(data, parse_int=_parse_int)
    except JsonProblem as exc:
        if exc.got is not None:
            raise PayloadError(f"payload must be a JSON object, got {exc.got}") from None
        raise PayloadError(f"payload file {shown} is {exc}") from None
    for key, value in raw.items():
        if (digits := _long_integer_in(value)) is not None:
            raise PayloadError(
                f"payload key {key!r:.80} holds an integer of {digits} digits, "
                "too long to be a number"
            )
    return raw


#: The largest payload file read: far past any user_data (a large spec is spilled to the store).
MAX_PAYLOAD_BYTES = 16 << 20

_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _read_bounded(path: Path, shown: str) -> bytes:
    """The bytes of the regular file at ``path``, at most :data:`MAX_PAYLOAD_BYTES`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "not a file")
            raise PayloadError(f"payload file {shown} is {kind}, not a regular file")
        if st.st_size > MAX_PAYLOAD_BYTES:
            raise PayloadError(
                f"payload file {shown} is {st.st_size:,} bytes, more than the "
                f"{MAX_PAYLOAD_BYTES:,} a payload may be"
            )
        with open(fd, "rb", closefd=False) as file:
            data = file.read(MAX_PAYLOAD_BYTES + 1)  # to the end, or one byte past the bound
        if len(data) > MAX_PAYLOAD_BYTES:  # it grew while being read
            raise PayloadError(
                f"payload file {shown} grew past the {MAX_PAYLOAD_BYTES:,} bytes a payload "
                "may be while it was read"
            )
        return data
    finally:
        os.close(fd)


#: Where an engine that retries the same payload itself says which try this is (1 on the
#: first): AWS Batch (CONTRACT section 9).
ENGINE_ATTEMPT_VAR = "AWS_BATCH_JOB_ATTEMPT"


def engine_retries(environ: Mapping[str, str]) -> int:
    """How many times the engine already ran this payload: ``AWS_BATCH_JOB_ATTEMPT`` minus
    one, 0 where no engine says (or says something that is no positive whole number: the
    engine's variable is not the payload's, and a wrong guess would write another attempt's
    marker)."""
    value = environ.get(ENGINE_ATTEMPT_VAR, "").strip()
    return int(value) - 1 if value.isdigit() and 1 <= int(value) <= MAX_ATTEMPT else 0


def destination(raw: Mapping[str, Any], retries: int = 0) -> Destination | None:
    """The marker's destination, or None when it is not usable as given.

    Usable only when ``hf_repo``, ``hf_prefix``, ``flash_arm`` and ``attempt`` are each
    valid as given (``flash_arm`` and ``attempt`` may be absent or null: their defaults
    apply). A present but invalid value is never coerced to a default: that would write
    another attempt's marker. The rest of the payload does not matter here, so a payload
    invalid elsewhere still gets its fatal marker. :func:`parse` decides the same way: both
    go through :func:`require_destination`.
    """
    try:
        return require_destination(raw, retries)
    except PayloadError:
        return None


def parse(raw: Mapping[str, Any], retries: int = 0) -> Payload:
    """Validate ``raw`` against the contract; raise PayloadError naming the first problem.
    ``retries``: the engine's own retries of this payload (``engine_retries``)."""
    dest = require_destination(raw, retries)
    _check_encodable(raw)
    mode = _opt(raw, "mode", str, "train")
    if mode not in MODES:
        raise PayloadError(f"payload key 'mode' must be one of {', '.join(MODES)}, got {mode!r}")
    max_wall_s = _opt_number(raw, "max_wall_s", DEFAULT_MAX_WALL_S)
    if max_wall_s <= 0:
        raise PayloadError(f"payload key 'max_wall_s' must be > 0, got {max_wall_s}")
    common: dict[str, Any] = {
        "dest": dest,
        "mode": mode,
        "max_wall_s": max_wall_s,
        "deadline_at": _opt_number(raw, "deadline_at", None),
        "env": _env(raw),
        "run_id": _opt(raw, "run_id", str, None),
        "cache_mount_marker": _opt(raw, "cache_mount_marker", str, None) or None,
        "cache_block_device": _opt(raw, "cache_block_device", bool, False),
        "expect_gpus": _opt(raw, "expect_gpus", int, None),
    }
    if common["expect_gpus"] is not None and common["expect_gpus"] < 1:
        raise PayloadError(
            f"payload key 'expect_gpus' must be at least 1, got {common['expect_gpus']}"
        )
    if mode == "preload":
        if not (models := _str_list(raw, "models")):
            raise PayloadError(
                "payload key 'models' is required in preload mode (a list of repo ids)"
            )
        for model in models:
            if not REPO_RE.fullmatch(model):
                raise PayloadError(f"payload key 'models' has an invalid repo id {model!r}")
        marker = common["cache_mount_marker"]
        if marker is not None and (
            "/" in marker or "\x00" in marker or marker in (".", "..") or len(marker) > 255
        ):
            raise PayloadError(
                f"payload key 'cache_mount_marker' must be a plain file name, got {marker!r}"
            )
        return Payload(models=tuple(models), **common)
    phase = _name(raw, "phase", _required(raw, "phase", str), "files")
    return Payload(
        phase=phase,
        seed=_required(raw, "seed", int),
        job_spec_json=_opt(raw, "job_spec_json", str, None),
        job_spec_in_hf=_opt(raw, "job_spec_in_hf", bool, False),
        extra_pip=_extra_pip(raw),
        **common,
    )


# --- helpers --------------------------------------------------------------------------


def require_destination(raw: Mapping[str, Any], retries: int = 0) -> Destination:
    """The marker's destination, or a PayloadError naming the first key that makes it
    unusable: the one place that decides the destination keys. The attempt is the
    payload's plus the engine's own ``retries`` of it (CONTRACT section 9)."""
    repo = _required(raw, "hf_repo", str)
    if len(repo) > 200 or not REPO_RE.fullmatch(repo):
        raise PayloadError(
            f"payload key 'hf_repo' must look like 'org/name', got {_quoted(repo, raw)}"
        )
    prefix = _required(raw, "hf_prefix", str)
    if (problem := _prefix_problem(prefix)) is not None:
        raise PayloadError(f"payload key 'hf_prefix' {problem}, got {_quoted(prefix, raw)}")
    arm = _name(raw, "flash_arm", _opt(raw, "flash_arm", str, "instance"), "the marker")
    attempt = _opt(raw, "attempt", int, 0)
    if attempt < 0:
        raise PayloadError(f"payload key 'attempt' must be >= 0, got {_short_int(attempt)}")
    attempt += retries
    if attempt > MAX_ATTEMPT:
        raise PayloadError(
            f"payload key 'attempt' must be at most {MAX_ATTEMPT:,}, got {_short_int(attempt)}"
        )
    # The token only authenticates the store: an env invalid elsewhere does not hide it
    # (parse() still refuses that env afterwards).
    env = raw.get("env")
    token = env.get("HF_TOKEN") if isinstance(env, dict) else None
    return Destination(
        hf_repo=repo,
        hf_prefix=prefix.strip("/"),
        arm=arm,
        attempt=attempt,
        token=token if isinstance(token, str) and token else None,
    )


def _name(raw: Mapping[str, Any], key: str, value: str, names: str) -> str:
    """``value``, a name of files: a PayloadError unless it matches :data:`NAME_RE`."""
    if not NAME_RE.fullmatch(value):
        raise PayloadError(
            f"payload key {key!r} must match {NAME_RE.pattern} (it names {names}), "
            f"got {_quoted(value, raw)}"
        )
    return value


def _prefix_problem(value: str) -> str | None:
    """Why ``value`` cannot be the run's repo folder, or None when it can."""
    if value.startswith("/"):
        return "must be a relative repo folder (no leading '/')"
    if "\\" in value:
        return "must use '/' between folders (no backslash)"
    if any(unicodedata.category(char) == "Cc" for char in value):
        return "must not hold NUL or control characters"
    try:
        encoded = value.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid Unicode (no lone surrogate escape)"
    if len(encoded) > MAX_PREFIX_BYTES:
        return f"must be at most {MAX_PREFIX_BYTES} bytes as UTF-8 (is {len(encoded)})"
    parts = value.strip("/").split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "must be a relative repo folder without empty, '.' or '..' parts"
    if any(len(part.encode("utf-8")) > MAX_PART_BYTES for part in parts):
        return f"must have folder names of at most {MAX_PART_BYTES} bytes as UTF-8"
    if any(part in HUB_FORBIDDEN_PARTS for part in parts):
        return f"must not lie under a {' or '.join(HUB_FORBIDDEN_PARTS)} folder (the Hub refuses)"
    return None


@dataclass(frozen=True)
class _LongInteger:
    """A JSON integer with more digits than Python converts (``sys.int_info``)."""

    digits: int


def _parse_int(text: str) -> int | _LongInteger:
    try:
        return int(text)
    except ValueError:  # "Exceeds the limit (4300 digits) for integer string conversion"
        return _LongInteger(len(text.lstrip("-")))


def _long_integer_in(value: object) -> int | None:
    """The digit count of a too-long integer anywhere in ``value``, else None."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, _LongInteger):
            return item.digits
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return None


def _check_encodable(raw: Mapping[str, Any]) -> None:
    """JSON escapes can spell lone surrogates, which no file name, environment or upload
    can carry: refuse them once, for every string in the payload, naming the key."""
    for key, value in raw.items():
        try:
            json.dumps({key: value}, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise PayloadError(
                f"payload key {key!r:.80} holds a string that is not valid Unicode "
                "(a lone surrogate escape)"
            ) from None
        except RecursionError:
            raise PayloadError(
                f"payload key {key!r:.80} nests too deeply to be a payload"
            ) from None


def _short_int(value: int) -> str:
    """``value`` for a message: huge numbers by their digit count, not their digits."""
    digits = len(str(abs(value))) if value.bit_length() < 10_000 else None
    if digits is not None and digits <= 20:
        return str(value)
    return f"an integer of {digits or 'over 3000'} digits"


_TYPE_WORDS: dict[type | UnionType, str] = {
    str: "a string", int: "an integer", bool: "true or false", int | float: "a number",
    dict: "an object of strings"}


def _check(key: str, value: object, kind: type | UnionType) -> Any:
    # A JSON boolean is a Python int: a number only where true or false is asked for.
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise PayloadError(
            f"payload key {key!r} must be {_TYPE_WORDS[kind]}, got {json_type(value)}"
        )
    return value


def _required(raw: Mapping[str, Any], key: str, kind: type) -> Any:
    if key not in raw or raw[key] is None:
        raise PayloadError(f"payload key {key!r} is required")
    return _check(key, raw[key], kind)


def _opt(raw: Mapping[str, Any], key: str, kind: type | UnionType, default: Any) -> Any:
    if raw.get(key) is None:
        return default
    return _check(key, raw[key], kind)


_Default = TypeVar("_Default", float, None)


def _opt_number(raw: Mapping[str, Any], key: str, default: _Default) -> float | _Default:
    if (value := _opt(raw, key, int | float, None)) is None:
        return default
    if (number := finite_number(value)) is None:
        raise PayloadError(f"payload key {key!r} must be finite")
    return number


def _str_list(raw: Mapping[str, Any], key: str) -> list[str]:
    if (value := raw.get(key)) is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise PayloadError(f"payload key {key!r} must be a list of strings")
    return list(value)


#: How much of a refused ``extra_pip`` entry its error message quotes.
QUOTED_ENTRY_CHARS = 80


def _extra_pip(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """``extra_pip``: packages to install, never a way to make pip read the host
    (``fsm.extras.pip.refused_extra_pip`` decides; issue 11)."""
    entries = _str_list(raw, "extra_pip")
    if (refused := refused_extra_pip(entries)) is not None:
        shown = _quoted(refused.entry, raw)
        raise PayloadError(
            f"payload key 'extra_pip' entry {refused.position} {shown} is refused: {refused.reason}"
        )
    return tuple(entries)


def _quoted(entry: str, raw: Mapping[str, Any]) -> str:
    """A payload value for a one-line message, at most QUOTED_ENTRY_CHARS: the env's secrets
    and any URL credentials are masked before it is cut (``Redactor.line``), so the cut never
    leaves a piece of a secret the runner's redactor would not recognise."""
    value = raw.get("env")
    env = {k: v for k, v in value.items() if isinstance(v, str)} if isinstance(value, dict) else {}
    redactor = Redactor()
    redactor.learn(env, env.get(LIST_KEY, "").split(","))
    return repr(_bounded(entry, redactor, QUOTED_ENTRY_CHARS))


def _env(raw: Mapping[str, Any]) -> dict[str, str]:
    value = _opt(raw, "env", dict, {})
    for k, v in value.items():
        if not isinstance(v, str):
            raise PayloadError(
                f"payload key 'env' entry {k!r} must be a string, got {json_type(v)}"
            )
        if "\x00" in k or "\x00" in v or "=" in k or not k:
            raise PayloadError(f"payload key 'env' entry {k!r:.60} is not a usable variable")
    return dict(value)
