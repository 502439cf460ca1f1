"""The budget belongs to the attempt: a restarted runner continues it, and a wall-clock
step neither stops a worker that finishes by the deadline it was given nor lets the
attempt overrun by more than the step. Through the runner as a real process (real
SIGKILLs, a real clock step under libfaketime); the step arithmetic of ``Deadline`` on its
own, with the clock readings handed in."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ARM, CANARY, Layout, read_until

from fsm.clock import CLOCK_STEP_TOLERANCE_S, Deadline

START = f".flash-{ARM}_attempt0.start.json"

#: A worker that records each run, says its pid and its FLASH_RUN_DEADLINE_AT, and waits.
WAITING_WORKER = """
    with open(SCRATCH / "runs", "a") as runs:
        runs.write(os.environ["FLASH_RUN_DEADLINE_AT"] + "\\n")
    print(f"worker {os.getpid()} {os.environ['FLASH_RUN_DEADLINE_AT']} !", flush=True)
    time.sleep(600)
"""
WORKER_LINE = re.compile(rb"worker (\d+) ([\d.]+) !")


def _start(layout: Layout, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "fsm", *layout.run_args()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )


def _start_file(layout: Layout) -> dict[str, Any]:
    data = json.loads((layout.payload_path.parent / START).read_text())
    assert isinstance(data, dict)
    return data


def _killed_once_its_worker_runs(layout: Layout) -> tuple[str, bytes]:
    """Start the runner, wait for its worker to say its FLASH_RUN_DEADLINE_AT, then SIGKILL
    the runner and the worker's whole group (as an OOM kill of both would): that deadline,
    and the runner's stderr."""
    proc = _start(layout)
    worker_pid = None
    try:
        match = WORKER_LINE.search(read_until(proc.stdout, b" !"))
        assert match is not None
        worker_pid, deadline = int(match.group(1)), match.group(2).decode()
    finally:
        stderr = _sigkill(proc, worker_pid)
    return deadline, stderr


def _sigkill(proc: subprocess.Popen[bytes], worker_pid: int | None) -> bytes:
    """SIGKILL the runner and, when known, the worker's group; the runner's stderr."""
    proc.kill()
    if worker_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker_pid, signal.SIGKILL)  # the worker leads its own session
    _, stderr = proc.communicate(timeout=30)
    return stderr


def _events(stderr: bytes, name: str) -> list[dict[str, Any]]:
    found = []
    for line in stderr.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("msg") == name:
            found.append(event)
    return found


def _wait_until_epoch(at: float, bound_s: float = 60.0) -> None:
    """Poll (bounded) until the wall clock has passed ``at``."""
    give_up = time.monotonic() + bound_s
    while time.time() <= at:
        assert time.monotonic() < give_up, "the deadline never passed"
        time.sleep(0.05)


# --- a restart continues the attempt's budget --------------------------------------------


def test_a_restart_after_sigkill_gives_the_worker_the_same_deadline(layout: Layout) -> None:
    """A runner SIGKILLed with its worker and started again continues the attempt's budget:
    its worker gets the same FLASH_RUN_DEADLINE_AT, and a payload rewritten with another
    max_wall_s still counts from the attempt's first start."""
    layout.write_worker(WAITING_WORKER)
    layout.write_payload(max_wall_s=30)  # the exit reserve: 10% of the budget, 3 s
    first, _ = _killed_once_its_worker_runs(layout)
    again, stderr = _killed_once_its_worker_runs(layout)
    assert again == first
    start = _start_file(layout)
    assert float(first) == pytest.approx(start["started_at"] + 30 - 3, abs=0.002)
    [continued] = _events(stderr, "attempt.continued")
    assert continued["started_at"] == pytest.approx(start["started_at"], abs=0.001)
    assert 0 < continued["spent_s"] < 30 and 0 < continued["left_s"] < 30
    assert continued["spent_s"] + continued["left_s"] == pytest.approx(30, abs=0.5)

    layout.write_payload(max_wall_s=40)  # the reserve becomes 4 s
    rewritten, _ = _killed_once_its_worker_runs(layout)
    assert float(rewritten) == pytest.approx(start["started_at"] + 40 - 4, abs=0.002)
    assert _start_file(layout) == start, "the start is written once, by the first runner"


