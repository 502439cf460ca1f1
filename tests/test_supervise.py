"""The worker supervisor: real worker processes, real signals, real pipes."""

from __future__ import annotations

import os
import re
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm.clock import Deadline
from fsm.interrupt import InterruptFlag
from fsm.worker.supervise import WorkerExit, read_tail, supervise

DEADLINE_CAP = b"--- flash-bootstrap: worker hit the run wall deadline; stopped ---\n"

# A worker that ignores SIGTERM from its first instruction on: the test process ignores it
# while supervise() starts the worker, and an ignored signal stays ignored across exec.
IGNORES_TERM = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"

SPAWN_SLEEPER = """
import subprocess, sys
def sleeper(**kw):
    code = "import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.pause()"
    return subprocess.Popen([sys.executable, "-c", code], **kw)
"""


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie holds no memory, fds or GPU)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


def _worker(tmp_path: Path, body: str, name: str = "worker.py") -> list[str]:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


class _Reader:
    """Reads a pipe to EOF on a thread; ``seen(marker)`` waits for bytes to show up."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.data = bytearray()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while chunk := os.read(self.read_fd, 1 << 16):
            with self._cond:
                self.data += chunk
                self._cond.notify_all()

    def seen(self, marker: bytes, timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: marker in self.data, timeout)

    def close(self) -> bytes:
        os.close(self.write_fd)
        self._thread.join(10)
        os.close(self.read_fd)
        return bytes(self.data)


@pytest.fixture
def out_file(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    path = tmp_path / "stdout.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    yield fd, path
    os.close(fd)


def _run(argv: list[str], tmp_path: Path, out_fd: int, **kw: Any) -> WorkerExit:
    opts: dict[str, Any] = {
        "cwd": tmp_path,
        "env": dict(os.environ),
        "console_path": tmp_path / "console.txt",
        "deadline": Deadline.after(20),
        "stop_by": Deadline.after(25),
        "interrupt": InterruptFlag(),
        "out_fd": out_fd,
        "grace_s": 5.0,
    }
    opts.update(kw)
    return supervise(argv, **opts)


@contextmanager
def _sigterm(handler: Callable[[int, Any], None] | int) -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_exit_code_is_reported(tmp_path: Path, out_file: tuple[int, Path]) -> None:
    """A worker's own exit status comes back with reason "exited"."""
    result = _run(_worker(tmp_path, "import sys; sys.exit(3)"), tmp_path, out_file[0])
    assert (result.reason, result.returncode, result.signal) == ("exited", 3, None)
    assert result.console_path == tmp_path / "console.txt"


def test_on_group_names_the_group_until_the_leader_is_reaped(
    tmp_path: Path, out_file: tuple[int, Path]
) -> None:
    """on_group gets the worker's group id at start and None while that id is still its own."""
    calls: list[tuple[int | None, bool]] = []

    def on_group(pgid: int | None) -> None:
        leader = calls[0][0] if calls else None
        calls.append((pgid, leader is not None and Path(f"/proc/{leader}").exists()))

    argv = _worker(tmp_path, "import os; print('group', os.getpgrp(), os.getpid())")
    result = _run(argv, tmp_path, out_file[0], on_group=on_group)
    group, pid = map(int, re.findall(rb"group (\d+) (\d+)", result.console_path.read_bytes())[0])
    assert group == pid, "the worker leads its own group"
    assert calls == [(group, False), (None, True)]


