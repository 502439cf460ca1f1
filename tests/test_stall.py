"""Hung workers (issue 23, CONTRACT section 7), through the real runner process with real
worker processes: a stall is caught in FLASH_STALL_S, not at the wall cap; the stacks of
every process of the worker's group are taken before the first signal and go up as
``stacks_<phase>.txt``; the verdict is retriable ``worker-stalled``, fatal
``worker-stalled-again`` when the previous attempt stalled on the same line on another host
(``tests/test_across_attempts.py``); a deadline keeps its class and names the stacks file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Layout, read_until

STALL_S = 5.0
#: The budget of a stall test: the watch, the stacks (at most 20 s), the stop, the marker.
STALL_BOUND_S = STALL_S + 20 + 10
WORKER_FILE = "flash/engine/worker/__main__.py"


def _env(**extra: str) -> dict[str, str]:
    return {"HF_TOKEN": "hf_CANARY_token_must_never_leak_0123456789",
            "FLASH_STOP_GRACE_S": "1", "FLASH_STALL_S": f"{STALL_S:g}", **extra}


def _run(layout: Layout, *, timeout: float = 90, **payload: Any) -> subprocess.CompletedProcess[
        bytes]:
    payload.setdefault("env", _env())
    layout.write_payload(**payload)
    return layout.cli(*layout.run_args(), timeout=timeout)


def _marker(layout: Layout, attempt: int = 0) -> dict[str, Any]:
    marker = layout.marker(attempt)
    assert marker is not None, "no marker was published"
    return marker


def _line_of(layout: Layout, needle: str) -> int:
    """The line of the worker's source holding ``needle`` (1-based)."""
    source = (layout.store / "code" / WORKER_FILE).read_text().splitlines()
    return next(i for i, line in enumerate(source, 1) if needle in line)


def _stacks(layout: Layout) -> str:
    return layout.artifact("stacks_sft.txt").read_text()


SILENT_HANG = """
def wait_for_the_peer_that_died():
    print("step 1 done", flush=True)
    time.sleep(600)  # the collective that never returns

wait_for_the_peer_that_died()
"""


def test_a_silent_worker_is_stalled_in_minutes_and_leaves_its_stacks(layout: Layout) -> None:
    """A worker that prints, then hangs without a sound: stopped after FLASH_STALL_S, its
    stacks taken first and uploaded, the marker retriable worker-stalled with the function
    it hung in and its last line."""
    layout.write_worker(SILENT_HANG)
    started = time.monotonic()
    proc = _run(layout)
    elapsed = time.monotonic() - started
    assert proc.returncode == 75, proc.stderr.decode()[-3000:]
    assert elapsed < STALL_BOUND_S, elapsed
    marker = _marker(layout)
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, True, "worker-stalled", "VerifyRemote")
    stall = marker["stall"]
    assert stall["silent_s"] >= STALL_S
    assert stall["last_line"] == "step 1 done"
    line = _line_of(layout, "time.sleep(600)")
    assert stall["where"] == f"wait_for_the_peer_that_died ({WORKER_FILE}:{line})"
    assert marker["worker"]["reason"] == "stalled"
    assert marker["stacks"]["file"] == "stacks_sft.txt" and marker["stacks"]["for"] == "stalled"
    stacks = _stacks(layout)
    assert "wait_for_the_peer_that_died" in stacks and "(the worker)" in stacks
    assert "FLASH_STALL_S" in marker["error"] and "stacks_sft.txt" in marker["error"]
    console = layout.artifact("console_sft.txt").read_text()
    assert "made no progress" in console