def test_a_restart_once_the_budget_is_spent_ends_the_attempt_at_once_with_deadline(
    layout: Layout,
) -> None:
    """A runner started again after its attempt's budget ran out (the first runner was
    SIGKILLed) marks the attempt `deadline` at once, exit 124: the worker does not run a
    second time."""
    layout.write_worker(WAITING_WORKER)
    layout.write_payload(max_wall_s=6)
    _killed_once_its_worker_runs(layout)
    started_by = time.time()  # the attempt started before its worker spoke
    assert layout.marker() is None
    _wait_until_epoch(started_by + 6)

    started = time.monotonic()
    again = layout.cli(*layout.run_args(), timeout=60)
    assert again.returncode == 124, again.stderr.decode()[-2000:]
    assert time.monotonic() - started < 6, "it must not wait for a fresh budget"
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, False, "deadline", "LoadPayload")
    assert marker["path"] == ["LoadPayload", "Mark"]
    assert "first start" in marker["error"] and "before this restart" in marker["error"]
    assert (layout.scratch / "runs").read_text().count("\n") == 1, "the worker ran again"
    last = again.stderr.decode().strip().splitlines()[-1]
    assert "rule deadline" in last and "before this restart" in last


def test_a_preload_restart_past_its_deadline_is_marked_deadline_without_downloading(
    layout: Layout,
) -> None:
    """A preload attempt restarted after its deadline (counted from its first start, with
    the payload's max_wall_s as rewritten) ends `deadline` at once: nothing is warmed."""
    model = layout.store / "models" / "org" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    os.mkfifo(model / "model.safetensors")  # reading it blocks: the first runner hangs
    mount = layout.root / "mnt"
    mount.mkdir()
    (mount / ".cache-mounted").write_text("")
    payload = layout.payload(
        mode="preload", models=["org/m"], phase=None, seed=None, job_spec_json=None,
        cache_mount_marker=".cache-mounted", env={"HF_TOKEN": CANARY, "HF_HOME": str(mount / "hf")},
    )
    layout.write_payload({**payload, "max_wall_s": 60})
    proc = _start(layout)
    try:
        read_until(proc.stderr, b'"to": "Preload"')
        started_by = time.time()
    finally:
        _sigkill(proc, None)
    # What the first runner began before the kill (the model's cache folder: it may get
    # that far before the signal lands) is not the restart's: only the restart is judged.
    shutil.rmtree(mount / "hf", ignore_errors=True)
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").write_bytes(b"\0" * 64)  # a fresh budget would warm it
    layout.write_payload({**payload, "max_wall_s": 1})
    _wait_until_epoch(started_by + 1)

    again = layout.cli(*layout.run_args(), timeout=60)
    assert again.returncode == 124, again.stderr.decode()[-2000:]
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, False, "deadline", "LoadPayload")
    assert "before this restart" in marker["error"]
    assert not layout.artifact("preload_result.json").exists()
    assert not (mount / "hf" / "hub" / "models--org--m").exists()
    assert _start_file(layout)["identity"]["mode"] == "preload"


