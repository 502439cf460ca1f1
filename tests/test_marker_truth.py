"""The marker is true under every fault: whose it is, who may write it, what a signal
leaves, and what the exit status claims. Through the runner as a real process where a
process is what matters (signals, the lock, the exit); in-process where a defect has to be
planted (the driver's totality)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ARM, CANARY, PREFIX, Layout, read_until

from fsm import table
from fsm.attempt.runner import run_attempt
from fsm.context import Context
from states import HANDLERS

RESULT = f".flash-{ARM}_attempt0.result.json"


def _start(layout: Layout, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "fsm", *layout.run_args(), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _last_line(stderr: bytes) -> str:
    return stderr.decode().strip().splitlines()[-1]


def _result_file(layout: Layout) -> Path:
    return layout.payload_path.parent / RESULT


def _set_aside(layout: Layout) -> list[Path]:
    return sorted(layout.payload_path.parent.glob(f"{RESULT}.set-aside-*"))


#: A worker that records that it ran, then completes.
RAN_AND_COMPLETE = "(SCRATCH / 'ran').write_text(os.environ['ATTEMPT']); complete()"


# --- 1. replay identity ------------------------------------------------------------------


def test_a_finished_attempt_of_another_run_is_set_aside_and_this_attempt_trains(
    layout: Layout,
) -> None:
    """A later run reusing the host's payload directory with the same attempt number is not
    handed the earlier run's ``ok: true``: it trains, and the old record is kept aside."""
    layout.write_worker(RAN_AND_COMPLETE)
    layout.write_payload(run_id="run-A")
    assert layout.cli(*layout.run_args()).returncode == 0
    earlier = _result_file(layout).read_bytes()
    (layout.scratch / "ran").unlink()
    for name in ("DONE", "metrics.json"):
        layout.artifact(name).unlink()

    layout.write_payload(run_id="run-B")
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert (layout.scratch / "ran").exists(), "the second run must train, not replay"
    marker = layout.marker()
    assert marker is not None and (marker["ok"], marker["run_id"]) == (True, "run-B")
    [aside] = _set_aside(layout)
    assert aside.read_bytes() == earlier
    assert b'"result.set_aside"' in proc.stderr and b"run_id" in proc.stderr


def test_a_preload_result_of_the_same_attempt_number_does_not_mark_training_done(
    layout: Layout,
) -> None:
    """Preload then train on one host, both attempt 0: training still runs."""
    layout.write_worker(RAN_AND_COMPLETE)
    hf_home = layout.root / "cache" / "hf"
    hf_home.parent.mkdir()
    (layout.store / "models" / "org" / "m").mkdir(parents=True)
    (layout.store / "models" / "org" / "m" / "config.json").write_text("{}")
    layout.write_payload(mode="preload", models=["org/m"], env={"HF_HOME": str(hf_home)})
    assert layout.cli(*layout.run_args()).returncode == 0
    layout.write_payload()
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert (layout.scratch / "ran").exists()
    assert len(_set_aside(layout)) == 1


def _this_runs(marker: dict[str, Any]) -> bytes:
    """A persisted record with this run's identity around ``marker``."""
    identity = {"hf_repo": "org/flash-runs", "hf_prefix": PREFIX, "run_id": "run-1",
                "mode": "train", "flash_arm": ARM, "attempt": 0}
    return json.dumps(
        {"version": 1, "identity": identity, "marker": marker, "artifacts": {}}
    ).encode()


_GOOD = {"ok": True, "ts": 1.0, "attempt": 0, "retriable": False, "error": ""}


@pytest.mark.parametrize(
    "record",
    [
        b"not json",
        b"[]",
        # the first release's format: a bare marker, keyed by arm and attempt only
        json.dumps(_GOOD).encode(),
        # this run's identity, but a malformed marker
        _this_runs({**_GOOD, "ok": "yes"}),
        _this_runs({**_GOOD, "attempt": 1}),
        _this_runs({**_GOOD, "ts": "now"}),
        _this_runs({k: v for k, v in _GOOD.items() if k != "retriable"}),
    ],
    ids=["garbage", "array", "old-format", "ok-text", "other-attempt", "ts-text", "no-retriable"],
)
def test_a_malformed_persisted_record_is_never_replayed_or_uploaded(
    layout: Layout, record: bytes
) -> None:
    _result_file(layout).write_bytes(record)
    layout.write_worker(RAN_AND_COMPLETE)
    layout.write_payload()
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert (layout.scratch / "ran").exists()
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True and marker["ts"] != 1.0
    [aside] = _set_aside(layout)
    assert aside.read_bytes() == record