def test_a_busy_loop_holding_the_gil_is_a_stall_and_its_stacks_show_the_loop(
    layout: Layout,
) -> None:
    """Busy but silent looks exactly like stuck: a spinning loop that holds the GIL is
    stalled too, and the sampler still reads where it spins."""
    layout.write_worker("""
        def spin_forever():
            n = 0
            while True:
                n += 1

        spin_forever()
    """)
    proc = _run(layout)
    assert proc.returncode == 75, proc.stderr.decode()[-3000:]
    marker = _marker(layout)
    assert marker["rule"] == "worker-stalled"
    assert marker["stall"]["where"].startswith(f"spin_forever ({WORKER_FILE}:")
    assert "spin_forever" in _stacks(layout)


def test_a_hang_in_a_child_the_worker_waits_on_leaves_both_stacks(layout: Layout) -> None:
    """The worker waits on a child process that hangs: both processes are in the stacks
    file, each by pid and command line, and the child's function is named."""
    layout.write_worker("""
        import subprocess
        CHILD = ("import time\\ndef child_waits_forever():\\n    time.sleep(600)\\n"
                 "child_waits_forever()\\n")
        print("starting the child", flush=True)
        subprocess.run([sys.executable, "-c", CHILD])
    """)
    proc = _run(layout)
    assert proc.returncode == 75, proc.stderr.decode()[-3000:]
    marker = _marker(layout)
    assert marker["rule"] == "worker-stalled"
    assert len(marker["stacks"]["processes"]) == 2
    stacks = _stacks(layout)
    assert "child_waits_forever" in stacks
    assert "subprocess.py" in stacks  # the worker itself, waiting in subprocess.run


def test_a_stalled_worker_that_ignores_sigterm_is_killed_after_its_grace(layout: Layout) -> None:
    layout.write_worker("""
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("deaf", flush=True)
        time.sleep(600)
    """)
    proc = _run(layout)
    assert proc.returncode == 75, proc.stderr.decode()[-3000:]
    marker = _marker(layout)
    assert marker["rule"] == "worker-stalled"
    assert marker["worker"]["signal"] == "SIGKILL"


def test_a_worker_that_hangs_after_uploading_both_artifacts_succeeded(layout: Layout) -> None:
    """A stall after DONE and metrics.json reached the store (a hang at interpreter exit,
    in a process group's teardown) is still a success: the store decides."""
    layout.write_worker("complete()\nprint('uploaded', flush=True)\ntime.sleep(600)\n")
    proc = _run(layout)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    marker = _marker(layout)
    assert (marker["ok"], marker["rule"]) == (True, "completion-confirmed")
    assert marker["worker"]["reason"] == "stalled"


@pytest.mark.parametrize("body", [
    # a line every 0.8 of the budget, three times
    "for step in range(3):\n    print(f'step {step}', flush=True)\n    time.sleep(4)\ncomplete()\n",
    # silent on the console for 3x the budget, touching the progress file every 2 s
    ("progress = Path(os.environ['FLASH_PROGRESS_FILE'])\nfor _ in range(8):\n"
     "    progress.touch()\n    time.sleep(2)\ncomplete()\n"),
], ids=["gaps-just-under-the-budget", "kept-alive-by-the-progress-file"])
def test_a_worker_that_keeps_showing_progress_is_never_stalled(layout: Layout, body: str) -> None:
    layout.write_worker(body)
    proc = _run(layout)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    marker = _marker(layout)
    assert marker["ok"] is True and "stall" not in marker


def test_with_the_watch_off_a_silent_worker_is_not_stalled(layout: Layout) -> None:
    layout.write_worker("time.sleep(7)\ncomplete()\n")
    proc = _run(layout, env=_env(FLASH_STALL_S="0"))
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert _marker(layout)["ok"] is True


@pytest.mark.parametrize("value", ["abc", "3", "-1", "inf", "nan"])
def test_an_unusable_stall_setting_makes_the_payload_unusable_naming_it(
    layout: Layout, value: str
) -> None:
    layout.write_worker("(SCRATCH / 'ran').write_text('x')\ncomplete()\n")
    proc = _run(layout, env=_env(FLASH_STALL_S=value))
    assert proc.returncode == 2, proc.stderr.decode()[-3000:]
    last = proc.stderr.decode().strip().splitlines()[-1]
    assert "FLASH_STALL_S" in last and "payload unusable" in last
    assert _marker(layout)["rule"] == "payload-invalid"
    assert not (layout.scratch / "ran").exists()


