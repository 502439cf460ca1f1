"""Generated bad payloads: wrong types, missing keys, huge strings, non-UTF-8 bytes,
path-like names, negative attempts. Every one ends with exit 2 (or a fatal marker when it
got further) and one clear line: never a traceback, never a retry, never a file outside
the run's directories."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
from conftest import ARM, Layout
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm import payload
from fsm.attempt.runner import run_attempt
from fsm.errors import PayloadError
from fsm.output import log

MISSING = object()  # a mutation that deletes the key

JSON_SCALARS = (
    st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
    | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    st.none() | JSON_SCALARS,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)

HUGE = st.integers(70, 300_000).map(lambda n: "a" * n)
PATHLIKE = st.sampled_from([
    "../x", "../../../tmp/escape", "/etc/passwd", "a/b", ".", "..", "a/../../b", "~", "./x",
    "a\\b", "a\x00b", "C:\\x", "x/", "/", "", " ", "-rf", ".hidden", "con:", "\ud800",
])


_BY_TYPE: dict[str, st.SearchStrategy[Any]] = {
    "int": st.integers(-(2**70), 2**70),
    "float": st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: f != int(f)),
    "bool": st.booleans(),
    "str": st.text(max_size=12),
    "list": st.lists(JSON_SCALARS, max_size=3),
    "dict": st.dictionaries(st.text(max_size=6), JSON_SCALARS, max_size=3),
}


def _wrong_type(*right: str) -> st.SearchStrategy[Any]:
    """A JSON value of any type but ``right`` (null is "absent" for optional keys)."""
    return st.one_of(*(s for name, s in _BY_TYPE.items() if name not in right))


#: Bad values per key: each one alone makes the payload unusable (or fatal later).
BAD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "hf_repo": _wrong_type("str") | HUGE | st.sampled_from(
        ["noslash", "a/b/c", "/a", "../x", "a/..", "./a", "a/b/", "a\x00/b", "", "org/\ud800"]
    ),
    "hf_prefix": _wrong_type("str") | st.integers(1001, 300_000).map(lambda n: "a" * n)
    | st.integers(256, 1000).map(lambda n: "sft/" + "a" * n)
    | st.sampled_from(["../x", "../../../tmp/escape", "/etc/passwd", ".", "..", "a/../../b",
                       "./x", "a\\b", "a\x00b", "/", "", "a//b", "a/./b", "a/\x07", "a/.git/b",
                       "sft/" + "\u00e9" * 128, "/".join(["\u00e9" * 100] * 6)]),
    "phase": _wrong_type("str") | PATHLIKE | HUGE | st.just("sft/../../x"),
    "seed": _wrong_type("int") | st.floats(allow_nan=False, allow_infinity=False),
    "flash_arm": _wrong_type("str") | PATHLIKE | HUGE | st.sampled_from(["bad arm", "a" * 65]),
    "attempt": _wrong_type("int") | st.integers(max_value=-1)
    | st.integers(1_000_001, 10**300) | st.integers(-3, 3).map(float),
    "job_spec_json": _wrong_type("str"),
    "job_spec_in_hf": _wrong_type("bool"),
    "env": _wrong_type("dict") | st.sampled_from([
        {"K": 1}, {"A=B": "x"}, {"": "x"}, {"K": "a\x00b"}, {"X_TOKEN": ["t"]}, {"K": None},
        {"PLAIN": "\ud800 not encodable"}, {"HF_TOKEN": "\ud800abcd"},
    ]),
    "extra_pip": _wrong_type("list") | st.sampled_from([[1], [None], [["x"]], "pkg"]),
    "max_wall_s": st.sampled_from([0, -1, -1e9, "60", True, [60]]) | _wrong_type("int", "float"),
    "deadline_at": st.sampled_from(["soon", True, [1]]) | _wrong_type("int", "float"),
    "run_id": _wrong_type("str"),
    "mode": _wrong_type("str") | PATHLIKE | st.sampled_from(["Train", "PRELOAD", "warm"]),
    "cache_block_device": _wrong_type("bool"),
}
REQUIRED = ("hf_repo", "hf_prefix", "phase", "seed")

#: Whole files that are not a usable payload.
RAW_FILES = st.one_of(
    st.binary(max_size=200),
    st.binary(min_size=1, max_size=4).map(lambda b: b'{"hf_repo": "' + b + b'\xff"}'),
    st.just(b"\xef\xbb\xbf{}"),  # a UTF-8 byte-order mark
    JSON_VALUES.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
    st.integers(2, 100).map(lambda n: b"[" * n + b"]" * n),  # nested (deeper: see the end)
    st.sampled_from([b"", b"{", b"NaN", b'{"a": 1} trailing', b"\x00" * 10]),
)


@dataclass(frozen=True)
class BadInput:
    content: bytes
    why: str


@st.composite
def bad_payloads(draw: st.DrawFn, layout_payload: dict[str, Any]) -> BadInput:
    if draw(st.integers(0, 4)) == 0:
        raw = draw(RAW_FILES)
        return BadInput(raw, f"raw file {raw[:40]!r}")
    data = dict(layout_payload)
    if draw(st.booleans()):
        data["mode"] = "preload"
        data["models"] = draw(
            st.sampled_from([["org/m"], [], "org/m", ["../../x"], [1], None])
        )
        data["cache_mount_marker"] = draw(st.none() | PATHLIKE)
    mutations = draw(st.lists(st.sampled_from(sorted(BAD_VALUES)), min_size=1, max_size=3,
                              unique=True))
    for key in mutations:
        if key in REQUIRED and draw(st.integers(0, 3)) == 0:
            data[key] = MISSING
        else:
            data[key] = draw(BAD_VALUES[key])
    data = {k: v for k, v in data.items() if v is not MISSING}
    return BadInput(json.dumps(data).encode(), f"mutated {mutations}")


# --- running one ------------------------------------------------------------------------------


@contextmanager
def isolated_redaction() -> Iterator[io.StringIO]:
    """Route the real log chain to a buffer (each attempt attaches its own redactor to
    it); structlog's configuration is restored after."""
    saved = structlog.get_config()
    buffer = io.StringIO()
    log.configure(buffer, json=True)
    try:
        yield buffer
    finally:
        structlog.configure(**saved)


