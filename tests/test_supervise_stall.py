"""The stall watch of the worker supervisor (issue 23, item 1): real workers, real time.

A worker here reports the moments that matter on the system's monotonic clock (which
``time.monotonic`` reads in every process of the machine): when it printed its last line,
when it last touched its progress file. ``before_stop`` notes when it was called and whether
the worker had had a SIGTERM by then. ``stall_s`` is short (1.5 s); the runner's own rule
(at least 5 s) is its caller's.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import structlog

import fsm.worker.supervise
from fsm.clock import Deadline
from fsm.interrupt import InterruptFlag
from fsm.worker.supervise import StopReason, WorkerExit, supervise

STALL_S = 1.5
LATE_S = 2.5  # how much later than due a stall may be called on a loaded machine
STALL_CAP = re.compile(
    rb"\n--- flash-bootstrap: worker made no progress for (\d+) s; stopped ---\n$"
)

# The worker's own start: its SIGTERM handler notes the signal in a file, then it exits.
PRELUDE = """
import os, signal, sys, time
from pathlib import Path
TERM = Path(sys.argv[1])
PROGRESS = Path(sys.argv[2])
NOTES = Path(sys.argv[3])

def on_term(signum, frame):
    TERM.write_text("TERM")
    os._exit(0)

signal.signal(signal.SIGTERM, on_term)

def note(text):
    with open(NOTES, "a") as f:
        f.write(text + "\\n")

def say(text):
    note(f"said {time.monotonic()!r}")
    print(text, flush=True)

def touch(times=None):
    PROGRESS.touch()
    if times is not None:
        os.utime(PROGRESS, times)
    note(f"touched {time.monotonic()!r}")

def stuck_in_a_silent_function():
    while True:
        signal.pause()
"""


@dataclass
class Worker:
    """A worker script and the files it shares with the test."""

    argv: list[str]
    term: Path  # written by the worker's SIGTERM handler
    progress: Path  # the progress file it may touch
    notes: Path  # what it said and touched, and when

    def got_term(self) -> bool:
        return self.term.exists()

    def last(self, what: str) -> float:
        """When the worker last did ``what`` ("said", "touched"), on the monotonic clock."""
        lines = self.notes.read_text().splitlines() if self.notes.exists() else []
        times = [float(line.split()[1]) for line in lines if line.startswith(what + " ")]
        assert times, f"the worker never {what} anything"
        return times[-1]


def _worker(tmp_path: Path, body: str, prelude: str = PRELUDE) -> Worker:
    script = tmp_path / "worker.py"
    script.write_text(prelude + textwrap.dedent(body))
    term, progress, notes = tmp_path / "term", tmp_path / "progress", tmp_path / "notes"
    return Worker([sys.executable, str(script), str(term), str(progress), str(notes)],
                  term, progress, notes)


def _state(pid: int) -> bytes:
    """The process's state letter from /proc (``Z``: a zombie)."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rfind(b")") + 2 :][:1]


@dataclass
class Stops:
    """A ``before_stop`` that notes each call: the cause, when, and whether the worker had
    had a SIGTERM by then; ``then`` runs after the note (to raise, to signal...)."""

    worker: Worker
    then: Callable[[StopReason], None] | None = None
    calls: list[tuple[StopReason, float, bool]] = field(default_factory=list)

    def __call__(self, cause: StopReason) -> None:
        self.calls.append((cause, time.monotonic(), self.worker.got_term()))
        if self.then is not None:
            self.then(cause)


