"""Orchestrators read the verdict from the exit status and the termination message
(``fsm/exits.py``, ``fsm/worker/termination.py``): each class of ending exits with its own status,
through the real runner on both stores, and the termination message says the same, bounded
and redacted. Absent or unwritable, the message file costs nothing.

The other statuses have their own tests through the real runner: 2 (test_run_local,
test_properties_bad_input), 3, 74 and 78 (test_marker_truth, test_end_budget,
test_properties_runner), 73 (test_marker_truth), 124 (test_attempt_budget).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import ARM, CANARY, PREFIX, Layout
from hubrun import HubRun

from fsm import exits
from fsm.output.redact import Redactor
from fsm.worker import termination

#: The worker of each class: it completes; it dies without artifacts (the job's fault);
#: it writes metrics.json but never uploads it (the store lost it: retry on a fresh host).
WORKERS = {
    "succeeded": "complete()\n",
    "fatal": "print('a bug of the job', flush=True)\nsys.exit(3)\n",
    "retriable": "write_metrics()\nsys.exit(1)\n",
}
#: What each class ends with: exit status, the marker's (ok, retriable), its rule.
EXPECTED = {
    "succeeded": (0, (True, False), "completion-confirmed"),
    "fatal": (1, (False, False), "worker-failed"),
    "retriable": (75, (False, True), "worker-upload-lost"),
}


def _message(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    assert len(data) <= termination.MAX_BYTES and data.endswith(b"\n") and data.count(b"\n") == 1
    value = json.loads(data)
    assert isinstance(value, dict)
    return value


def _check(proc: subprocess.CompletedProcess[bytes], marker: dict[str, Any] | None,
           verdict: str, log: Path, secret: str) -> None:
    code, (ok, retriable), rule = EXPECTED[verdict]
    stderr = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == code, stderr[-3000:]
    assert marker is not None and (marker["ok"], marker["retriable"], marker["rule"]) == (
        ok, retriable, rule)
    assert exits.by_code(code) == (exits.SUCCEEDED if ok else exits.failed(retriable))
    said = _message(log)
    last = stderr.strip().splitlines()[-1].removeprefix("flash-bootstrap: ")
    assert said == {"status": code, "name": exits.by_code(code).name,  # type: ignore[union-attr]
                    "class": verdict, "rule": rule,
                    "marker": f"{PREFIX}/{ARM}_attempt0.json", "reason": last}
    assert secret not in log.read_text()


@pytest.mark.parametrize("verdict", sorted(WORKERS))
def test_each_class_exits_with_its_own_status_on_the_local_store(
    layout: Layout, tmp_path: Path, verdict: str
) -> None:
    """0 succeeded, 1 fatal, 75 retriable (EX_TEMPFAIL), and the termination message says
    the status, the class, the rule, the marker and the last line."""
    layout.write_worker(WORKERS[verdict])
    layout.write_payload()
    log = tmp_path / "termination-log"
    proc = layout.cli(*layout.run_args(), env={"FLASH_TERMINATION_LOG": str(log)})
    _check(proc, layout.marker(), verdict, log, CANARY)


@pytest.mark.hub
@pytest.mark.parametrize("verdict", sorted(WORKERS))
def test_each_class_exits_with_its_own_status_on_the_hub(
    hub_run: HubRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verdict: str
) -> None:
    """The same statuses and message through the real huggingface_hub client."""
    hub_run.write_worker(WORKERS[verdict])
    log = tmp_path / "termination-log"
    monkeypatch.setenv("FLASH_TERMINATION_LOG", str(log))
    proc = hub_run.cli()
    _check(proc, hub_run.marker(), verdict, log, hub_run.token)


def test_the_default_termination_log_is_written_only_where_it_exists(tmp_path: Path) -> None:
    """Without FLASH_TERMINATION_LOG the file is Kubernetes' /dev/termination-log, which the
    runner never creates; FLASH_TERMINATION_LOG names another, created; empty is off."""
    assert termination.path({}) == (termination.DEFAULT_PATH, False)
    assert termination.path({"FLASH_TERMINATION_LOG": ""}) is None
    named = tmp_path / "msg"
    assert termination.path({"FLASH_TERMINATION_LOG": str(named)}) == (str(named), True)
    if not os.path.exists(termination.DEFAULT_PATH):
        assert not termination.write({}, Redactor(), status=1, reason="x")
        assert not os.path.exists(termination.DEFAULT_PATH)


def test_the_message_is_cut_to_4096_bytes_and_a_secret_is_masked_whole() -> None:
    """A reason of 2,000 three-byte characters is cut (never a key) to fit Kubernetes'
    4,096 bytes, and a secret straddling the cut leaves no piece behind."""
    secret = "hf_" + "s3cr3t" * 5
    reason = "渋" * 1_300 + secret + "渋" * 700
    data = termination.message({"status": 1, "class": "fatal", "rule": "worker-failed",
                                "reason": reason}, Redactor([secret]))
    assert len(data) <= termination.MAX_BYTES
    value = json.loads(data)
    assert (value["status"], value["class"], value["rule"]) == (1, "fatal", "worker-failed")
    assert value["reason"].endswith("...") and value["reason"].startswith("渋" * 1_000)
    assert "s3cr3t" not in value["reason"] and "hf_s3" not in value["reason"]
    short = termination.message({"status": 0, "reason": "ok"}, Redactor())
    assert json.loads(short)["reason"] == "ok"


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _read_only(path: Path) -> Path:
    path.write_text("")
    path.chmod(stat.S_IRUSR)
    return path


@pytest.mark.parametrize("kind", ["missing-dir", "directory", "fifo-without-reader", "read-only"])
def test_an_unusable_termination_log_costs_nothing(layout: Layout, tmp_path: Path,
                                                   kind: str) -> None:
    """A file that cannot be written (absent directory, a directory, a FIFO nobody reads,
    read-only) changes nothing: same status, same marker, the same last line, no word of it."""
    target = {
        "missing-dir": lambda: tmp_path / "no" / "such" / "file",
        "directory": lambda: tmp_path,
        "fifo-without-reader": lambda: _fifo(tmp_path / "fifo"),
        # even root cannot write there (a read-only file is root's to write)
        "read-only": lambda: Path("/proc/version") if os.geteuid() == 0 else _read_only(
            tmp_path / "ro"),
    }[kind]()
    layout.write_worker(WORKERS["retriable"])
    layout.write_payload()
    proc = layout.cli(*layout.run_args(), env={"FLASH_TERMINATION_LOG": str(target)},
                      timeout=60)
    stderr = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 75, stderr[-3000:]
    marker = layout.marker()
    assert marker is not None and marker["rule"] == "worker-upload-lost"
    assert "Traceback" not in stderr and "FLASH_TERMINATION_LOG" not in stderr
    assert "failed (retriable, rule worker-upload-lost)" in stderr.strip().splitlines()[-1]


def test_every_status_of_the_table_is_distinct_and_each_class_has_its_own() -> None:
    """The statuses an engine keys on: one per class, the conventional numbers."""
    codes = [e.code for e in exits.TABLE]
    assert len(set(codes)) == len(codes)
    assert (exits.SUCCEEDED.code, exits.FAILED_FATAL.code, exits.FAILED_RETRIABLE.code,
            exits.DEADLINE.code, exits.INTERNAL.code) == (0, 1, 75, 124, 70)
    assert exits.failed(True) is exits.FAILED_RETRIABLE
    assert exits.failed(False) is exits.FAILED_FATAL
    assert all(0 <= c <= 125 for c in codes)  # 126+ are the shell's and the signals'


@pytest.mark.parametrize("case", ["unusable", "deadline"])
def test_the_unusable_payload_and_the_deadline_leave_their_status_in_the_message(
    layout: Layout, tmp_path: Path, case: str
) -> None:
    """2 (a payload with a usable destination but a bad field: its fatal marker is
    published) and 124 (the worker outlived the attempt's deadline), said the same way."""
    layout.write_worker("time.sleep(60)\n")
    if case == "unusable":
        layout.write_payload(seed="three")
    else:
        layout.write_payload(max_wall_s=4, env={"HF_TOKEN": CANARY, "FLASH_EXIT_RESERVE_S": "1",
                                                "FLASH_STOP_GRACE_S": "1"})
    log = tmp_path / "termination-log"
    proc = layout.cli(*layout.run_args(), env={"FLASH_TERMINATION_LOG": str(log)})
    stderr = proc.stderr.decode("utf-8", "replace")
    status, rule = (2, "payload-invalid") if case == "unusable" else (124, "deadline")
    assert proc.returncode == status, stderr[-3000:]
    said = _message(log)
    assert (said["status"], said["name"], said["class"], said["rule"]) == (
        status, exits.by_code(status).name, "fatal", rule)  # type: ignore[union-attr]
    assert said["reason"] == stderr.strip().splitlines()[-1].removeprefix("flash-bootstrap: ")
    assert CANARY not in log.read_text()
