"""The runner's own output can never cost the marker (issue 22, item 1): a stderr or stdout
whose reader is gone, one nobody reads, and descriptors closed at start, at every moment of
the attempt, through the real runner process. Each ends with the right marker and an exit
status that says whether it was published; what could not be written is counted in the
marker's ``output`` evidence."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pytest
from conftest import Layout, read_until

from fsm.output.outlet import Outlet, OutletStream

#: A worker that completes (metrics.json, then DONE) and says so on its stdout.
COMPLETES = "print('training', flush=True)\ncomplete()\n"
#: A worker that announces itself, then waits for the test's "go" before it completes.
WAITS_THEN_COMPLETES = """
print("ready", flush=True)
while not (SCRATCH / "go").exists():
    time.sleep(0.02)
complete()
"""
#: A worker that completes first, then waits for the test's "go" before it exits.
COMPLETES_THEN_WAITS = """
complete()
print("ready", flush=True)
while not (SCRATCH / "go").exists():
    time.sleep(0.02)
"""
HANGS = "print('ready', flush=True)\ntime.sleep(600)\n"


def _argv(layout: Layout) -> list[str]:
    return [sys.executable, "-m", "fsm", *layout.run_args()]


@contextmanager
def _pipe(room: int | None = None) -> Iterator[tuple[int, int]]:
    """A pipe whose buffer is full but for ``room`` bytes (None: empty). The write end is
    left blocking, as a stream handed to a process is."""
    r, w = os.pipe()
    try:
        if room is not None:
            flags = fcntl.fcntl(w, fcntl.F_GETFL)
            fcntl.fcntl(w, fcntl.F_SETFL, flags | os.O_NONBLOCK)
            size = fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)
            filled = 0
            try:
                while filled < size - room:
                    filled += os.write(w, b"x" * min(4096, size - room - filled))
            except BlockingIOError:
                pass
            fcntl.fcntl(w, fcntl.F_SETFL, flags)
        yield r, w
    finally:
        for fd in (r, w):
            with suppress(OSError):
                os.close(fd)


def _marker(layout: Layout) -> dict[str, Any]:
    marker = layout.marker()
    assert marker is not None, "no marker was published"
    return marker


def _wait(proc: subprocess.Popen[bytes], timeout: float = 60) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the runner did not end within {timeout}s")


def test_stderr_whose_reader_is_gone_from_the_start_still_gets_the_marker(layout: Layout) -> None:
    """A dead log shipper before the first line: the attempt runs, its marker lands, exit 0,
    and the marker counts the log lines that were lost."""
    layout.write_worker(COMPLETES)
    layout.write_payload()
    with _pipe() as (r, w):
        os.close(r)
        proc = subprocess.Popen(_argv(layout), stdout=subprocess.DEVNULL, stderr=w)
        os.close(w)
        assert _wait(proc) == 0
    marker = _marker(layout)
    assert marker["ok"] is True
    assert marker["output"]["stderr"]["error"] == "EPIPE"
    assert marker["output"]["stderr"]["dropped_lines"] > 0


@pytest.mark.parametrize("body", [WAITS_THEN_COMPLETES, COMPLETES_THEN_WAITS],
                         ids=["while-the-worker-runs", "after-the-worker-completed"])
def test_stderr_whose_reader_goes_away_mid_run_still_gets_the_marker(
    layout: Layout, body: str
) -> None:
    """The log's reader dies while the worker runs, or after it uploaded DONE: the marker
    is still the worker's success, and the exit status says it was published."""
    layout.write_worker(body)
    layout.write_payload()
    proc = subprocess.Popen(_argv(layout), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    read_until(proc.stdout, b"ready")
    assert proc.stderr is not None
    proc.stderr.close()  # the log's reader is gone: the next line meets EPIPE
    (layout.scratch / "go").write_text("")
    assert _wait(proc) == 0
    marker = _marker(layout)
    assert marker["ok"] is True
    assert marker["output"]["stderr"]["error"] == "EPIPE"


@pytest.mark.parametrize("room", [0, 2048], ids=["full-from-the-start", "fills-mid-run"])
def test_a_stderr_nobody_reads_never_blocks_the_attempt(layout: Layout, room: int) -> None:
    """Docker's blocking log mode with its collector down: a full stderr pipe blocks no log
    call; the attempt ends with its marker and exit 0, the lost lines counted."""
    layout.write_worker(COMPLETES)
    layout.write_payload()
    with _pipe(room) as (_r, w):
        proc = subprocess.Popen(_argv(layout), stdout=subprocess.DEVNULL, stderr=w)
        assert _wait(proc) == 0
    marker = _marker(layout)
    assert marker["ok"] is True
    stuck = marker["output"]["stderr"]
    assert stuck["stuck_s"] > 0 and stuck["pending_bytes"] > 0
    assert "error" not in stuck  # not broken: its reader stopped reading


def test_a_stuck_stderr_does_not_keep_the_deadline_from_ending_the_attempt(
    layout: Layout,
) -> None:
    """With stderr full, a worker that runs past the deadline is still stopped, the
    deadline marker published and the process gone with 124."""
    layout.write_worker(HANGS)
    layout.write_payload(max_wall_s=4)
    with _pipe(0) as (_r, w):
        proc = subprocess.Popen(_argv(layout), stdout=subprocess.DEVNULL, stderr=w)
        assert _wait(proc, 40) == 124
    marker = _marker(layout)
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, False, "deadline")