# --- the start file: only this attempt's is used ------------------------------------------


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json",
         "not JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
        (json.dumps({"version": 99}), "not version 1"),
        ("OTHER_RUN", "another attempt's start (differs in run_id)"),
        ("BAD_START", "'started_at' is not a finite number"),
        ("HUGE_START", "'started_at' is not a finite number"),
    ],
)
def test_a_start_file_not_of_this_attempt_is_ignored_and_replaced(
    layout: Layout, content: str, reason: str
) -> None:
    """A start file that is malformed, of another version or of another attempt does not
    decide the budget (an old start would end the attempt at once): it is logged as
    ignored, replaced with this attempt's start, and the attempt trains."""
    layout.write_worker("complete()")
    layout.write_payload()
    ident = {"hf_repo": "org/flash-runs", "hf_prefix": "sft/run-1/seed3", "run_id": "run-1",
             "mode": "train", "flash_arm": ARM, "attempt": 0}
    long_ago = {"version": 1, "started_at": 1_000.0, "monotonic": 0.0, "boot_id": None}
    if content == "OTHER_RUN":
        content = json.dumps({**long_ago, "identity": {**ident, "run_id": "run-0"}})
    elif content == "BAD_START":
        content = json.dumps({**long_ago, "identity": ident, "started_at": "yesterday"})
    elif content == "HUGE_START":  # a JSON integer too large for a float
        content = json.dumps({**long_ago, "identity": ident, "started_at": 10**400})
    (layout.payload_path.parent / START).write_text(content)

    before = time.time()
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    [ignored] = _events(proc.stderr, "attempt.start_ignored")
    assert ignored["reason"] == reason
    start = _start_file(layout)
    assert start["identity"] == ident and start["started_at"] >= before - 1


def test_a_start_that_cannot_be_persisted_does_not_fail_the_attempt(layout: Layout) -> None:
    """A payload directory where the start cannot be written (here a directory stands in
    its place) is logged, and the attempt runs on this runner's own start."""
    layout.write_worker("complete()")
    layout.write_payload()
    (layout.payload_path.parent / START).mkdir()
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert _events(proc.stderr, "attempt.start_ignored")
    [unpersisted] = _events(proc.stderr, "attempt.start_unpersisted")
    assert unpersisted["path"].endswith(START)


# --- a wall-clock step, under libfaketime ------------------------------------------------

#: libfaketime's MT build, which the tests need. The plain one re-reads
#: FAKETIME_TIMESTAMP_FILE into shared buffers without a lock, so with FAKETIME_NO_CACHE a
#: thread of a threaded process now and then reads the clock without the step (24 of 3,060
#: readings by three threads, measured): the runner's watchdog then saw its deadline pass
#: 10 s early and the test failed on a loaded machine. Debian's (package faketime) is used
#: where it is installed; elsewhere it is built from the source that PyPI's libfaketime
#: (the test extra) vendors, whose wheel ships only the plain build.
DEBIAN_LIBFAKETIME = next(
    iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))), None
)


