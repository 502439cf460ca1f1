"""Real signals and real deadlines against the runner as a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import Layout, read_until

from fsm.attempt.runner import run_attempt


def _start(layout: Layout, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "fsm", *layout.run_args()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_training_stops_the_worker_and_leaves_a_retriable_marker(
    layout: Layout, signum: int
) -> None:
    layout.write_worker("""
        print("ready", flush=True)
        time.sleep(600)
    """)
    layout.write_payload()
    proc = _start(layout)
    read_until(proc.stdout, b"ready")
    sent = time.monotonic()
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=15)
    elapsed = time.monotonic() - sent
    assert proc.returncode == 75, stderr.decode()[-2000:]
    assert elapsed < 5, elapsed
    marker = layout.marker()
    assert marker is not None
    # The store was looked at before anything was decided: no completion, so interrupted.
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False,
        True,
        "interrupted",
        "VerifyRemote",
    )
    assert marker["worker"]["reason"] == "interrupted"
    assert layout.artifact("console_sft.txt").read_bytes().startswith(b"ready")


def test_a_signal_while_a_store_call_hangs_still_leaves_a_retriable_marker(
    layout: Layout, tmp_path: Path
) -> None:
    layout.write_worker("complete()")
    # A FIFO in the code tree: copying it blocks in open() until a writer comes (never).
    os.mkfifo(layout.store / "code" / "stuck.fifo")
    layout.write_payload()
    proc = _start(layout)
    read_until(proc.stderr, b'"to": "FetchCode"')
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=15)
    assert proc.returncode == 75
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"], marker["state"]) == (
        True,
        "interrupted",
        "FetchCode",
    )


def test_a_worker_past_the_deadline_is_stopped_and_the_run_fails_fatally_with_124(
    layout: Layout,
) -> None:
    layout.write_worker("""
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a worker that will not stop
        print("training forever", flush=True)
        time.sleep(600)
    """)
    layout.write_payload(max_wall_s=4, env={"FLASH_STOP_GRACE_S": "1"})
    started = time.monotonic()
    proc = layout.cli(*layout.run_args(), timeout=30)
    elapsed = time.monotonic() - started
    assert proc.returncode == 124, proc.stderr.decode()[-2000:]
    assert elapsed < 4 + 2, elapsed
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, False, "deadline")
    assert "run wall deadline exceeded" in marker["error"]
    console = layout.artifact("console_sft.txt").read_bytes()
    assert b"training forever" in console
    assert b"deadline" in console.splitlines()[-1]


def test_the_watchdog_ends_a_stuck_attempt_at_the_deadline_with_a_marker_and_124(
    layout: Layout,
) -> None:
    layout.write_worker("complete()")
    os.mkfifo(layout.store / "code" / "stuck.fifo")
    layout.write_payload(max_wall_s=3)
    started = time.monotonic()
    proc = layout.cli(*layout.run_args(), timeout=30)
    elapsed = time.monotonic() - started
    assert proc.returncode == 124, proc.stderr.decode()[-2000:]
    assert elapsed < 3 + 2, elapsed
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False,
        False,
        "deadline",
        "FetchCode",
    )
    assert marker["watchdog"] is True


def test_a_deadline_already_past_at_start_fails_fatally_without_running_anything(
    layout: Layout,
) -> None:
    layout.write_worker("(SCRATCH / 'ran').write_text('yes'); complete()")
    layout.write_payload(deadline_at=time.time() - 10)
    proc = layout.cli(*layout.run_args(), timeout=30)
    assert proc.returncode == 124
    marker = layout.marker()
    assert marker is not None and marker["rule"] == "deadline"
    assert not (layout.scratch / "ran").exists()


def test_a_sigterm_another_thread_catches_still_stops_the_worker_at_once(layout: Layout) -> None:
    """The kernel hands a process's SIGTERM to any of its threads, and Python runs the
    handler on the main thread only when that next runs bytecode: the runner's main thread,
    waiting on the worker, still wakes at once (its signal wakeup descriptor), stops the
    worker and marks the attempt interrupted."""
    layout.write_worker("""
        import signal
        print("ready", flush=True)
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(60)
    """)
    layout.write_payload()
    release = threading.Event()
    catcher = threading.Thread(target=release.wait, daemon=True)  # SIGTERM is not blocked here
    catcher.start()
    # Blocked in the main thread (and so in every thread it starts): only the catcher can
    # receive the signal, as any thread can in a real run.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    started = time.monotonic()
    try:
        with open(layout.root / "stdout.bin", "ab") as out:
            outcome = run_attempt(layout.settings(), dict(os.environ), out_fd=out.fileno(),
                                  handle_signals=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        release.set()
    elapsed = time.monotonic() - started
    marker = layout.marker()
    assert marker is not None
    assert (marker["rule"], marker["worker"]["reason"]) == ("interrupted", "interrupted")
    assert outcome.exit_code == 75
    assert elapsed < 20, elapsed  # the worker sleeps 60 s: it was stopped, not waited for
