"""The marker's destination (CONTRACT section 3): usable only when ``hf_repo``,
``hf_prefix``, ``flash_arm`` and ``attempt`` are each valid *as given*.

An invalid one is never coerced to a default: the runner, as a real process, answers
with exit 2 and one line naming the key, writes no marker anywhere, and leaves the marker
an earlier attempt already published byte-for-byte as it was. A payload whose destination
is valid but which is invalid elsewhere still gets its fatal marker at exactly
``<prefix>/<arm>_attempt<N>.json``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import ARM, PREFIX, Layout

from fsm import payload
from fsm.errors import PayloadError

#: What the store held before the run: attempt 0's published marker (under the payload's
#: arm, and under the default arm a coerced ``flash_arm`` would have written).
EARLIER_MARKERS = {
    f"{ARM}_attempt0.json": b'{"ok": true, "ts": 1.0, "attempt": 0, "retriable": false, '
    b'"error": "", "run_id": "the earlier attempt"}',
    "instance_attempt0.json": b'{"ok": false, "ts": 2.0, "attempt": 0, "retriable": true, '
    b'"error": "the earlier attempt on the default arm"}',
}

LONG_DIGITS = "1" + "0" * 5000  # json.loads refuses to convert it (over 4300 digits)


def _with_raw_attempt(layout: Layout, digits: str) -> str:
    """The layout's payload as JSON text whose ``attempt`` is the integer ``digits``."""
    text = json.dumps(layout.payload(attempt=-12345))
    assert text.count('"attempt": -12345') == 1
    return text.replace('"attempt": -12345', f'"attempt": {digits}')


#: (id, payload overrides or a function of the layout giving raw text, the key named)
INVALID_DESTINATIONS: list[tuple[str, Any, str]] = [
    ("attempt-float", {"attempt": 2.0}, "attempt"),
    ("attempt-zero-float", {"attempt": 0.0}, "attempt"),
    ("attempt-string-digits", {"attempt": "2"}, "attempt"),
    ("attempt-string-word", {"attempt": "one"}, "attempt"),
    ("attempt-true", {"attempt": True}, "attempt"),
    ("attempt-false", {"attempt": False}, "attempt"),
    ("attempt-negative", {"attempt": -1}, "attempt"),
    ("attempt-over-cap", {"attempt": 1_000_001}, "attempt"),
    ("attempt-10**250", {"attempt": 10**250}, "attempt"),
    ("attempt-list", {"attempt": [0]}, "attempt"),
    ("attempt-object", {"attempt": {}}, "attempt"),
    ("attempt-5000-digits", lambda lay: _with_raw_attempt(lay, LONG_DIGITS), "attempt"),
    ("attempt-5000-digits-negative", lambda lay: _with_raw_attempt(lay, "-" + LONG_DIGITS),
     "attempt"),
    ("arm-with-space", {"flash_arm": "bad arm"}, "flash_arm"),
    ("arm-empty", {"flash_arm": ""}, "flash_arm"),
    ("arm-number", {"flash_arm": 123}, "flash_arm"),
    ("arm-bool", {"flash_arm": True}, "flash_arm"),
    ("arm-path", {"flash_arm": "../lambda"}, "flash_arm"),
    ("arm-too-long", {"flash_arm": "a" * 65}, "flash_arm"),
    # two-byte characters: 509 characters but 1,010 bytes, no folder name over 255 bytes.
    ("prefix-over-byte-limit", {"hf_prefix": "sft/" + "/".join(["\u00e9" * 100] * 5) + "\u00e9"},
     "hf_prefix"),
    ("prefix-over-char-limit", {"hf_prefix": "/".join(["a" * 200] * 6)}, "hf_prefix"),
    ("prefix-part-over-255-bytes", {"hf_prefix": "sft/" + "\u00e9" * 128}, "hf_prefix"),
    ("prefix-empty-part", {"hf_prefix": "sft//seed3"}, "hf_prefix"),
    ("prefix-dot-part", {"hf_prefix": "sft/./seed3"}, "hf_prefix"),
    ("prefix-dotdot-part", {"hf_prefix": "sft/../seed3"}, "hf_prefix"),
    ("prefix-absolute", {"hf_prefix": "/sft/seed3"}, "hf_prefix"),
    ("prefix-backslash", {"hf_prefix": "sft\\seed3"}, "hf_prefix"),
    ("prefix-nul", {"hf_prefix": "sft/se\x00ed3"}, "hf_prefix"),
    ("prefix-newline", {"hf_prefix": "sft/seed3\n"}, "hf_prefix"),
    ("prefix-c1-control", {"hf_prefix": "sft/seed\x853"}, "hf_prefix"),
    ("prefix-git-folder", {"hf_prefix": "sft/.git/seed3"}, "hf_prefix"),
    ("prefix-only-slashes", {"hf_prefix": "//"}, "hf_prefix"),
    ("prefix-number", {"hf_prefix": 3}, "hf_prefix"),
    ("prefix-missing", {"hf_prefix": None}, "hf_prefix"),
    ("repo-without-org", {"hf_repo": "flash-runs"}, "hf_repo"),
    ("repo-number", {"hf_repo": 7}, "hf_repo"),
]


def _content(layout: Layout, case: Any) -> str:
    if callable(case):
        return str(case(layout))
    return json.dumps(layout.payload(**case))


def _store_files(layout: Layout) -> dict[Path, bytes]:
    return {
        path.relative_to(layout.store): path.read_bytes()
        for path in layout.store.rglob("*")
        if path.is_file()
    }