def test_the_same_attempt_of_the_same_run_is_replayed_without_training(layout: Layout) -> None:
    layout.write_worker("(SCRATCH / 'ran').write_text('x'); sys.exit(3)")
    layout.write_payload()
    assert layout.cli(*layout.run_args()).returncode == 1
    first = layout.marker()
    (layout.scratch / "ran").unlink()
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 1
    assert not (layout.scratch / "ran").exists()
    assert layout.marker() == first
    assert _set_aside(layout) == []


# --- 2. the lock comes first -------------------------------------------------------------


def _hold_attempt(layout: Layout) -> subprocess.Popen[bytes]:
    """A first runner that holds attempt 0 while its worker waits for a file."""
    layout.write_worker("""
        print("holding", flush=True)
        while not (SCRATCH / "go").exists():
            time.sleep(0.02)
        complete()
    """)
    layout.write_payload(max_wall_s=60)
    first = _start(layout)
    read_until(first.stdout, b"holding")
    return first


def _waiting_second(layout: Layout, **payload: Any) -> subprocess.Popen[bytes]:
    if payload:
        layout.write_payload(**payload)
    second = _start(layout)
    read_until(second.stderr, b'"attempt.lock_wait"')
    return second


def test_a_runner_waiting_for_the_lock_and_signalled_writes_nothing_and_says_why(
    layout: Layout,
) -> None:
    first = _hold_attempt(layout)
    second = _waiting_second(layout)
    second.send_signal(signal.SIGTERM)
    _, err2 = second.communicate(timeout=15)
    assert second.returncode == 73, err2.decode()[-2000:]
    assert "held by another live runner" in _last_line(err2)
    assert layout.marker() is None and not _result_file(layout).exists()
    (layout.scratch / "go").write_text("")
    _, err1 = first.communicate(timeout=30)
    assert first.returncode == 0, err1.decode()[-2000:]
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True
    persisted = json.loads(_result_file(layout).read_text())
    assert persisted["marker"] == marker


def test_a_runner_whose_deadline_passes_while_waiting_for_the_lock_writes_nothing(
    layout: Layout,
) -> None:
    first = _hold_attempt(layout)
    second = _waiting_second(layout, max_wall_s=2)
    _, err2 = second.communicate(timeout=20)
    assert second.returncode == 124, err2.decode()[-2000:]
    assert "wrote nothing" in _last_line(err2)
    assert layout.marker() is None and not _result_file(layout).exists()
    (layout.scratch / "go").write_text("")
    first.communicate(timeout=30)
    assert first.returncode == 0
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True and "watchdog" not in marker


# --- 4. confirmed completion outranks a late signal -----------------------------------------


def test_a_worker_that_completed_and_is_then_stopped_with_the_host_succeeds(
    layout: Layout,
) -> None:
    layout.write_worker("""
        complete()
        print("uploaded", flush=True)
        time.sleep(600)
    """)
    layout.write_payload()
    proc = _start(layout)
    read_until(proc.stdout, b"uploaded")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err.decode()[-2000:]
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["rule"], marker["worker"]["reason"]) == (
        True, "completion-confirmed", "interrupted")


# --- 6. signals from the first instruction --------------------------------------------------


def _catches_sigterm(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:"))
                 .split()[1], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_a_sigterm_during_start_up_ends_in_a_retriable_marker(layout: Layout) -> None:
    """SIGTERM as soon as the runner catches it at all (during its imports): the payload
    is still read, the destination learned, and the marker says ``interrupted``."""
    layout.write_worker(RAN_AND_COMPLETE)
    layout.write_payload()
    proc = _start(layout)
    give_up = time.monotonic() + 10
    while not _catches_sigterm(proc.pid):
        assert time.monotonic() < give_up and proc.poll() is None, "never caught SIGTERM"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 75, err.decode()[-2000:]
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, True, "interrupted", "LoadPayload")
    assert not (layout.scratch / "ran").exists()
    assert "rule interrupted" in _last_line(err)


# --- 12. the driver is total --------------------------------------------------------------


def _run_with(layout: Layout, **handlers: Any) -> Any:
    layout.write_worker(RAN_AND_COMPLETE)
    layout.write_payload()
    with open(layout.root / "stdout.bin", "ab") as out:
        return run_attempt(
            layout.settings(), dict(os.environ), out_fd=out.fileno(), handle_signals=False,
            handlers={**HANDLERS, **handlers},
        )