@pytest.fixture(scope="session")
def libfaketime_mt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The path of a libfaketimeMT.so.1: Debian's, or one built from PyPI's vendored source
    with the C compiler the test extra already needs (pygraphviz builds with it)."""
    if DEBIAN_LIBFAKETIME is not None:
        return DEBIAN_LIBFAKETIME
    try:
        import libfaketime
    except ImportError:
        pytest.skip("needs libfaketime (the test extra) or Debian's package faketime")
    vendored = Path(libfaketime.__file__).parent / "vendor" / "libfaketime" / "src"
    build = tmp_path_factory.mktemp("libfaketime") / "src"
    shutil.copytree(vendored, build)
    made = subprocess.run(["make", "-s", "-C", str(build), "libfaketimeMT.so.1"],
                          capture_output=True, text=True, timeout=300, check=False)
    if made.returncode != 0:
        pytest.skip(f"could not build libfaketimeMT from {vendored}: {made.stderr[-500:]}")
    return build / "libfaketimeMT.so.1"


STEP_S = 10.0

#: libfaketime 0.9.10 with FAKETIME_DONT_FAKE_MONOTONIC breaks clock_nanosleep on the
#: monotonic clock with TIMER_ABSTIME, which time.sleep uses since Python 3.11 (EINVAL:
#: wolfcw/libfaketime#426). Where it is broken, sleep as Python 3.10 did, with select.
SITECUSTOMIZE = '''
import select
import time

try:
    time.sleep(0)
except OSError:
    def _sleep(seconds):
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            select.select([], [], [], left)

    time.sleep = _sleep
'''

#: Run under the faked clock: the wall clock before and after a step, the monotonic too,
#: and how many readings by three threads at once missed the step (the runner is threaded).
CLOCK_PROBE = '''
import os, threading, time
from pathlib import Path
wall, mono = time.time(), time.monotonic()
Path(os.environ["FAKETIME_TIMESTAMP_FILE"]).write_text("-10\\n")
wall2, mono2 = time.time(), time.monotonic()
lead, missed = wall2 - mono2, []
def read():
    until = time.monotonic() + 0.3
    while time.monotonic() < until:
        if abs(time.time() - time.monotonic() - lead) > 1:
            missed.append(1)
readers = [threading.Thread(target=read) for _ in range(3)]
for reader in readers:
    reader.start()
for reader in readers:
    reader.join()
Path(os.environ["FAKETIME_TIMESTAMP_FILE"]).write_text("+0\\n")
print(wall2 - wall, mono2 - mono, abs(time.time() - wall - (time.monotonic() - mono)),
      len(missed))
'''


#: What libfaketime leaves in /dev/shm for a process that a signal ended (named by pid): a
#: later process under libfaketime with that pid fails to start (its README, "Cleaning up
#: shared memory").
FAKETIME_SHM = re.compile(r"(?:sem\.)?faketime_(?:shm|sem)_(\d+)")


def _faketime_leftovers() -> dict[Path, int]:
    found: dict[Path, int] = {}
    shm = Path("/dev/shm")
    for entry in shm.iterdir() if shm.is_dir() else ():
        match = FAKETIME_SHM.fullmatch(entry.name)
        if match is not None:
            found[entry] = int(match.group(1))
    return found


@pytest.fixture
def faketime(tmp_path: Path, libfaketime_mt: Path) -> Iterator[dict[str, str]]:
    """The environment that puts a process on a wall clock the test can step (through
    FAKETIME_TIMESTAMP_FILE) and a true monotonic clock, checked to do exactly that.
    Afterwards what libfaketime left behind for this test's processes is removed."""
    before = set(_faketime_leftovers())
    try:
        yield _faketime_env(tmp_path, libfaketime_mt)
    finally:
        for entry, pid in _faketime_leftovers().items():
            if entry not in before and not Path(f"/proc/{pid}").exists():
                entry.unlink(missing_ok=True)


def _faketime_env(tmp_path: Path, library: Path) -> dict[str, str]:
    site = tmp_path / "faketime-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    stamp = tmp_path / "faketime.rc"
    stamp.write_text("+0\n")
    env = {
        "LD_PRELOAD": str(library),
        "FAKETIME_TIMESTAMP_FILE": str(stamp),
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
    }
    probe = subprocess.run([sys.executable, "-c", CLOCK_PROBE], env={**os.environ, **env},
                           capture_output=True, timeout=30, check=False)
    assert probe.returncode == 0, probe.stderr.decode()[-2000:]
    wall_moved, mono_moved, back_again, missed = (float(x) for x in probe.stdout.split())
    assert wall_moved == pytest.approx(-STEP_S, abs=0.5), "time.time() is not faked"
    assert 0 <= mono_moved < 0.5, "time.monotonic() must not be faked"
    assert back_again < 0.5, "the step must undo"
    assert missed == 0, "every thread must read the stepped clock"
    return env


#: The worker steps its (and the runner's) wall clock by ``step``, says what it saw.
STEPPING_WORKER = """
    deadline = float(os.environ["FLASH_RUN_DEADLINE_AT"])
    time.sleep(1)  # a second of work: the step comes while the runner waits on its deadline
    before = time.time()
    Path(os.environ["FAKETIME_TIMESTAMP_FILE"]).write_text("{step}\\n")
    print(f"stepped {{time.time() - before:.3f}} deadline {{deadline:.3f}} !", flush=True)
"""