@pytest.fixture
def out_fd(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path / "stdout.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    yield fd
    os.close(fd)


def _run(worker: Worker, tmp_path: Path, out_fd: int, **kw: Any) -> WorkerExit:
    opts: dict[str, Any] = {
        "cwd": tmp_path,
        "env": dict(os.environ),
        "console_path": tmp_path / "console.txt",
        "deadline": Deadline.after(30),
        "stop_by": Deadline.after(40),
        "interrupt": InterruptFlag(),
        "out_fd": out_fd,
        "grace_s": 5.0,
        "stall_s": STALL_S,
        "progress_file": worker.progress,
    }
    opts.update(kw)
    return supervise(worker.argv, **opts)


#: The same start, for a worker that ignores SIGTERM.
IGNORES_TERM = PRELUDE.replace("signal.signal(signal.SIGTERM, on_term)",
                               "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
assert IGNORES_TERM != PRELUDE


SILENT = """
say("ready")
stuck_in_a_silent_function()
"""


@pytest.mark.parametrize("progress_file", ["missing", "unchanged"])
def test_a_silent_worker_is_stalled_after_stall_s_and_before_stop_comes_before_any_signal(
    tmp_path: Path, out_fd: int, progress_file: str
) -> None:
    """A worker silent after one line is stalled about stall_s after it; before_stop("stalled")
    runs before any signal reached the group; a progress file that never changes is no sign."""
    worker = _worker(tmp_path, SILENT)
    if progress_file == "unchanged":
        worker.progress.write_text("old")
    stops = Stops(worker)
    with structlog.testing.capture_logs() as logs:
        result = _run(worker, tmp_path, out_fd, before_stop=stops)
    assert (result.reason, result.returncode, result.signal) == ("stalled", 0, None)
    assert [(cause, got_term) for cause, _, got_term in stops.calls] == [("stalled", False)]
    assert worker.got_term(), "after before_stop the group got SIGTERM"
    waited = stops.calls[0][1] - worker.last("said")
    assert STALL_S <= waited < STALL_S + LATE_S
    assert result.silent_s is not None and STALL_S <= result.silent_s <= waited
    console = result.console_path.read_bytes()
    assert console.startswith(b"ready\n")
    cap = STALL_CAP.search(console)
    assert cap is not None and int(cap[1]) == round(result.silent_s)
    assert (tmp_path / "stdout.bin").read_bytes() == console, "the cap line goes to out_fd too"
    stalled = [e for e in logs if e["event"] == "worker.stalled"]
    assert len(stalled) == 1 and stalled[0]["silent_s"] >= STALL_S
    assert stalled[0]["last_sign"] == "console"
@pytest.mark.slow
def test_output_more_often_than_stall_s_is_never_a_stall(tmp_path: Path, out_fd: int) -> None:
    """A line every half stall_s for four times stall_s, then exit 0: "exited", no before_stop."""
    body = f"""
    for i in range(8):
        say(f"step {{i}}")
        time.sleep({STALL_S / 2!r})
    """
    worker = _worker(tmp_path, body)
    stops = Stops(worker)
    result = _run(worker, tmp_path, out_fd, before_stop=stops)
    assert (result.reason, result.returncode, result.silent_s) == ("exited", 0, None)
    assert stops.calls == []
    assert result.duration_s >= 4 * STALL_S
    assert result.console_path.read_bytes().endswith(b"step 7\n")
@pytest.mark.slow
def test_a_touched_progress_file_keeps_a_silent_worker_alive_until_it_is_no_longer_touched(
    tmp_path: Path, out_fd: int
) -> None:
    """Touches every 0.4 stall_s for 4 stall_s keep a silent worker going; then it is stalled."""
    body = f"""
    say("ready")
    for _ in range(10):
        touch()
        time.sleep({0.4 * STALL_S!r})
    stuck_in_a_silent_function()
    """
    worker = _worker(tmp_path, body)
    stops = Stops(worker)
    with structlog.testing.capture_logs() as logs:
        result = _run(worker, tmp_path, out_fd, before_stop=stops)
    assert result.reason == "stalled"
    called = stops.calls[0][1]
    assert called - worker.last("said") >= 4 * STALL_S, "the touches counted"
    assert STALL_S - 0.05 <= called - worker.last("touched") < STALL_S + LATE_S
    assert result.silent_s is not None and result.silent_s >= STALL_S
    assert [e["last_sign"] for e in logs if e["event"] == "worker.stalled"] == ["progress_file"]


@pytest.mark.slow
@pytest.mark.parametrize("shift_s", [-86_400.0, 86_400.0], ids=["past", "future"])
def test_a_progress_file_dated_into_the_past_or_future_is_a_sign_and_never_brings_a_stall_early(
    tmp_path: Path, out_fd: int, shift_s: float
) -> None:
    """Touches that set the modification time a day back or ahead (os.utime) still count as
    signs when it changes, and the stall comes no earlier than stall_s after the last one."""
    body = f"""
    say("ready")
    for i in range(10):
        t = time.time() + {shift_s!r} + i
        touch((t, t))
        time.sleep({0.4 * STALL_S!r})
    stuck_in_a_silent_function()
    """
    worker = _worker(tmp_path, body)
    stops = Stops(worker)
    result = _run(worker, tmp_path, out_fd, before_stop=stops)
    assert result.reason == "stalled"
    called = stops.calls[0][1]
    assert called - worker.last("said") >= 4 * STALL_S, "the touches counted"
    assert STALL_S - 0.05 <= called - worker.last("touched") < STALL_S + LATE_S


class _SteppedTime(ModuleType):
    """``time`` as fsm.worker.supervise sees it, its wall clock stepped by ``step_s`` once the
    worker said ``stepping``: a stand-in for the host's clock being set."""

    def __init__(self, step_s: float) -> None:
        super().__init__("time")
        self.step_s = step_s
        self.stepped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def time(self) -> float:
        return time.time() + (self.step_s if self.stepped else 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("step_s", [-3600.0, 3600.0], ids=["back", "forward"])
def test_a_wall_clock_step_does_not_stall_a_worker_that_touches_its_progress_file(
    tmp_path: Path, out_fd: int, monkeypatch: pytest.MonkeyPatch, step_s: float
) -> None:
    """The runner's wall clock stepping by an hour mid-run neither ends the touches' worth
    nor brings the stall before stall_s after the last touch."""
    body = f"""
    say("ready")
    for i in range(10):
        touch()
        if i == 3:
            say("stepping")
        time.sleep({0.4 * STALL_S!r})
    stuck_in_a_silent_function()
    """
    worker = _worker(tmp_path, body)
    clock = _SteppedTime(step_s)
    monkeypatch.setattr(fsm.worker.supervise, "time", clock)
    stops = Stops(worker)

    def step(chunk: bytes) -> None:
        if b"stepping" in chunk:
            clock.stepped = True

    result = _run(worker, tmp_path, out_fd, before_stop=stops, on_output=step)
    assert clock.stepped
    assert result.reason == "stalled"
    called = stops.calls[0][1]
    assert called - worker.last("said") >= 2 * STALL_S, "the touches after the step counted"
    # A touch the step makes undatable is dated when it is seen: late, never early.
    assert STALL_S - 0.05 <= called - worker.last("touched") < 2 * STALL_S + LATE_S


def test_with_stall_s_0_a_silent_worker_runs_to_its_own_exit(tmp_path: Path, out_fd: int) -> None:
    """stall_s=0 turns the watch off: a worker silent for twice 1.5 s still ends by its exit."""
    body = f"""
    say("ready")
    time.sleep({2 * STALL_S!r})
    """
    worker = _worker(tmp_path, body)
    stops = Stops(worker)
    result = _run(worker, tmp_path, out_fd, stall_s=0, before_stop=stops)
    assert (result.reason, result.returncode, result.silent_s) == ("exited", 0, None)
    assert stops.calls == []


def test_with_stall_s_0_a_silent_worker_runs_to_the_deadline(tmp_path: Path, out_fd: int) -> None:
    """With the watch off, only the deadline stops a silent worker (and before_stop says so)."""
    worker = _worker(tmp_path, SILENT)
    stops = Stops(worker)
    result = _run(worker, tmp_path, out_fd, stall_s=0, before_stop=stops,
                  deadline=Deadline.after(2 * STALL_S))
    assert (result.reason, result.silent_s) == ("deadline", None)
    assert [(cause, got_term) for cause, _, got_term in stops.calls] == [("deadline", False)]
    assert result.duration_s >= 2 * STALL_S - 0.1


def test_the_deadline_calls_before_stop_before_any_signal(tmp_path: Path, out_fd: int) -> None:
    """At the deadline (the watch on, not due) before_stop("deadline") runs before SIGTERM."""
    body = """
    while True:
        say("alive")
        time.sleep(0.2)
    """
    worker = _worker(tmp_path, body)
    stops = Stops(worker)
    result = _run(worker, tmp_path, out_fd, before_stop=stops, deadline=Deadline.after(1.0))
    assert (result.reason, result.returncode, result.silent_s) == ("deadline", 0, None)
    assert [(cause, got_term) for cause, _, got_term in stops.calls] == [("deadline", False)]
    assert worker.got_term()
    assert result.console_path.read_bytes().endswith(
        b"--- flash-bootstrap: worker hit the run wall deadline; stopped ---\n"
    )


def test_an_interrupt_before_the_stall_is_called_is_an_interrupt_without_before_stop(
    tmp_path: Path, out_fd: int
) -> None:
    """A signal that comes while the worker is silent, before stall_s, is "interrupted", and
    before_stop is not called for it (the host is going away)."""
    worker = _worker(tmp_path, SILENT)
    stops = Stops(worker)
    flag = InterruptFlag()

    def interrupt(chunk: bytes) -> None:
        if b"ready" in chunk:
            flag.trigger(signal.SIGTERM)

    result = _run(worker, tmp_path, out_fd, before_stop=stops, interrupt=flag,
                  on_output=interrupt)
    assert (result.reason, result.silent_s) == ("interrupted", None)
    assert stops.calls == []
    assert result.duration_s < STALL_S
    assert result.console_path.read_bytes().endswith(
        b"--- flash-bootstrap: runner got SIGTERM; worker stopped ---\n"
    )


def test_a_signal_after_the_stall_was_called_keeps_the_stall_and_cuts_the_grace(
    tmp_path: Path, out_fd: int
) -> None:
    """A signal arriving while before_stop runs leaves the reason "stalled"; the grace then
    ends signal_stop_s after the signal, not after grace_s."""
    worker = _worker(tmp_path, SILENT, prelude=IGNORES_TERM)
    flag = InterruptFlag()
    stops = Stops(worker, then=lambda _cause: flag.trigger(signal.SIGTERM))
    result = _run(worker, tmp_path, out_fd, before_stop=stops, interrupt=flag,
                  grace_s=30.0, signal_stop_s=0.5)
    returned = time.monotonic()
    assert (result.reason, result.signal) == ("stalled", signal.SIGKILL)
    assert flag.at_mono is not None and returned - flag.at_mono < 0.5 + 2.0
    assert STALL_CAP.search(result.console_path.read_bytes())


def test_a_signal_during_the_grace_after_a_stall_cuts_it(tmp_path: Path, out_fd: int) -> None:
    """A signal that comes after SIGTERM went to a stalled group ends the grace signal_stop_s
    after it; the reason stays "stalled"."""
    prelude = PRELUDE.replace("    os._exit(0)\n", "    print('got TERM', flush=True)\n")
    worker = _worker(tmp_path, SILENT, prelude=prelude)
    flag = InterruptFlag()

    def interrupt(chunk: bytes) -> None:
        if b"got TERM" in chunk:
            flag.trigger(signal.SIGINT)

    result = _run(worker, tmp_path, out_fd, interrupt=flag, on_output=interrupt,
                  grace_s=30.0, signal_stop_s=0.5)
    returned = time.monotonic()
    assert (result.reason, result.signal) == ("stalled", signal.SIGKILL)
    assert flag.at_mono is not None and returned - flag.at_mono < 0.5 + 2.0
    assert STALL_CAP.search(result.console_path.read_bytes())


def test_a_stalled_worker_that_ignores_sigterm_is_killed_after_the_grace(
    tmp_path: Path, out_fd: int
) -> None:
    """After a stall: SIGTERM, the grace, SIGKILL to the group; the reason stays "stalled"."""
    worker = _worker(tmp_path, SILENT, prelude=IGNORES_TERM)
    stops = Stops(worker)
    result = _run(worker, tmp_path, out_fd, before_stop=stops, grace_s=1.0)
    assert (result.reason, result.returncode, result.signal) == ("stalled", None, signal.SIGKILL)
    assert not worker.got_term()
    assert result.silent_s is not None
    assert STALL_S + 1.0 <= result.duration_s < STALL_S + 1.0 + LATE_S + 1.0
    assert STALL_CAP.search(result.console_path.read_bytes())


def test_a_before_stop_that_raises_does_not_keep_the_worker_running(
    tmp_path: Path, out_fd: int
) -> None:
    """An exception from before_stop is logged, and the stalled worker is stopped all the same."""
    worker = _worker(tmp_path, SILENT)

    def fail(_cause: StopReason) -> None:
        raise RuntimeError("py-spy exploded")

    stops = Stops(worker, then=fail)
    with structlog.testing.capture_logs() as logs:
        result = _run(worker, tmp_path, out_fd, before_stop=stops)
    assert (result.reason, result.returncode) == ("stalled", 0)
    assert len(stops.calls) == 1
    assert worker.got_term()
    failed = [e for e in logs if e["event"] == "worker.before_stop_failed"]
    assert [(e["why"], e["error"]) for e in failed] == [
        ("stalled", "RuntimeError: py-spy exploded")
    ]


def test_a_worker_that_exits_while_before_stop_runs_still_stalled(
    tmp_path: Path, out_fd: int
) -> None:
    """Once the stall is called, the leader's exit during before_stop is not its own exit:
    the reason stays "stalled", with the exit status it had."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    body = f"""
    say("ready")
    open({str(fifo)!r}).read()
    sys.exit(7)
    """
    worker = _worker(tmp_path, body)
    group: list[int | None] = []

    def release_and_wait_for_the_exit(_cause: StopReason) -> None:
        with open(fifo, "w") as f:
            f.write("go")
        leader = group[0]
        assert leader is not None
        give_up = time.monotonic() + 10
        while _state(leader) != b"Z":  # a zombie: exited, not reaped yet
            assert time.monotonic() < give_up, "the worker did not exit"
            time.sleep(0.01)

    stops = Stops(worker, then=release_and_wait_for_the_exit)
    result = _run(worker, tmp_path, out_fd, before_stop=stops, on_group=group.append)
    assert (result.reason, result.returncode) == ("stalled", 7)
    assert not worker.got_term()


def test_a_negative_stall_s_is_refused(tmp_path: Path, out_fd: int) -> None:
    """stall_s below 0 (or NaN) is a caller's bug: ValueError, nothing started."""
    worker = _worker(tmp_path, SILENT)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="stall_s"):
            _run(worker, tmp_path, out_fd, stall_s=bad)
    assert not worker.notes.exists()


def test_the_progress_file_is_looked_at_only_when_the_watch_is_due(
    tmp_path: Path, out_fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the console moves the watch is never due: over 3 s of output every 50 ms, the
    progress file is looked at once, at the start, and never again."""
    body = """
    for i in range(60):
        say(f"line {i}")
        time.sleep(0.05)
    """
    worker = _worker(tmp_path, body)
    looks: list[float] = []
    real_stat = os.stat

    class _CountingOs(ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        def stat(self, path: Any, *args: Any, **kw: Any) -> os.stat_result:
            if Path(path) == worker.progress:
                looks.append(time.monotonic())
            return real_stat(path, *args, **kw)

    monkeypatch.setattr(fsm.worker.supervise, "os", _CountingOs("os"))
    result = _run(worker, tmp_path, out_fd, stall_s=1.0)
    monkeypatch.undo()
    assert result.reason == "exited"
    assert len(looks) == 1, looks