def _sampler(tmp_path: Path, body: str) -> str:
    script = tmp_path / "sampler"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return str(script)


def test_without_a_sampler_the_stacks_fall_back_to_proc(layout: Layout) -> None:
    layout.write_worker(SILENT_HANG)
    proc = _run(layout, env=_env(FLASH_PY_SPY="none"))
    assert proc.returncode == 75, proc.stderr.decode()[-3000:]
    marker = _marker(layout)
    assert {p["method"] for p in marker["stacks"]["processes"]} == {"proc"}
    stacks = _stacks(layout)
    assert "State:" in stacks and "wchan" in stacks


def test_a_sampler_that_hangs_is_bounded_and_falls_back(layout: Layout, tmp_path: Path) -> None:
    """A py-spy that never answers costs at most its 5 s a process: the stall still ends
    in its marker in time, the stacks from /proc."""
    layout.write_worker(SILENT_HANG)
    started = time.monotonic()
    proc = _run(layout, env=_env(FLASH_PY_SPY=_sampler(tmp_path, "exec sleep 600\n")))
    elapsed = time.monotonic() - started
    assert proc.returncode == 75, proc.stderr.decode()[-3000:]
    assert elapsed < STALL_S + 5 + 15, elapsed
    marker = _marker(layout)
    assert marker["rule"] == "worker-stalled"
    assert {p["method"] for p in marker["stacks"]["processes"]} == {"proc"}


def _drops_privileges() -> str | None:
    for tool in ("setpriv", "runuser"):
        if shutil.which(tool):
            return tool
    return None


@pytest.mark.skipif(os.geteuid() != 0 or _drops_privileges() is None,
                    reason="needs root and setpriv or runuser to run the sampler unprivileged")
def test_a_sampler_without_ptrace_permission_falls_back_and_says_so(
    layout: Layout, tmp_path: Path
) -> None:
    real = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    assert real is not None
    drop = ("exec setpriv --reuid=65534 --regid=65534 --clear-groups" if
            _drops_privileges() == "setpriv" else "exec runuser -u nobody --")
    layout.write_worker(SILENT_HANG)
    proc = _run(layout, env=_env(FLASH_PY_SPY=_sampler(tmp_path, f'{drop} {real} "$@"\n')))
    assert proc.returncode == 75, proc.stderr.decode()[-3000:]
    marker = _marker(layout)
    leader = marker["stacks"]["processes"][0]
    assert leader["method"] == "proc" and "permission" in leader["why"]