def _publish_earlier_markers(layout: Layout) -> dict[Path, bytes]:
    for name, data in EARLIER_MARKERS.items():
        path = layout.artifact(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return _store_files(layout)


def _assert_one_line_naming(proc: subprocess.CompletedProcess[bytes], key: str) -> None:
    stderr = proc.stderr.decode("utf-8", "replace")
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert lines, "no reason on stderr"
    last = lines[-1]
    assert last.startswith("flash-bootstrap: payload unusable: "), last
    assert f"'{key}'" in last, (key, last)


@pytest.mark.parametrize(
    ("case", "key"),
    [pytest.param(case, key, id=name) for name, case, key in INVALID_DESTINATIONS],
)
def test_an_invalid_destination_key_exits_2_naming_it_and_writes_no_marker_anywhere(
    layout: Layout, case: Any, key: str
) -> None:
    """Never a marker at a path built from a default: attempt 0's stays byte-for-byte."""
    layout.write_worker("complete()")
    before = _publish_earlier_markers(layout)
    layout.write_payload(_content(layout, case))
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 2, proc.stderr.decode("utf-8", "replace")[-2000:]
    _assert_one_line_naming(proc, key)
    assert _store_files(layout) == before, "the store changed: a marker was written"
    # Nor is a result persisted next to the payload for a later run to replay.
    assert [p.name for p in layout.payload_path.parent.iterdir()] == ["payload.json"]


@pytest.mark.parametrize(
    ("case", "key"),
    [pytest.param(case, key, id=name) for name, case, key in INVALID_DESTINATIONS],
)
def test_validate_rejects_an_invalid_destination_key_with_exit_2_and_one_line(
    layout: Layout, case: Any, key: str
) -> None:
    layout.write_payload(_content(layout, case))
    proc = layout.cli("validate", str(layout.payload_path))
    assert proc.returncode == 2, proc.stdout.decode()
    assert proc.stdout == b""
    _assert_one_line_naming(proc, key)


@pytest.mark.parametrize(
    ("case", "key"),
    [pytest.param(case, key, id=name) for name, case, key in INVALID_DESTINATIONS],
)
def test_destination_and_parse_give_the_same_verdict_on_an_invalid_destination_key(
    layout: Layout, case: Any, key: str
) -> None:
    layout.write_payload(_content(layout, case))
    if callable(case):  # too long to decode: refused by read_raw, one line naming the key
        with pytest.raises(PayloadError, match=f"^payload key '{key}' [^\n]*$"):
            payload.read_raw(layout.payload_path)
        return
    raw = payload.read_raw(layout.payload_path)
    assert payload.destination(raw) is None
    with pytest.raises(PayloadError, match=f"'{key}'") as caught:
        payload.parse(raw)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "arm", "attempt", "prefix"),
    [
        pytest.param({}, ARM, 0, PREFIX, id="as-given"),
        pytest.param({"attempt": 7}, ARM, 7, PREFIX, id="attempt-7"),
        pytest.param({"attempt": 1_000_000}, ARM, 1_000_000, PREFIX, id="attempt-at-cap"),
        pytest.param({"attempt": None}, ARM, 0, PREFIX, id="attempt-null-is-0"),
        pytest.param({"flash_arm": None}, "instance", 0, PREFIX, id="arm-null-is-instance"),
        pytest.param({"hf_prefix": PREFIX + "/"}, ARM, 0, PREFIX, id="prefix-trailing-slash"),
        pytest.param({"hf_prefix": "sft/" + "\u00e9" * 127}, ARM, 0, "sft/" + "\u00e9" * 127,
                     id="prefix-part-of-254-bytes"),
    ],
)
def test_a_valid_destination_with_a_bad_seed_gets_its_fatal_marker_at_exactly_its_path(
    layout: Layout, overrides: dict[str, Any], arm: str, attempt: int, prefix: str
) -> None:
    layout.write_payload(seed="x", **overrides)
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 2, proc.stderr.decode("utf-8", "replace")[-2000:]
    _assert_one_line_naming(proc, "seed")
    expected = layout.store / prefix / f"{arm}_attempt{attempt}.json"
    markers = sorted(layout.store.rglob("*_attempt*.json"))
    assert markers == [expected]
    marker = json.loads(expected.read_text())
    assert marker["attempt"] == attempt
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, False, "payload-invalid")


def test_a_valid_destination_without_arm_and_attempt_keys_uses_their_defaults(
    layout: Layout,
) -> None:
    raw = layout.payload()
    del raw["flash_arm"], raw["attempt"]
    dest = payload.destination(raw)
    assert dest is not None
    assert (dest.arm, dest.attempt, dest.marker_name) == ("instance", 0, "instance_attempt0.json")
    assert payload.parse(raw).dest == dest


def test_an_invalid_env_does_not_hide_a_valid_destination(layout: Layout) -> None:
    """The rest of the payload never decides the destination (the fatal marker needs it)."""
    raw = layout.payload(env={"A": 1}, attempt=4)
    dest = payload.destination(raw)
    assert dest is not None and (dest.arm, dest.attempt) == (ARM, 4)
    with pytest.raises(PayloadError, match="'env'"):
        payload.parse(raw)


def test_a_huge_integer_elsewhere_is_one_line_naming_its_key_without_a_traceback(
    layout: Layout,
) -> None:
    text = json.dumps(layout.payload(seed=-12345)).replace("-12345", LONG_DIGITS)
    layout.write_payload(text)
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 2
    _assert_one_line_naming(proc, "seed")