def test_death_by_signal_is_reported(tmp_path: Path, out_file: tuple[int, Path]) -> None:
    """A worker killed by a signal reports the signal number, not a return code."""
    argv = _worker(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    result = _run(argv, tmp_path, out_file[0])
    assert (result.reason, result.returncode, result.signal) == ("exited", None, signal.SIGKILL)


BINARY_WORKER = """
import os
blob = bytes(range(256)) * 4096 + b"\\xff\\xfe\\xc3(\\x80 not utf-8"
os.write(1, blob)
os.write(2, b"\\n-- stderr \\xe2\\x82 half a euro")
os.write(1, blob[::-1])
"""


def _binary_expected() -> bytes:
    blob = bytes(range(256)) * 4096 + b"\xff\xfe\xc3(\x80 not utf-8"
    return blob + b"\n-- stderr \xe2\x82 half a euro" + blob[::-1]


def test_binary_output_is_byte_exact_with_a_file(
    tmp_path: Path, out_file: tuple[int, Path]
) -> None:
    """Any bytes on stdout and stderr land unchanged, in order, in the console and out_fd."""
    fd, path = out_file
    result = _run(_worker(tmp_path, BINARY_WORKER), tmp_path, fd)
    expected = _binary_expected()
    assert result.returncode == 0
    assert (tmp_path / "console.txt").read_bytes() == expected
    assert path.read_bytes() == expected
    assert result.console_bytes == len(expected)


def test_binary_output_is_byte_exact_with_a_pipe(tmp_path: Path) -> None:
    """The same holds when out_fd is a pipe (the container's stdout usually is)."""
    reader = _Reader()
    result = _run(_worker(tmp_path, BINARY_WORKER), tmp_path, reader.write_fd)
    assert result.returncode == 0
    assert reader.close() == _binary_expected()
    assert (tmp_path / "console.txt").read_bytes() == _binary_expected()


def test_a_broken_out_fd_does_not_stop_the_console(tmp_path: Path) -> None:
    """When stdout breaks, the pump drops it and keeps the console file complete."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # writes now fail with EPIPE
    try:
        with structlog.testing.capture_logs() as logs:
            result = _run(_worker(tmp_path, BINARY_WORKER), tmp_path, write_fd)
    finally:
        os.close(write_fd)
    assert result.returncode == 0
    assert result.console_path.read_bytes() == _binary_expected()
    failed = [e for e in logs if e["event"] == "worker.console_write_failed"]
    assert [e["target"] for e in failed] == ["out"]


def test_grandchild_holding_the_pipe_is_killed(tmp_path: Path, out_file: tuple[int, Path]) -> None:
    """A descendant that keeps the console pipe open after the leader exits is killed."""
    body = SPAWN_SLEEPER + "print('grandchild', sleeper().pid, flush=True)\n"
    t0 = time.monotonic()
    result = _run(_worker(tmp_path, body), tmp_path, out_file[0], drain_timeout_s=0.3)
    elapsed = time.monotonic() - t0
    grandchild = int(re.findall(rb"grandchild (\d+)", result.console_path.read_bytes())[0])
    assert not _alive(grandchild)
    assert (result.reason, result.returncode) == ("exited", 0)
    assert elapsed < 5.0


def test_grandchild_with_redirected_output_is_killed(
    tmp_path: Path, out_file: tuple[int, Path]
) -> None:
    """A descendant in the worker's group is killed even when it no longer holds the pipe."""
    body = SPAWN_SLEEPER + (
        "import subprocess\n"
        "p = sleeper(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print('grandchild', p.pid, flush=True)\n"
    )
    t0 = time.monotonic()
    result = _run(_worker(tmp_path, body), tmp_path, out_file[0], drain_timeout_s=3.0)
    elapsed = time.monotonic() - t0
    grandchild = int(re.findall(rb"grandchild (\d+)", result.console_path.read_bytes())[0])
    assert not _alive(grandchild)
    assert result.reason == "exited"
    assert elapsed < 2.5, "the pipe closed at once: no need to wait for the drain timeout"


def test_deadline_stops_a_worker_that_ignores_sigterm(tmp_path: Path) -> None:
    """At the deadline: SIGTERM, grace, SIGKILL to the group, and the cap line is appended."""
    body = (
        IGNORES_TERM
        + SPAWN_SLEEPER
        + (
            "import subprocess\n"
            "p = sleeper(stdout=subprocess.DEVNULL)\n"
            "print('grandchild', p.pid, end='', flush=True)\n"  # no newline: the cap line adds one
            "signal.pause()\n"
        )
    )
    reader = _Reader()
    with _sigterm(signal.SIG_IGN):
        result = _run(
            _worker(tmp_path, body),
            tmp_path,
            reader.write_fd,
            deadline=Deadline.after(1.0),
            grace_s=0.5,
        )
    out = reader.close()
    console = result.console_path.read_bytes()
    grandchild = int(re.findall(rb"grandchild (\d+)", console)[0])
    assert (result.reason, result.returncode, result.signal) == ("deadline", None, signal.SIGKILL)
    assert console.endswith(b"\n" + DEADLINE_CAP)
    assert out.endswith(b"\n" + DEADLINE_CAP)
    assert result.console_bytes == len(console)
    assert not _alive(grandchild)
    assert 1.4 <= result.duration_s < 4.0


def test_grace_never_runs_past_stop_by(tmp_path: Path, out_file: tuple[int, Path]) -> None:
    """A long grace is cut at the attempt deadline: SIGKILL comes at stop_by."""
    argv = _worker(tmp_path, IGNORES_TERM + "signal.pause()\n")
    with _sigterm(signal.SIG_IGN):
        result = _run(
            argv,
            tmp_path,
            out_file[0],
            deadline=Deadline.after(0.5),
            stop_by=Deadline.after(1.0),
            grace_s=60.0,
        )
    assert (result.reason, result.signal) == ("deadline", signal.SIGKILL)
    assert result.duration_s < 3.0


OBEDIENT = "import signal\nprint('ready', flush=True)\nsignal.pause()\n"


def test_interrupt_from_another_thread_stops_the_worker_promptly(tmp_path: Path) -> None:
    """An interrupt forwards SIGTERM at once; the call returns soon after the worker dies."""
    flag = InterruptFlag()
    reader = _Reader()
    fired: list[float] = []

    def interrupt_when_ready() -> None:
        assert reader.seen(b"ready")
        fired.append(time.monotonic())
        flag.trigger(signal.SIGTERM)

    threading.Thread(target=interrupt_when_ready, daemon=True).start()
    result = _run(_worker(tmp_path, OBEDIENT), tmp_path, reader.write_fd, interrupt=flag)
    returned = time.monotonic()
    out = reader.close()
    assert (result.reason, result.signal) == ("interrupted", signal.SIGTERM)
    assert returned - fired[0] < 0.5
    cap = b"--- flash-bootstrap: runner got SIGTERM; worker stopped ---\n"
    assert result.console_path.read_bytes() == b"ready\n" + cap
    assert out == b"ready\n" + cap


def test_real_sigterm_to_the_runner_stops_the_worker_promptly(tmp_path: Path) -> None:
    """SIGTERM delivered to this process, through a handler that triggers the flag."""
    flag = InterruptFlag()
    reader = _Reader()
    fired: list[float] = []

    def signal_when_ready() -> None:
        assert reader.seen(b"ready")
        fired.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    with _sigterm(lambda signum, _frame: flag.trigger(signum)):
        threading.Thread(target=signal_when_ready, daemon=True).start()
        result = _run(_worker(tmp_path, OBEDIENT), tmp_path, reader.write_fd, interrupt=flag)
        returned = time.monotonic()
    reader.close()
    assert (result.reason, result.signal) == ("interrupted", signal.SIGTERM)
    assert returned - fired[0] < 0.5
    flag.trigger(signal.SIGTERM)  # the listener is gone: a later trigger reaches nothing


def test_interrupted_before_start_launches_nothing(
    tmp_path: Path, out_file: tuple[int, Path]
) -> None:
    """A flag set before the call (its trigger was not delivered to us) is still honoured."""
    flag = InterruptFlag()
    flag.trigger(signal.SIGINT)
    marker = tmp_path / "started"
    argv = _worker(tmp_path, f"open({str(marker)!r}, 'w').close()")
    result = _run(argv, tmp_path, out_file[0], interrupt=flag)
    assert (result.reason, result.returncode, result.signal) == ("interrupted", None, None)
    assert not marker.exists()
    assert b"runner got SIGINT" in result.console_path.read_bytes()


def test_deadline_passed_before_start_launches_nothing(
    tmp_path: Path, out_file: tuple[int, Path]
) -> None:
    """No worker is started once its deadline has passed; the console says why."""
    marker = tmp_path / "started"
    argv = _worker(tmp_path, f"open({str(marker)!r}, 'w').close()")
    result = _run(argv, tmp_path, out_file[0], deadline=Deadline.after(-1))
    assert result.reason == "deadline"
    assert not marker.exists()
    assert result.console_path.read_bytes() == DEADLINE_CAP


def test_name_says_what_runs_in_events_and_cap_lines(
    tmp_path: Path, out_file: tuple[int, Path]
) -> None:
    """With ``name`` (the installer's "pip") the events and cap lines name it, not the worker."""
    argv = _worker(tmp_path, "import time; time.sleep(30)")
    with structlog.testing.capture_logs() as logs:
        result = _run(argv, tmp_path, out_file[0], deadline=Deadline.after(0.5), name="pip")
    assert result.reason == "deadline"
    events = [e["event"] for e in logs]
    assert {"pip.started", "pip.stopping", "pip.exited"} <= set(events)
    assert not [e for e in events if e.startswith("worker.")]
    cap = b"--- flash-bootstrap: pip hit the run wall deadline; stopped ---\n"
    assert result.console_path.read_bytes() == cap
    flag = InterruptFlag()
    flag.trigger(signal.SIGINT)
    result = _run(argv, tmp_path, out_file[0], interrupt=flag, name="pip")
    cap = b"--- flash-bootstrap: runner got SIGINT; pip stopped ---\n"
    assert result.console_path.read_bytes() == cap


def test_launch_failures_raise_oserror(tmp_path: Path, out_file: tuple[int, Path]) -> None:
    """No such executable, or no such working directory: OSError to the caller."""
    with pytest.raises(OSError, match="no-such"):
        _run([str(tmp_path / "no-such-program")], tmp_path, out_file[0])
    with pytest.raises(OSError, match="no-such"):
        _run([sys.executable, "-c", "pass"], tmp_path, out_file[0], cwd=tmp_path / "no-such")


def test_read_tail_returns_exactly_the_last_bytes(tmp_path: Path) -> None:
    """The last N bytes of a large file; the whole of a short one; nothing for N = 0."""
    data = os.urandom(300_000)
    big = tmp_path / "big"
    big.write_bytes(data)
    assert read_tail(big) == data[-64_000:]
    assert read_tail(big, 10) == data[-10:]
    assert read_tail(big, 0) == b""
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    assert read_tail(short) == b"abc"
    (tmp_path / "empty").write_bytes(b"")
    assert read_tail(tmp_path / "empty") == b""


def test_read_tail_seeks_instead_of_reading(tmp_path: Path) -> None:
    """On a 64 GiB (sparse) console the tail is still instant: nothing before it is read."""
    huge = tmp_path / "huge"
    with open(huge, "wb") as f:
        try:
            f.truncate(64 << 30)
        except OSError:
            pytest.skip("no sparse files on this filesystem")
        f.seek(0, os.SEEK_END)
        f.write(b"the end")
    t0 = time.monotonic()
    tail = read_tail(huge)
    assert time.monotonic() - t0 < 1.0
    assert tail == b"\0" * (64_000 - 7) + b"the end"


@settings(max_examples=50, deadline=None)
@given(data=st.binary(max_size=5000), limit=st.integers(min_value=0, max_value=6000))
def test_read_tail_matches_slicing(data: bytes, limit: int) -> None:
    """read_tail(path, n) is the file's bytes [-n:], whatever the sizes."""
    import tempfile

    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        assert read_tail(Path(f.name), limit) == (data[-limit:] if limit else b"")


def _fifo_worker(tmp_path: Path) -> tuple[list[str], Path]:
    """A worker that prints, then waits until the test writes to its FIFO, then exits."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    body = f"print('hello from the worker', flush=True)\nopen({str(fifo)!r}).read()\n"
    return _worker(tmp_path, body), fifo


def _release(fifo: Path) -> None:
    with open(fifo, "w") as f:
        f.write("go")


def test_raising_tail_sink_is_logged_and_swallowed(
    tmp_path: Path, out_file: tuple[int, Path]
) -> None:
    """A sink that raises never stops the worker or the uploads after it."""
    argv, fifo = _fifo_worker(tmp_path)
    tails: list[bytes] = []

    def sink(tail: bytes) -> None:
        tails.append(tail)
        if sum(b"hello from the worker" in t for t in tails) == 2:
            threading.Thread(target=_release, args=(fifo,), daemon=True).start()
        raise ConnectionError("store down")

    with structlog.testing.capture_logs() as logs:
        result = _run(argv, tmp_path, out_file[0], tail_sink=sink, tail_interval_s=0.01)
    assert (result.reason, result.returncode) == ("exited", 0)
    assert b"hello from the worker\n" in tails
    failures = [e for e in logs if e["event"] == "worker.tail_upload_failed"]
    assert failures
    assert "ConnectionError: store down" in failures[0]["error"]


def test_blocked_tail_sink_does_not_hold_up_the_worker(
    tmp_path: Path, out_file: tuple[int, Path]
) -> None:
    """The worker runs and the call returns while a sink call hangs; hung ticks are skipped."""
    argv, fifo = _fifo_worker(tmp_path)
    unblock = threading.Event()
    calls: list[bytes] = []

    def sink(tail: bytes) -> None:
        calls.append(tail)
        threading.Thread(target=_release, args=(fifo,), daemon=True).start()
        unblock.wait(30)

    try:
        result = _run(argv, tmp_path, out_file[0], tail_sink=sink, tail_interval_s=0.01)
        assert (result.reason, result.returncode) == ("exited", 0)
        assert len(calls) == 1
        assert not unblock.is_set()
        assert result.console_path.read_bytes() == b"hello from the worker\n"
    finally:
        unblock.set()