@contextmanager
def world() -> Iterator[tuple[Path, Layout]]:
    """A fresh temporary directory holding one run's layout (under ``w/``) and nothing else."""
    with tempfile.TemporaryDirectory(prefix="flash-bad-") as tmp:
        base = Path(tmp)
        layout = Layout(base / "w")
        for sub in ("store", "scratch", "runcode", "flash"):
            (layout.root / sub).mkdir(parents=True)
        layout.write_worker("complete()")
        yield base, layout


def _files(base: Path) -> set[Path]:
    return {p for p in base.rglob("*") if not p.is_dir()}


def _check_files_stay_in_their_places(
    base: Path, layout: Layout, before: set[Path], raw: dict[str, Any] | None
) -> None:
    dest = payload.destination(raw) if raw is not None else None
    allowed = [layout.scratch, layout.code_root]
    if dest is not None:
        allowed.append(layout.store / dest.hf_prefix)
    for path in _files(base) - before:
        if path.parent == layout.payload_path.parent and path.name.startswith(".flash-"):
            continue  # the attempt's lock and persisted result live next to the payload
        assert any(path.is_relative_to(root) for root in allowed), f"wrote {path}"


def _raw(content: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(content.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _check_one_clear_line(line: str) -> None:
    assert line.strip(), "an empty reason"
    assert "\n" not in line.strip()
    assert "Traceback" not in line


def _check_markers(layout: Layout, raw: dict[str, Any] | None, code: int) -> None:
    markers = sorted(layout.store.rglob("*_attempt*.json"))
    dest = payload.destination(raw) if raw is not None else None
    if dest is None:
        assert markers == [], "no destination, no marker"
        assert code == 2, "a payload without a usable destination is unusable"
        return
    assert len(markers) == 1
    marker = json.loads(markers[0].read_text())
    assert marker["ok"] is False and marker["retriable"] is False, marker
    assert (code == 2) == (marker["rule"] == "payload-invalid"), (code, marker["rule"])


@settings(max_examples=settings().max_examples * 2)
@given(st.data())
def test_a_bad_payload_ends_with_exit_2_or_a_fatal_marker_and_one_clear_line(
    data: st.DataObject,
) -> None:
    with world() as (base, layout):
        bad = data.draw(bad_payloads(layout.payload()), label="payload")
        layout.write_payload(bad.content)
        before = _files(base)
        hard_exits: list[int] = []
        with isolated_redaction() as logs, open(base / "stdout.bin", "ab") as out:
            outcome = run_attempt(
                layout.settings(),
                {k: v for k, v in os.environ.items() if not k.startswith("FLASH_")},
                out_fd=out.fileno(),
                handle_signals=False,
                hard_exit=hard_exits.append,
            )
        assert hard_exits == []
        assert outcome.exit_code in (1, 2, 75, 124), (bad.why, outcome.reason)
        _check_one_clear_line(outcome.reason)
        assert "Traceback" not in logs.getvalue()
        raw = _raw(bad.content)
        _check_markers(layout, raw, outcome.exit_code)
        _check_files_stay_in_their_places(base, layout, before | {base / "stdout.bin"}, raw)


CLI_EXAMPLES = max(3, settings().max_examples // 8)


@settings(max_examples=CLI_EXAMPLES)
@given(st.data())
def test_the_cli_answers_a_bad_payload_with_one_clear_last_line_and_no_traceback(
    data: st.DataObject,
) -> None:
    with world() as (base, layout):
        bad = data.draw(bad_payloads(layout.payload()), label="payload")
        layout.write_payload(bad.content)
        before = _files(base)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLASH_")}
        proc = subprocess.run(
            [sys.executable, "-m", "fsm", *layout.run_args()],
            env=env, capture_output=True, timeout=60, check=False, cwd=base,
        )
        stderr = proc.stderr.decode("utf-8", "replace")
        assert "Traceback" not in stderr, stderr[-3000:]
        assert proc.returncode in (1, 2, 75, 124), (bad.why, stderr[-2000:])
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("flash-bootstrap: "), last
        _check_one_clear_line(last)
        raw = _raw(bad.content)
        _check_markers(layout, raw, proc.returncode)
        _check_files_stay_in_their_places(base, layout, before, raw)


# --- what the properties found -----------------------------------------------------------------


def _run_in_process(content: bytes) -> tuple[int, str, list[Path]]:
    with world() as (base, layout):
        layout.write_payload(content)
        with isolated_redaction(), open(base / "stdout.bin", "ab") as out:
            outcome = run_attempt(layout.settings(), dict(os.environ), out_fd=out.fileno(),
                                  handle_signals=False, hard_exit=lambda _code: None)
        return outcome.exit_code, outcome.reason, sorted(layout.store.rglob("*_attempt*.json"))


def test_a_deeply_nested_payload_is_unusable_with_exit_2() -> None:
    code, reason, _ = _run_in_process(b"[" * 100_000 + b"]" * 100_000)
    assert code == 2
    assert reason.startswith("payload unusable")


def test_a_secret_env_value_that_cannot_be_encoded_is_unusable_with_exit_2_and_a_marker() -> None:
    layout_payload = Layout(Path("/nonexistent")).payload(env={"HF_TOKEN": "\ud800abcd"})
    code, reason, markers = _run_in_process(json.dumps(layout_payload).encode())
    assert code == 2, reason
    assert len(markers) == 1


def test_a_prefix_folder_name_longer_than_a_file_name_is_unusable() -> None:
    raw = Layout(Path("/nonexistent")).payload(hf_prefix="sft/" + "a" * 300)
    with pytest.raises(PayloadError):
        payload.parse(raw)


# --- invalid in exactly one destination key ----------------------------------------------------

#: A valid folder name (so only the planted defect makes a prefix invalid).
_PART = st.text(alphabet="abcXYZ019-_\u00e9\u4e2d", min_size=1, max_size=10)
_PARTS = st.lists(_PART, min_size=1, max_size=4)
_BAD_CHARS = st.sampled_from(["\\", "\x00", "\n", "\t", "\x1b", "\x7f", "\x85", "\ud800"])


@st.composite
def _bad_prefix(draw: st.DrawFn) -> Any:
    parts = draw(_PARTS)
    at = draw(st.integers(0, len(parts)))
    kind = draw(st.sampled_from(
        ["type", "part", "char", "absolute", "long-part", "long-total"]
    ))
    if kind == "type":
        return draw(_wrong_type("str"))
    if kind == "part":
        bad = draw(st.sampled_from(["", ".", "..", ".git", ".cache"]))
        if bad == "":  # between two names: an empty name at either end is a '/' there
            parts.append("z")
            at = draw(st.integers(1, len(parts) - 1))
        parts.insert(at, bad)
        return "/".join(parts)
    if kind == "char":
        part = parts[at % len(parts)]
        cut = draw(st.integers(0, len(part)))
        parts[at % len(parts)] = part[:cut] + draw(_BAD_CHARS) + part[cut:]
        return "/".join(parts)
    if kind == "absolute":
        return "/" + "/".join(parts)
    if kind == "long-part":  # over 255 bytes as UTF-8, maybe under 255 characters
        parts.insert(at, draw(st.sampled_from(["a", "\u00e9", "\u4e2d"])) * draw(
            st.integers(128, 400)))
        part = parts[at]
        if len(part.encode()) <= 255:
            parts[at] = part * 2
        return "/".join(parts)
    # long-total: folder names within 255 bytes, the whole over 1,000 bytes
    return "/".join(parts + ["\u4e2d" * 80] * draw(st.integers(5, 12)))


_BAD_ARM = (
    _wrong_type("str")
    | st.sampled_from(["", "bad arm", "a/b", "../lambda", "-lead", ".hidden", "\u00e9", "a" * 65])
    | st.tuples(st.text(alphabet="ab01._-", max_size=20), _BAD_CHARS | st.just(" ")).map(
        lambda t: "a" + t[0] + t[1])
)
_BAD_REPO = _wrong_type("str") | st.sampled_from(
    ["noslash", "a/b/c", "/a", "../x", "a/..", "./a", "a/b/", "", "org/\ud800", "org/" + "a" * 200]
)
#: ``attempt``: any JSON value but an integer in [0, 1_000_000]; a str is digits text to
#: splice in raw (an integer too long for json.loads to convert).
_BAD_ATTEMPT = (
    _wrong_type("int")
    | st.integers(-3, 3).map(float)
    | st.sampled_from(["0", "2", "one", "1e3"])
    | st.integers(max_value=-1)
    | st.integers(1_000_001, 10**400)
)
_RAW_DIGITS = st.integers(4_301, 9_000).map(lambda n: "1" + "0" * (n - 1))


@dataclass(frozen=True)
class OneBadKey:
    key: str
    text: str  # the payload file's JSON text


@st.composite
def one_bad_destination_key(draw: st.DrawFn, good: dict[str, Any]) -> OneBadKey:
    key = draw(st.sampled_from(["hf_repo", "hf_prefix", "flash_arm", "attempt"]))
    data = dict(good)
    if key == "attempt" and draw(st.integers(0, 4)) == 0:
        data["attempt"] = -424242
        text = json.dumps(data).replace("-424242", draw(_RAW_DIGITS))
        return OneBadKey(key, text)
    strategy = {
        "hf_repo": _BAD_REPO, "hf_prefix": _bad_prefix(), "flash_arm": _BAD_ARM,
        "attempt": _BAD_ATTEMPT,
    }[key]
    data[key] = draw(strategy)
    return OneBadKey(key, json.dumps(data))


@settings(max_examples=max(5, settings().max_examples // 2))
@given(st.data())
def test_a_payload_invalid_in_one_destination_key_exits_2_and_writes_no_marker(
    data: st.DataObject,
) -> None:
    """Run as a process over a store holding attempt 0's marker: exit 2, one line naming
    the key, the store byte-for-byte unchanged; and ``validate`` says the same."""
    with world() as (base, layout):
        bad = data.draw(one_bad_destination_key(layout.payload()), label="payload")
        layout.write_payload(bad.text)
        for name in (f"{ARM}_attempt0.json", "instance_attempt0.json"):
            layout.artifact(name).parent.mkdir(parents=True, exist_ok=True)
            layout.artifact(name).write_text(json.dumps({"ok": True, "attempt": 0, "by": name}))
        store_before = {p: p.read_bytes() for p in layout.store.rglob("*") if p.is_file()}
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLASH_")}
        for args in (layout.run_args(), ["validate", str(layout.payload_path)]):
            proc = subprocess.run(
                [sys.executable, "-m", "fsm", *args],
                env=env, capture_output=True, timeout=60, check=False, cwd=base,
            )
            stderr = proc.stderr.decode("utf-8", "replace")
            assert "Traceback" not in stderr, stderr[-3000:]
            assert proc.returncode == 2, (args[0], bad.key, stderr[-2000:])
            last = stderr.strip().splitlines()[-1]
            _check_one_clear_line(last)
            assert last.startswith("flash-bootstrap: payload unusable: "), last
            assert f"'{bad.key}'" in last, (bad.key, last)
            store_after = {p: p.read_bytes() for p in layout.store.rglob("*") if p.is_file()}
            assert store_after == store_before, f"{args[0]} wrote to the store"