def test_a_handler_returning_an_event_its_state_does_not_allow_ends_in_internal_error(
    layout: Layout,
) -> None:
    outcome = _run_with(layout, **{table.FETCH_CODE: lambda ctx: table.WORKER_EXITED})
    assert outcome.exit_code == 1
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, False, "internal-error", "FetchCode")
    assert "worker_exited" in marker["error"]


def test_a_state_without_a_handler_ends_in_internal_error(layout: Layout) -> None:
    handlers = dict(HANDLERS)
    del handlers[table.RESOLVE_SPEC]
    layout.write_worker(RAN_AND_COMPLETE)
    layout.write_payload()
    with open(layout.root / "stdout.bin", "ab") as out:
        outcome = run_attempt(layout.settings(), dict(os.environ), out_fd=out.fileno(),
                              handle_signals=False, handlers=handlers)
    marker = layout.marker()
    assert outcome.exit_code == 1 and marker is not None
    assert (marker["rule"], marker["state"]) == ("internal-error", "ResolveSpec")


def test_a_crash_inside_mark_keeps_the_outcome_persisted_and_exits_3(layout: Layout) -> None:
    def broken_mark(ctx: Context) -> str:
        raise RuntimeError("mark broke")

    outcome = _run_with(layout, **{table.MARK: broken_mark})
    assert outcome.exit_code == 3, outcome.reason
    assert "marker NOT published" in outcome.reason and "mark broke" in outcome.reason
    assert layout.marker() is None
    persisted = json.loads(_result_file(layout).read_text())
    assert persisted["marker"]["ok"] is True  # the worker did complete: that stands
    # Running the same payload again publishes the persisted outcome without training.
    (layout.scratch / "ran").unlink()
    again = layout.cli(*layout.run_args())
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    assert not (layout.scratch / "ran").exists()
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True


def test_every_working_state_of_the_table_has_exactly_one_handler_and_no_handler_is_stray(
) -> None:
    from fsm.driver import handler_problems

    assert handler_problems(HANDLERS) == []
    broken = {**{k: v for k, v in HANDLERS.items() if k != table.TRAIN}, "Training": HANDLERS[
        table.TRAIN]}
    assert handler_problems(broken) == [
        "Train has no handler", "a handler for 'Training', which is no working state of the table"
    ]


def test_after_sigterm_a_worker_ignoring_it_cannot_hold_the_marker_past_dockers_stop_timeout(
    layout: Layout,
) -> None:
    """The worker's grace (30 s here) is cut short after a signal: Docker kills the
    container 10 s after its SIGTERM, and the marker must be out before that."""
    layout.write_worker("""
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(600)
    """)
    layout.write_payload(env={"HF_TOKEN": CANARY, "FLASH_STOP_GRACE_S": "30"})
    proc = _start(layout)
    read_until(proc.stdout, b"ready")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    elapsed = time.monotonic() - sent
    assert proc.returncode == 75, err.decode()[-2000:]
    assert elapsed < 8, elapsed
    marker = layout.marker()
    assert marker is not None and (marker["rule"], marker["retriable"]) == ("interrupted", True)


# --- 10. the payload's env decides the store ------------------------------------------------


def test_a_store_named_only_in_the_payload_env_is_where_the_marker_goes(layout: Layout) -> None:
    """``FLASH_STORE`` in the payload's env, no ``--store``: runner and worker use it."""
    layout.write_worker(RAN_AND_COMPLETE)
    layout.write_payload(env={"HF_TOKEN": CANARY, "FLASH_STORE": layout.store_url})
    args = [a for a in layout.run_args() if a not in ("--store", layout.store_url)]
    proc = layout.cli(*args, env={"FLASH_STORE": ""})
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True


def test_an_unusable_store_in_the_payload_env_is_an_unusable_payload(layout: Layout) -> None:
    layout.write_worker(RAN_AND_COMPLETE)
    layout.write_payload(env={"HF_TOKEN": CANARY, "FLASH_STORE": "ftp://example.invalid/x"})
    args = [a for a in layout.run_args() if a not in ("--store", layout.store_url)]
    proc = layout.cli(*args)
    assert proc.returncode == 2, proc.stderr.decode()[-2000:]
    assert "FLASH_STORE" in _last_line(proc.stderr)
    assert not (layout.scratch / "ran").exists()
    assert not _result_file(layout).exists()