def test_a_stuck_stderr_does_not_keep_sigterm_from_ending_the_attempt(layout: Layout) -> None:
    """With stderr full, SIGTERM still stops the worker, publishes the retriable marker and
    ends the process within Docker's stop timeout."""
    layout.write_worker(HANGS)
    layout.write_payload()
    with _pipe(0) as (_r, w):
        proc = subprocess.Popen(_argv(layout), stdout=subprocess.PIPE, stderr=w)
        read_until(proc.stdout, b"ready")
        proc.send_signal(signal.SIGTERM)
        assert _wait(proc, 10) == 75
    marker = _marker(layout)
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, True, "interrupted")


def test_a_stdout_nobody_reads_never_blocks_the_worker(layout: Layout) -> None:
    """The worker's console passed on to a stdout nobody reads: the worker is not held up
    by it (the console file keeps every byte), and the marker counts the bytes stdout lost."""
    layout.write_worker("""
        chunk = b"y" * 65536 + b"\\n"
        for _ in range(160):  # 10 MiB: more than the pipe and the runner's buffer hold
            sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        complete()
    """)
    layout.write_payload(max_wall_s=60)
    with _pipe(0) as (_r, w):
        proc = subprocess.Popen(_argv(layout), stdout=w, stderr=subprocess.DEVNULL)
        assert _wait(proc) == 0
    marker = _marker(layout)
    assert marker["ok"] is True
    assert marker["output"]["stdout"]["dropped_bytes"] > 0
    assert (layout.scratch / "console_sft.txt").stat().st_size == 160 * 65537


@pytest.mark.parametrize("closed", ["1", "2", "0 1 2"], ids=["stdout", "stderr", "all-three"])
def test_a_runner_started_with_closed_descriptors_publishes_and_exits_0(
    layout: Layout, closed: str
) -> None:
    """Started with stdout, stderr or all three closed, the runner publishes its marker and
    exits 0, and nothing of the worker's console lands in a file the runner opened (the
    lock took descriptor 1 before)."""
    layout.write_worker(COMPLETES)
    layout.write_payload()
    redirects = " ".join(f"{fd}>&-" if fd != "0" else "0<&-" for fd in closed.split())
    proc = subprocess.Popen(["sh", "-c", f'exec "$@" {redirects}', "sh", *_argv(layout)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert _wait(proc) == 0
    assert _marker(layout)["ok"] is True
    lock = layout.payload_path.parent / ".flash-lambda_attempt0.lock"
    assert lock.read_bytes() == b""
    assert b"training" in (layout.scratch / "console_sft.txt").read_bytes()


def test_bytes_written_to_the_runners_stdout_buffer_follow_its_text_in_order() -> None:
    """``sys.stdout`` of ``run`` is an outlet's text stream: a library in the runner's own
    process that writes bytes to ``sys.stdout.buffer`` gets them out, after the text it
    wrote first, instead of an AttributeError."""
    r, w = os.pipe()
    try:
        stream = OutletStream(Outlet(w, "out", capacity=1 << 16))
        stream.write("text first, ")
        assert stream.buffer.write(b"bytes next\n") == 11
        stream.buffer.flush()
        assert stream.outlet.drain(5)
        assert os.read(r, 100) == b"text first, bytes next\n"
    finally:
        os.close(r)
        os.close(w)