def _stepped(proc: subprocess.Popen[bytes]) -> tuple[float, bytes, str]:
    """How far the worker saw its wall clock step; the runner's stdout and the tail of its
    stderr (its log), once it has ended."""
    seen = read_until(proc.stdout, b" !")
    match = re.search(rb"stepped (-?[\d.]+) deadline [\d.]+ !", seen)
    assert match is not None
    out, err = proc.communicate(timeout=60)
    return float(match.group(1)), seen + out, err.decode(errors="replace")[-3000:]


def test_a_worker_that_finishes_by_its_deadline_after_a_backward_clock_step_succeeds(
    layout: Layout, faketime: dict[str, str]
) -> None:
    """The wall clock steps back 10 s while the worker runs; the worker finishes 2 s before
    its FLASH_RUN_DEADLINE_AT by its own clock, so 8 s after the runner's monotonic
    deadline: it is not stopped, and the attempt succeeds."""
    layout.write_worker(STEPPING_WORKER.format(step=f"-{STEP_S:.0f}") + """
    while time.time() < deadline - 2:
        time.sleep(0.05)
    complete()
    print(f"done {deadline - time.time():.3f} before the deadline", flush=True)
    """)
    layout.write_payload(max_wall_s=5, env={"HF_TOKEN": CANARY, "FLASH_EXIT_RESERVE_S": "1"})
    started = time.monotonic()
    proc = _start(layout, faketime)
    stepped, out, log = _stepped(proc)
    elapsed = time.monotonic() - started
    assert stepped == pytest.approx(-STEP_S, abs=0.5)
    assert proc.returncode == 0, log
    assert b"before the deadline" in out
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True and marker["worker"]["reason"] == "exited"
    assert elapsed > 5 + 1, "the worker ran past the runner's unshifted deadline"


def test_a_worker_that_overruns_after_a_backward_step_is_stopped_by_its_deadline_plus_the_step(
    layout: Layout, faketime: dict[str, str]
) -> None:
    """After a 10 s backward step, a worker that never finishes runs until its
    FLASH_RUN_DEADLINE_AT by its own clock and is stopped then: the attempt ends `deadline`
    no later than its budget plus the step."""
    layout.write_worker(STEPPING_WORKER.format(step=f"-{STEP_S:.0f}") + """
    while True:
        print(f"now {time.time():.3f}", flush=True)
        time.sleep(0.1)
    """)
    layout.write_payload(max_wall_s=4, env={"HF_TOKEN": CANARY, "FLASH_EXIT_RESERVE_S": "1"})
    started = time.monotonic()
    proc = _start(layout, faketime)
    stepped, out, log = _stepped(proc)
    elapsed = time.monotonic() - started
    assert stepped == pytest.approx(-STEP_S, abs=0.5)
    assert proc.returncode == 124, log
    marker = layout.marker()
    assert marker is not None
    assert (marker["rule"], marker["worker"]["reason"]) == ("deadline", "deadline")
    deadline = float(re.findall(rb"deadline ([\d.]+) !", out)[0])  # by the worker's clock
    last_seen = float(re.findall(rb"now ([\d.]+)", out)[-1])
    assert last_seen >= deadline - 0.5, "stopped before its deadline by its own clock"
    # The step plus a loaded machine's start and stop (CI took 15.9 s); a deadline moved by
    # twice the step, or none at all, would take 24 s or forever.
    assert elapsed < 4 + STEP_S + 4, "overran the budget by more than the step"


