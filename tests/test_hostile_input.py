"""Hostile input to the runner (issue 26 item 5): the payload must be a regular file of
bounded size, and what it reads from the worker's files is typed as strictly as the payload."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Layout

from fsm.payload import MAX_PAYLOAD_BYTES


def _limited() -> None:  # the runner's memory bounded, so a defect fails fast, not the host
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _run(layout: Layout, payload: Path, *command: str) -> subprocess.CompletedProcess[bytes]:
    args = [*layout.run_args()] if not command else list(command)
    if not command:
        args[args.index("--payload") + 1] = str(payload)
    return subprocess.run([sys.executable, "-m", "fsm", *args], capture_output=True,
                          timeout=30, check=False, preexec_fn=_limited)


def _one_line(done: subprocess.CompletedProcess[bytes]) -> str:
    err = done.stderr.decode()
    assert "Traceback" not in err, err[-2000:]
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory", "oversized"])
def test_a_payload_that_is_not_a_bounded_regular_file_is_one_line_and_exit_2(
    layout: Layout, tmp_path: Path, kind: str
) -> None:
    """A FIFO (which would block forever), /dev/zero (read until memory runs out), a
    directory or a huge file: exit 2 at once, one line naming what the path is."""
    path = tmp_path / "flash" / "payload.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        with open(path, "wb") as f:
            f.write(b'{"pad": "')
            f.truncate(MAX_PAYLOAD_BYTES + 10)
    expected = {"fifo": "a FIFO", "dev-zero": "a character device",
                "directory": "a directory", "oversized": "bytes, more than"}[kind]
    for done in (_run(layout, path), _run(layout, path, "validate", str(path))):
        assert done.returncode == 2, done.stderr.decode()[-2000:]
        line = _one_line(done)
        assert expected in line and "payload" in line, line
    assert layout.markers() == []


@pytest.mark.parametrize("fields", [
    '"ts": time.time(), "attempt": True',  # a bool, not the integer 1
    '"ts": 10**400, "attempt": 1',  # JSON integers have no bound; float() raises on this
], ids=["attempt-true", "ts-too-large-for-a-float"])
def test_a_heartbeat_of_the_wrong_types_says_nothing(layout: Layout, fields: str) -> None:
    """``"attempt": true`` is not attempt 1, and a ``ts`` of 10**400 is no finite number:
    the heartbeat says nothing, and the failure without completion artifacts stays the
    worker's (fatal), not the runner's internal error."""
    layout.write_worker(f"""
        beat = SCRATCH / "heartbeat.json"
        beat.write_text(json.dumps({{"stage": "train", {fields}, "retriable": True}}))
        upload(beat, "heartbeat.json")
        sys.exit(1)
    """)
    layout.write_payload(attempt=1)
    done = layout.cli(*layout.run_args())
    assert done.returncode == 1, done.stderr.decode()[-2000:]
    marker = layout.marker(attempt=1)
    assert marker is not None
    assert (marker["retriable"], marker["rule"]) == (False, "worker-failed"), marker


@pytest.mark.parametrize("key", ["max_wall_s", "deadline_at"])
def test_a_payload_number_too_large_for_a_float_is_one_line_and_a_payload_marker(
    layout: Layout, key: str
) -> None:
    """A JSON integer of 400 digits where the payload wants a number: exit 2 with one line
    naming the key, from ``validate`` and from ``run``, whose marker says payload-invalid."""
    text = json.dumps(layout.payload(**{key: 7.25}))
    layout.payload_path.write_text(text.replace("7.25", "1" + "0" * 400))
    for done in (_run(layout, layout.payload_path),
                 _run(layout, layout.payload_path, "validate", str(layout.payload_path))):
        assert done.returncode == 2, done.stderr.decode()[-2000:]
        line = _one_line(done)
        assert key in line and "finite" in line, line
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"]) == (False, "payload-invalid"), marker


def test_a_well_typed_heartbeat_of_this_attempt_still_counts(layout: Layout) -> None:
    """The strict reading keeps the contract's heartbeat: an integer attempt, retriable."""
    layout.write_worker("""
        beat = SCRATCH / "heartbeat.json"
        beat.write_text(json.dumps({"stage": "train", "ts": time.time(), "attempt": 1,
                                    "retriable": True}))
        upload(beat, "heartbeat.json")
        sys.exit(1)
    """)
    layout.write_payload(attempt=1)
    done = layout.cli(*layout.run_args())
    marker = layout.marker(attempt=1)
    assert marker is not None, done.stderr.decode()[-2000:]
    assert (marker["retriable"], marker["rule"]) == (True, "worker-heartbeat-retriable")
    assert json.loads(json.dumps(marker))["ok"] is False
