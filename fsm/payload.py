"""The payload (CONTRACT section 3): parsed once, validated strictly, typed.

Every violation is one ``PayloadError`` whose message names the key and the problem.
Unknown keys are ignored for forward compatibility.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsm.errors import PayloadError

PHASE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ARM_RE = PHASE_RE
REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
DEFAULT_MAX_WALL_S = 86_400.0
MODES = ("train", "preload")


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
        return f"{self.arm}_attempt{self.attempt}.json"

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


def read_raw(path: Path) -> dict[str, Any]:
    """The payload file as a JSON object, or a PayloadError naming what is wrong."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PayloadError(f"payload file {path} does not exist") from None
    except OSError as exc:
        raise PayloadError(f"payload file {path} is unreadable: {exc.strerror or exc}") from None
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise PayloadError(f"payload file {path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise PayloadError(
            f"payload file {path} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise PayloadError(f"payload file {path} nests too deeply to be a payload") from None

    if not isinstance(raw, dict):
        raise PayloadError(f"payload must be a JSON object, got {_json_type(raw)}")
    return raw


def destination(raw: Mapping[str, Any]) -> Destination | None:
    """The marker's destination if ``hf_repo`` and ``hf_prefix`` are usable, else None.

    Lenient on purpose: a payload invalid elsewhere still gets its fatal marker.
    """
    try:
        return _destination(raw)
    except PayloadError:
        repo, prefix = raw.get("hf_repo"), raw.get("hf_prefix")
        if not (_valid_repo(repo) and _valid_prefix(prefix)):
            return None
        arm = raw.get("flash_arm")
        attempt = raw.get("attempt")
        env = raw.get("env")
        token = env.get("HF_TOKEN") if isinstance(env, dict) else None
        return Destination(
            hf_repo=str(repo),
            hf_prefix=str(prefix).strip("/"),
            arm=arm if isinstance(arm, str) and ARM_RE.fullmatch(arm) else "instance",
            attempt=attempt
            if isinstance(attempt, int) and _is_int(attempt) and attempt >= 0
            else 0,
            token=token if isinstance(token, str) and token else None,
        )


def parse(raw: Mapping[str, Any]) -> Payload:
    """Validate ``raw`` against the contract; raise PayloadError naming the first problem."""
    dest = _destination(raw)
    try:
        # JSON escapes can spell lone surrogates, which no file name, environment or
        # upload can carry: refuse them once, for every string in the payload.
        json.dumps(raw, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise PayloadError(
            "payload holds a string that is not valid Unicode (a lone surrogate escape)"
        ) from None
    mode = _opt(raw, "mode", str, "train")
    if mode not in MODES:
        raise PayloadError(f"payload key 'mode' must be one of {', '.join(MODES)}, got {mode!r}")
    max_wall_s = _opt_number(raw, "max_wall_s", DEFAULT_MAX_WALL_S)
    if max_wall_s <= 0:
        raise PayloadError(f"payload key 'max_wall_s' must be > 0, got {max_wall_s}")
    deadline_at = raw.get("deadline_at")
    if deadline_at is not None:
        deadline_at = _opt_number(raw, "deadline_at", 0.0)
    env = _env(raw)
    common: dict[str, Any] = {
        "dest": dest,
        "mode": mode,
        "env": env,
        "max_wall_s": max_wall_s,
        "deadline_at": deadline_at,
        "run_id": _opt(raw, "run_id", str, None),
        "cache_mount_marker": _opt(raw, "cache_mount_marker", str, None) or None,
        "cache_block_device": _opt(raw, "cache_block_device", bool, False),
    }
    if mode == "preload":
        models = _str_list(raw, "models")
        if not models:
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
    phase = _required(raw, "phase", str)
    if not PHASE_RE.fullmatch(phase):
        raise PayloadError(
            f"payload key 'phase' must match {PHASE_RE.pattern} (it names files), got {phase!r:.80}"
        )
    seed = _required(raw, "seed", int)
    spec = _opt(raw, "job_spec_json", str, None)
    return Payload(
        phase=phase,
        seed=seed,
        job_spec_json=spec,
        job_spec_in_hf=_opt(raw, "job_spec_in_hf", bool, False),
        extra_pip=tuple(_str_list(raw, "extra_pip")),
        **common,
    )


def load(path: Path) -> Payload:
    return parse(read_raw(path))


# --- helpers --------------------------------------------------------------------------


def _destination(raw: Mapping[str, Any]) -> Destination:
    repo = _required(raw, "hf_repo", str)
    if not _valid_repo(repo):
        raise PayloadError(f"payload key 'hf_repo' must look like 'org/name', got {repo!r:.80}")
    prefix = _required(raw, "hf_prefix", str)
    if not _valid_prefix(prefix):
        raise PayloadError(
            "payload key 'hf_prefix' must be a relative repo folder without '..', "
            f"got {prefix!r:.80}"
        )
    arm = _opt(raw, "flash_arm", str, "instance")
    if not ARM_RE.fullmatch(arm):
        raise PayloadError(
            f"payload key 'flash_arm' must match {ARM_RE.pattern} (it names the marker), "
            f"got {arm!r:.80}"
        )
    attempt = _opt(raw, "attempt", int, 0)
    if attempt < 0:
        raise PayloadError(f"payload key 'attempt' must be >= 0, got {attempt}")
    token = _env(raw).get("HF_TOKEN") or None
    return Destination(
        hf_repo=repo, hf_prefix=prefix.strip("/"), arm=arm, attempt=attempt, token=token
    )


def _valid_repo(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 200 and bool(REPO_RE.fullmatch(value))


def _valid_prefix(value: object) -> bool:
    if not isinstance(value, str) or not value.strip("/") or len(value) > 1000:
        return False
    if value.startswith("/") or "\\" in value or "\x00" in value:
        return False
    try:
        parts = [part.encode("utf-8") for part in value.strip("/").split("/")]
    except UnicodeEncodeError:
        return False
    return all(part not in (b"", b".", b"..") and len(part) <= 255 for part in parts)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: object) -> str:
    names = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


_TYPE_WORDS = {str: "a string", int: "an integer", bool: "true or false"}


def _check(key: str, value: object, kind: type) -> Any:
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise PayloadError(
            f"payload key {key!r} must be {_TYPE_WORDS[kind]}, got {_json_type(value)}"
        )
    return value


def _required(raw: Mapping[str, Any], key: str, kind: type) -> Any:
    if key not in raw or raw[key] is None:
        raise PayloadError(f"payload key {key!r} is required")
    return _check(key, raw[key], kind)


def _opt(raw: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    if raw.get(key) is None:
        return default
    return _check(key, raw[key], kind)


def _opt_number(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PayloadError(f"payload key {key!r} must be a number, got {_json_type(value)}")
    if not math.isfinite(value):
        raise PayloadError(f"payload key {key!r} must be finite")
    return float(value)


def _str_list(raw: Mapping[str, Any], key: str) -> list[str]:
    value = raw.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise PayloadError(f"payload key {key!r} must be a list of strings")
    return list(value)


def _env(raw: Mapping[str, Any]) -> dict[str, str]:
    value = raw.get("env")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PayloadError(
            f"payload key 'env' must be an object of strings, got {_json_type(value)}"
        )
    for k, v in value.items():
        if not isinstance(v, str):
            raise PayloadError(
                f"payload key 'env' entry {k!r} must be a string, got {_json_type(v)}"
            )
        if "\x00" in k or "\x00" in v or "=" in k or not k:
            raise PayloadError(f"payload key 'env' entry {k!r:.60} is not a usable variable")
    return dict(value)