def test_a_stall_racing_a_sigterm_ends_in_one_retriable_marker_in_time(
    layout: Layout, tmp_path: Path
) -> None:
    """SIGTERM comes while the stacks of a stall are being taken (the sampler hangs): the
    capture is cut short, the stall stands, one marker lands within Docker's stop timeout."""
    layout.write_worker(SILENT_HANG)
    layout.write_payload(env=_env(FLASH_PY_SPY=_sampler(tmp_path, "exec sleep 600\n")))
    proc = subprocess.Popen([sys.executable, "-m", "fsm", *layout.run_args()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    read_until(proc.stderr, b'"worker.stalled"', timeout=30)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 10
    assert proc.returncode == 75, err.decode()[-3000:]
    marker = _marker(layout)
    assert (marker["retriable"], marker["rule"]) == (True, "worker-stalled")
    assert marker["stacks"]["taken"] is False and "a signal came" in marker["stacks"]["why"]
    assert len(layout.markers()) == 1


def _another(function: str) -> str:
    return f"""
def {function}():
    print("step 1 done", flush=True)
    time.sleep(600)

{function}()
"""


def test_stalling_twice_in_the_same_place_on_one_host_stays_retriable(
    layout: Layout,
) -> None:
    """Attempt 0 and attempt 1 stall on the same line of the same host: a fault that stays
    with its host is the host's (CONTRACT section 9), so the second stays retriable; the
    marker names the place and the machine. On two hosts it is the job's:
    ``tests/test_across_attempts.py``."""
    layout.write_worker(SILENT_HANG)
    assert _run(layout).returncode == 75
    first = _marker(layout)
    assert first["rule"] == "worker-stalled"
    line = _line_of(layout, "time.sleep(600)")
    assert first["fault"] == {
        "rule": "worker-stalled", "family": "stall", "confirmed_by": "worker",
        "fingerprint": f"stall: wait_for_the_peer_that_died ({WORKER_FILE}:{line})"}
    proc = _run(layout, attempt=1)
    assert proc.returncode == 75, proc.stderr.decode()[-3000:]
    again = _marker(layout, 1)
    assert (again["retriable"], again["rule"]) == (True, "worker-stalled")
    assert again["host"]["id"] == first["host"]["id"]
    assert "previous" not in again["stall"]


def test_the_deadline_keeps_its_class_and_names_the_stacks_file(layout: Layout) -> None:
    layout.write_worker(SILENT_HANG)
    # A reserve that leaves the stacks a few seconds before the stop (2 s stay for it).
    proc = _run(layout, max_wall_s=14, env=_env(FLASH_STALL_S="0", FLASH_EXIT_RESERVE_S="10"))
    assert proc.returncode == 124, proc.stderr.decode()[-3000:]
    marker = _marker(layout)
    assert (marker["retriable"], marker["rule"]) == (False, "deadline")
    assert marker["stacks"]["for"] == "deadline"
    assert "stacks_sft.txt" in marker["error"]
    assert "wait_for_the_peer_that_died" in _stacks(layout)


def test_explain_shows_the_stall_and_the_head_of_the_stacks_file(layout: Layout) -> None:
    layout.write_worker(SILENT_HANG)
    assert _run(layout).returncode == 75
    shown = layout.cli("explain", "--repo", "org/flash-runs", "--prefix", "sft/run-1/seed3",
                       "--attempt", "0", "--store", layout.store_url)
    assert shown.returncode == 0, shown.stderr.decode()
    text = shown.stdout.decode()
    assert "stall  no progress for" in text and "wait_for_the_peer_that_died" in text
    assert "stacks  sft/run-1/seed3/stacks_sft.txt (first" in text
    assert json.loads(layout.artifact("lambda_attempt0.json").read_text())["rule"] == (
        "worker-stalled")


@pytest.mark.hub
def test_a_stall_while_the_store_hangs_still_lands_its_marker_in_time(hub_run: Any) -> None:
    """The worker stalls, then the store hangs the verification's listing and the marker's
    first commit: the end of the attempt still verifies, and marks it worker-stalled, with
    the stacks file in the same commit."""
    hub_run.write_worker(SILENT_HANG)
    proc = hub_run.start(env={"HF_TOKEN": hub_run.token, "FLASH_STOP_GRACE_S": "1",
                              "FLASH_STALL_S": f"{STALL_S:g}",
                              "FLASH_STORE_CALL_TIMEOUT_S": "60"})
    read_until(proc.stdout, b"step 1 done", timeout=30)
    hub_run.server.hang("GET", r"/tree/main/sft", seconds=120, times=1)
    hub_run.server.hang("POST", r"/commit/", seconds=120, times=1)
    err = hub_run.finish(proc, timeout=90)
    assert proc.returncode == 75, err.decode()[-3000:]
    marker = hub_run.marker()
    assert marker is not None and marker["rule"] == "worker-stalled"
    assert "wait_for_the_peer_that_died" in hub_run.artifact("stacks_sft.txt").read_text()