def test_a_forward_clock_step_stops_nothing_before_the_monotonic_deadline(
    layout: Layout, faketime: dict[str, str]
) -> None:
    """A wall clock stepped 10 s forward moves the worker's own view of its deadline, not
    the runner's: the worker is stopped at the monotonic deadline, not earlier."""
    layout.write_worker(STEPPING_WORKER.format(step=f"+{STEP_S:.0f}") + """
    while True:
        print(f"mono {time.monotonic():.3f}", flush=True)
        time.sleep(0.1)
    """)
    # 7 s: a loaded CI machine once took over 2 s to start the worker, whose deadline came
    # before its step did.
    layout.write_payload(max_wall_s=7, env={"HF_TOKEN": CANARY, "FLASH_EXIT_RESERVE_S": "1"})
    started = time.monotonic()  # the runner's start is later, on the same monotonic clock
    proc = _start(layout, faketime)
    stepped, out, log = _stepped(proc)
    assert stepped == pytest.approx(STEP_S, abs=0.5)
    assert proc.returncode == 124, log
    last_seen = float(re.findall(rb"mono ([\d.]+)", out)[-1])
    assert last_seen >= started + 6 - 0.5, "stopped before the runner's work deadline"
    # Late is not this test's question (a loaded CI machine took 7 s of a 4 s budget); a
    # deadline moved later by the step would take 7 + 10 s.
    assert time.monotonic() - started < 7 + STEP_S / 2


# --- the step arithmetic of the attempt's deadline ----------------------------------------


def test_the_attempt_deadline_moves_later_by_a_backward_wall_clock_step_up_to_the_tolerance(
) -> None:
    """Readings of the wall and monotonic clocks decide the shift: back by s seconds
    (relative to the monotonic clock since the deadline was fixed) moves it s later, at
    most CLOCK_STEP_TOLERANCE_S; a forward step moves nothing."""
    deadline = Deadline.for_attempt(1_000.0, mono_at=100.0)  # the wall clock led by 900 s
    assert deadline.step_back(wall=950.0, mono=50.0) == 0.0
    assert deadline.step_back(wall=940.0, mono=50.0) == pytest.approx(10.0)
    assert deadline.step_back(wall=960.0, mono=50.0) == 0.0
    assert deadline.step_back(wall=800.0, mono=50.0) == CLOCK_STEP_TOLERANCE_S == 60.0
    work = deadline.earlier_by(5.0)
    assert work.at == 995.0 and work.step_back(wall=940.0, mono=50.0) == pytest.approx(10.0)


def test_short_bounds_never_stretch_with_the_wall_clock() -> None:
    """Only the attempt's deadline (and what derives from it) follows the wall clock:
    ``after``, ``at_epoch`` and ``at_monotonic`` deadlines do not."""
    for bound in (Deadline.after(8), Deadline.at_epoch(time.time() + 8),
                  Deadline.at_monotonic(time.monotonic() + 8), Deadline.after(8).earlier_by(1)):
        assert bound.step_back(wall=0.0, mono=1e9) == 0.0
        assert bound.mono_at == bound._mono_at


@pytest.mark.parametrize(
    ("stepped_s", "remaining_s"),
    [(10.0, 100.0), (100.0, CLOCK_STEP_TOLERANCE_S), (-10.0, 110.0), (0.0, 100.0)],
)
def test_a_deadline_fixed_before_a_step_counts_on_the_real_clocks(
    stepped_s: float, remaining_s: float
) -> None:
    """A deadline fixed (as by a runner before a restart) when the wall clock read
    ``stepped_s`` seconds later than it does now, relative to the monotonic clock: its
    epoch is 100 s away; it falls 100 s from now for a step back within the tolerance,
    the tolerance after its monotonic anchor for a bigger one, and on its monotonic
    anchor for a forward step."""
    at = time.time() + 100.0
    deadline = Deadline.for_attempt(at, mono_at=time.monotonic() + 100.0 - stepped_s)
    assert deadline.remaining() == pytest.approx(remaining_s, abs=0.05)
    assert deadline.earlier_by(10).remaining() == pytest.approx(remaining_s - 10, abs=0.05)
    assert deadline.earliest(Deadline.after(remaining_s - 1)) is not deadline
    assert deadline.earliest(Deadline.after(remaining_s + 1)) is deadline
    assert deadline.bound(1e6) == pytest.approx(remaining_s, abs=0.05)
    assert not deadline.expired()

