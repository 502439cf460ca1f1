"""The stacks of the worker's group (issue 23, item 2): real processes, the real py-spy.

A worker group here is a real Python leader running ``code/flash/engine/worker/__main__.py``
(its main thread blocked in a function with a distinctive name, a second thread blocked in
another) with a ``sleep`` child. The only stand-ins for py-spy are scripts: one that hangs,
and wrappers around the real one (that drop privileges, or that refuse or hang on
``--native``); the stacks always come from the real py-spy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import Layout, read_until

from fsm.output.redact import Redactor
from fsm.worker.procs import group_members
from fsm.worker.stacks import Stacks, artifact_name, capture, find_py_spy

PY_SPY = find_py_spy()
needs_py_spy = pytest.mark.skipif(PY_SPY is None, reason="py-spy is not installed")

SECRET = "hf_stacksCanary0123456789abcdef"

WORKER = """\
import os, subprocess, sys, threading

def helper_thread_waits_here(event):
    event.wait()

def stuck_in_a_distinctive_function(fd):
    os.read(fd, 1)  # STUCK

def waits_in_a_library_from_a_distinctive_function(event):
    event.wait()  # LIBRARY

event = threading.Event()
threading.Thread(target=helper_thread_waits_here, args=(event,), name="helper-thread").start()
child = subprocess.Popen(["sleep", "3600"])
r, w = os.pipe()
print("ready", child.pid, flush=True)
if sys.argv[1] == "read":
    stuck_in_a_distinctive_function(r)
else:
    waits_in_a_library_from_a_distinctive_function(event)
"""
WORKER_FILE = "flash/engine/worker/__main__.py"


def _line_of(marker: str) -> int:
    return next(i for i, line in enumerate(WORKER.splitlines(), 1) if marker in line)


@dataclass
class Group:
    """A running worker group: the leader, its ``sleep`` child, the code directory."""

    leader: subprocess.Popen[bytes]
    child: int
    code_dir: Path

    @property
    def pids(self) -> list[int]:
        return [self.leader.pid, self.child]

    def capture(self, **kw: Any) -> Stacks:
        kw.setdefault("redact", Redactor([SECRET]).text)
        return capture(self.pids, leader=self.leader.pid, code_dir=self.code_dir, **kw)


@contextmanager
def worker_group(tmp_path: Path, mode: str = "read") -> Iterator[Group]:
    code = tmp_path / "code"
    (code / WORKER_FILE).parent.mkdir(parents=True)
    (code / WORKER_FILE).write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flash.engine.worker", mode, f"--token={SECRET}"],
        cwd=code, env=env, stdout=subprocess.PIPE, start_new_session=True,
    )
    try:
        seen = read_until(proc.stdout, b"\n", timeout=30)
        child = int(seen.split()[1])
        yield Group(proc, child, code)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


def section(stacks: Stacks, pid: int) -> str:
    found = [p.text for p in stacks.processes if p.pid == pid]
    assert len(found) == 1, [p.pid for p in stacks.processes]
    return found[0]


def why(stacks: Stacks, pid: int) -> str | None:
    return next(p.why for p in stacks.processes if p.pid == pid)


def proc_state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rfind(b")") + 2 :].split()[0].decode()


def status_state(pid: int) -> str:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                if x.startswith("State:"))
    return line.partition(":")[2].strip()


def tids(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


def fake(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return str(path)


def wait_gone(pgids: list[int], timeout: float = 10) -> list[int]:
    """Polls (bounded) until no live process is left in these groups; returns the rest."""
    give_up = time.monotonic() + timeout
    while True:
        left = [pid for pgid in pgids for pid in group_members(pgid)]
        if not left or time.monotonic() > give_up:
            return left
        time.sleep(0.05)


# --- a real group, the real py-spy -------------------------------------------------------------


@needs_py_spy
def test_every_process_and_thread_of_the_group_is_named_and_where_is_the_workers_frame(
    tmp_path: Path,
) -> None:
    """Every pid with its command line and method; every thread of the Python leader with
    its frames; ``where`` is the stuck function, relative to the code directory; the ``sleep``
    child gets the /proc fallback with its state and wait channel."""
    with worker_group(tmp_path) as group:
        leader, child = group.leader.pid, group.child
        assert group_members(leader) == [leader, child]
        stacks = group.capture()

        lead = section(stacks, leader)
        assert lead.startswith(f"== process {leader} (the worker) ==\n")
        assert "-m flash.engine.worker read --token=" in lead
        assert next(p.method for p in stacks.processes if p.pid == leader) == "py-spy --native"
        assert "\nmethod: py-spy --native\n" in lead
        for tid in tids(leader):
            assert f"\nThread {tid} (idle): " in lead
        assert f'\nThread {leader} (idle): "MainThread"\n' in lead
        assert '"helper-thread"' in lead
        code = group.code_dir / WORKER_FILE
        assert (f"    stuck_in_a_distinctive_function ({code}:{_line_of('# STUCK')})\n"
                in lead)
        assert "    helper_thread_waits_here (" in lead
        assert stacks.where == (
            f"stuck_in_a_distinctive_function ({WORKER_FILE}:{_line_of('# STUCK')})")
        assert stacks.where_in_code == stacks.where

        sleeper = section(stacks, child)
        assert sleeper.startswith(f"== process {child} ==\ncommand line: sleep 3600\n")
        assert "\nmethod: proc (py-spy: not a Python process)\n" in sleeper
        assert f"\nState: {status_state(child)}\n" in sleeper
        assert f"\nwchan: {Path(f'/proc/{child}/wchan').read_text().strip()}\n" in sleeper
        assert f"\nkernel stack (/proc/{child}/stack):\n" in sleeper

        assert stacks.text.startswith("flash-bootstrap: stacks of the worker's process group")
        assert f"\nwhere: {stacks.where}\n" in stacks.text
        assert lead in stacks.text and sleeper in stacks.text
        assert stacks.evidence()["processes"] == [
            {"pid": leader, "method": "py-spy --native"},
            {"pid": child, "method": "proc", "why": "py-spy: not a Python process"},
        ]
        assert artifact_name("sft") == "stacks_sft.txt"


@needs_py_spy
def test_the_stacks_are_taken_without_stopping_any_process(tmp_path: Path) -> None:
    """After a capture with py-spy (which pauses each target for its dump), every process of
    the group is still alive and not stopped, and the worker still runs Python."""
    with worker_group(tmp_path) as group:
        stacks = group.capture()
        assert [p.method for p in stacks.processes] == ["py-spy --native", "proc"]
        for pid in group.pids:
            assert proc_state(pid) not in ("T", "t", "Z", "X"), (pid, proc_state(pid))
        # the leader's main thread still reads its pipe: its stack is the same a second time
        assert group.capture(native=False).where == stacks.where
        assert group.leader.poll() is None


@needs_py_spy
def test_where_is_the_innermost_frame_even_in_a_library_and_where_in_code_the_workers(
    tmp_path: Path,
) -> None:
    """A main thread waiting in ``threading``: ``where`` is that frame (absolute path,
    outside the code), ``where_in_code`` the worker's own function that called it."""
    with worker_group(tmp_path, mode="library") as group:
        stacks = group.capture()
    assert stacks.where is not None
    assert stacks.where.startswith("Condition.wait (/"), stacks.where
    assert "threading.py:" in stacks.where
    assert stacks.where_in_code == (
        f"waits_in_a_library_from_a_distinctive_function ({WORKER_FILE}:"
        f"{_line_of('# LIBRARY')})")


@needs_py_spy
def test_a_py_spy_that_refuses_native_gives_plain_stacks_and_is_not_asked_again(
    tmp_path: Path,
) -> None:
    """A py-spy without ``--native`` (a usage error, exit 2): the leader's stacks come from
    plain py-spy, saying why, and the next process is asked without ``--native``."""
    log = tmp_path / "calls"
    wrapper = fake(tmp_path, "py-spy-no-native", f"""\
        echo "$*" >> {log}
        case " $* " in *" --native "*)
            echo "error: unexpected argument '--native' found" >&2; exit 2;;
        esac
        exec {PY_SPY} "$@"
        """)
    with worker_group(tmp_path) as group:
        stacks = group.capture(py_spy=wrapper, parallel=1)
    lead = section(stacks, group.leader.pid)
    assert "\nmethod: py-spy (--native: failed (exit 2))\n" in lead
    assert "unexpected argument '--native'" in lead
    assert "stuck_in_a_distinctive_function" in lead
    assert stacks.where == (
        f"stuck_in_a_distinctive_function ({WORKER_FILE}:{_line_of('# STUCK')})")
    calls = log.read_text().splitlines()
    assert [" --native" in c for c in calls] == [True, False, False], calls


@needs_py_spy
def test_a_native_dump_that_hangs_leaves_time_for_a_plain_one(tmp_path: Path) -> None:
    """``--native`` hanging is killed at its share of the process's bound; plain py-spy
    then gives the stacks, all within ``per_process_s``."""
    wrapper = fake(tmp_path, "py-spy-native-hangs", f"""\
        case " $* " in *" --native "*) exec sleep 3600;; esac
        exec {PY_SPY} "$@"
        """)
    with worker_group(tmp_path) as group:
        started = time.monotonic()
        stacks = capture([group.leader.pid], leader=group.leader.pid, code_dir=group.code_dir,
                         redact=Redactor([SECRET]).text, py_spy=wrapper, per_process_s=2.0)
        elapsed = time.monotonic() - started
    assert elapsed < 2.0 + 1.0, elapsed
    [lead] = stacks.processes
    assert lead.method == "py-spy"
    assert lead.why is not None and lead.why.startswith("--native: timed out after ")
    assert stacks.where is not None and "stuck_in_a_distinctive_function" in stacks.where


# --- the fallbacks ------------------------------------------------------------------------------


def test_without_py_spy_every_process_gets_the_proc_fallback_saying_so(tmp_path: Path) -> None:
    """py-spy not installed, or not runnable where it was said to be: each process gets
    its state, wait channel and kernel stack from /proc, and the section says why."""
    with worker_group(tmp_path) as group:
        missing = group.capture(py_spy=None)
        broken = group.capture(py_spy=str(tmp_path / "no-such-py-spy"))
        for pid in group.pids:
            text = section(missing, pid)
            assert "\nmethod: proc (py-spy: not installed)\n" in text
            # /proc's own words, as they were at the capture (a process sleeping in a
            # futex is seen running for a moment now and then: not compared with now)
            assert re.search(r"\nState: [RSD] \((running|sleeping|disk sleep)\)\n", text), text
            assert re.search(r"\nwchan: \S+\n", text), text
            reason = why(broken, pid)
            assert reason is not None
            assert reason.startswith("py-spy: could not be started (No such file or directory")
        assert missing.where is None and broken.where is None
        assert "\npy-spy: not installed: /proc only\n" in missing.text
        # the leader's other thread is listed from /proc too
        helper = next(t for t in tids(group.leader.pid) if t != group.leader.pid)
        assert f"\n    Thread {helper} \"python" in section(missing, group.leader.pid)


def _unprivileged_py_spy(tmp_path: Path) -> str | None:
    """A wrapper that runs the real py-spy as nobody, or None when that cannot be done here."""
    if PY_SPY is None or os.geteuid() != 0:
        return None
    setpriv, runuser = shutil.which("setpriv"), shutil.which("runuser")
    if setpriv:
        drop = f"{setpriv} --reuid=65534 --regid=65534 --clear-groups"
    elif runuser:
        drop = f"{runuser} -u nobody --"
    else:
        return None
    wrapper = fake(tmp_path, "py-spy-as-nobody", f'exec {drop} {PY_SPY} "$@"\n')
    check = subprocess.run([wrapper, "--version"], capture_output=True, timeout=30, check=False)
    return wrapper if check.returncode == 0 else None


def test_without_ptrace_permission_the_fallback_says_permission_denied(tmp_path: Path) -> None:
    """py-spy run as an unprivileged user against root's processes cannot attach: each
    process gets the /proc fallback, saying permission was denied."""
    wrapper = _unprivileged_py_spy(tmp_path)
    if wrapper is None:
        pytest.skip("cannot run py-spy as another user here (needs root and setpriv/runuser)")
    with worker_group(tmp_path) as group:
        stacks = group.capture(py_spy=wrapper)
    for pid in group.pids:
        text = section(stacks, pid)
        assert "\nmethod: proc (py-spy: permission denied)\n" in text
        assert "\nState: " in text and "\nwchan: " in text
    assert stacks.where is None
    assert {p["why"] for p in stacks.evidence()["processes"]} == {"py-spy: permission denied"}


def test_a_hung_py_spy_is_killed_with_its_group_at_the_per_process_bound(
    tmp_path: Path,
) -> None:
    """A py-spy that never answers (and a child of its own holding its pipes) is killed,
    group and all, within ``per_process_s``; the process gets the fallback."""
    started_log = tmp_path / "started"
    hangs = fake(tmp_path, "py-spy-hangs", f"""\
        echo $$ >> {started_log}
        sleep 3600 &
        wait
        """)
    with worker_group(tmp_path) as group:
        started = time.monotonic()
        stacks = group.capture(py_spy=hangs, per_process_s=1.5, parallel=1)
        elapsed = time.monotonic() - started
        alive = [proc_state(pid) for pid in group.pids]
    assert elapsed < 2 * 1.5 + 1.0, elapsed  # two processes, one after the other
    for p in stacks.processes:
        assert p.seconds < 1.5 + 0.5, p
        assert p.method == "proc" and p.why is not None
        assert p.why.startswith("py-spy: timed out after "), p.why
        assert "tried py-spy --native: timed out" in p.text
        assert "\nState: " in p.text
    pgids = [int(x) for x in started_log.read_text().split()]
    assert len(pgids) == 4  # --native then plain, for each process
    assert wait_gone(pgids) == []
    assert all(state not in ("T", "t", "Z", "X") for state in alive), alive


def test_the_budget_bounds_the_whole_capture_and_later_processes_get_the_fallback(
    tmp_path: Path,
) -> None:
    """With py-spy hanging on every process, the capture ends within ``budget_s``: the
    processes whose turn came after the budget was spent get the fallback at once."""
    hangs = fake(tmp_path, "py-spy-hangs", "exec sleep 3600\n")
    with worker_group(tmp_path) as group:
        pids = [*group.pids, os.getpid()]
        started = time.monotonic()
        stacks = capture(pids, leader=group.leader.pid, code_dir=group.code_dir,
                         redact=Redactor([SECRET]).text, py_spy=hangs, budget_s=2.5,
                         per_process_s=1.5, parallel=1)
        elapsed = time.monotonic() - started
    assert elapsed < 2.5 + 1.0, elapsed
    assert stacks.seconds <= elapsed
    whys = [p.why or "" for p in stacks.processes]
    assert whys[0].startswith("py-spy: timed out after "), whys
    assert whys[-1] == "py-spy: not tried, the capture's time was spent", whys
    assert all(p.method == "proc" and "\nState: " in p.text for p in stacks.processes)
    assert "(at most 2.5 s, 1.5 s a process)" in stacks.text


def test_a_py_spy_whose_pipes_outlive_its_group_is_abandoned_at_the_bound(
    tmp_path: Path,
) -> None:
    """A hung py-spy whose child escaped its group (``setsid``) keeps its pipes open after
    the group is killed: it is left behind at the bound, and the process gets the fallback."""
    escaped_log = tmp_path / "escaped"
    escapes = fake(tmp_path, "py-spy-escapes", f"""\
        setsid sleep 3600 &
        echo $! >> {escaped_log}
        exec sleep 3600
        """)
    try:
        with worker_group(tmp_path) as group:
            started = time.monotonic()
            stacks = group.capture(py_spy=escapes, per_process_s=1.5, parallel=1)
            elapsed = time.monotonic() - started
        assert elapsed < 2 * 1.5 + 1.0, elapsed
        for p in stacks.processes:
            assert p.method == "proc" and p.why is not None, p
            assert p.why.startswith("py-spy: timed out after "), p.why
    finally:
        for pid in escaped_log.read_text().split() if escaped_log.exists() else []:
            os.kill(int(pid), signal.SIGKILL)


def test_a_process_whose_capture_never_ends_is_named_unfinished_at_the_budget(
    tmp_path: Path,
) -> None:
    """Whatever holds one process's capture (here a redactor that blocks on the leader's
    command line), the call returns by ``budget_s`` with the rest, naming that process."""
    release = threading.Event()
    redactor = Redactor([SECRET])

    def stuck_on_the_leader(text: str) -> str:
        if "flash.engine.worker" in text:
            release.wait()
        return redactor.text(text)

    try:
        with worker_group(tmp_path) as group:
            started = time.monotonic()
            stacks = group.capture(redact=stuck_on_the_leader, py_spy=None, budget_s=1.5,
                                   parallel=2)
            elapsed = time.monotonic() - started
        assert elapsed < 1.5 + 1.0, elapsed
        lead, child = stacks.processes
        assert lead.method == "none"
        assert lead.why == "the capture's time ran out while this process was being read"
        assert child.method == "proc" and "\nState: " in child.text
    finally:
        release.set()


@needs_py_spy
def test_too_little_time_a_process_means_no_py_spy_and_no_processes_means_a_header(
    tmp_path: Path,
) -> None:
    """Under a second a process, py-spy is not started (it could only be killed); an empty
    group gives the file's header and nothing else, at once."""
    with worker_group(tmp_path) as group:
        stacks = group.capture(per_process_s=0.5)
    assert [p.why for p in stacks.processes] == ["py-spy: not tried, less than 1 s a process"] * 2
    empty = capture([], leader=1, code_dir=tmp_path, redact=str)
    assert empty.processes == () and empty.where is None
    assert "0 processes, leader 1" in empty.text and "== process" not in empty.text


# --- secrets --------------------------------------------------------------------------------------


def test_a_secret_in_a_command_line_never_leaves_in_any_text(tmp_path: Path) -> None:
    """The worker's command line carries a token: no section, header, ``where`` or evidence
    holds it, with py-spy or without; a redactor that fails withholds the text instead."""
    with worker_group(tmp_path) as group:
        taken = [group.capture(py_spy=None)]
        if PY_SPY is not None:
            taken.append(group.capture())

        def broken(text: str) -> str:
            raise RuntimeError(f"redactor broke on {text[:5]}")

        taken.append(capture(group.pids, leader=group.leader.pid, code_dir=group.code_dir,
                             redact=broken, py_spy=None))
    for stacks in taken[:-1]:
        assert "--token=***" in stacks.text
    for stacks in taken:
        everything = [stacks.text, stacks.where or "", stacks.where_in_code or "",
                      json.dumps(stacks.evidence()), *(p.text for p in stacks.processes)]
        assert not [t for t in everything if SECRET in t]
    assert "withheld: the redactor failed: RuntimeError" in taken[-1].text


# --- finding py-spy, and what importing this costs ----------------------------------------------


@needs_py_spy
def test_py_spy_is_found_beside_the_interpreter_then_on_path(tmp_path: Path) -> None:
    """Beside ``sys.executable`` first (where its wheel puts it), else on PATH, else None;
    the module needs nothing but the standard library to do it (``python -S``)."""
    if (Path(sys.executable).parent / "py-spy").exists():
        assert find_py_spy() == str(Path(sys.executable).parent / "py-spy")
    base = Path(getattr(sys, "_base_executable", sys.executable))
    if (base.parent / "py-spy").exists():
        pytest.skip(f"the base interpreter {base} has a py-spy beside it")
    on_path = tmp_path / "bin"
    on_path.mkdir()
    fake(on_path, "py-spy", "exit 0\n")
    probe = "from fsm.worker.stacks import find_py_spy; print(find_py_spy())"
    found = [
        subprocess.run([str(base), "-S", "-c", probe], capture_output=True, text=True,
                       timeout=30, check=True,
                       env={"PYTHONPATH": str(Path(__file__).parent.parent), "PATH": path},
                       ).stdout.strip()
        for path in (str(on_path), str(tmp_path / "empty"))
    ]
    assert found == [str(on_path / "py-spy"), "None"]


def test_importing_the_module_loads_only_the_standard_library() -> None:
    """``import fsm.worker.stacks`` loads nothing outside the standard library and ``fsm``."""
    code = ("import sys; before = set(sys.modules); import fsm.worker.stacks; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         timeout=30, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    loaded = out.stdout.split()
    assert "fsm.worker.stacks" in loaded
    foreign = [m for m in loaded if m.split(".")[0] not in (*sys.stdlib_module_names, "fsm")]
    assert not foreign, foreign
    assert not [m for m in loaded if m.startswith("fsm.") and m not in (
        "fsm.worker", "fsm.worker.stacks", "fsm.worker.bounded", "fsm.clock")]


def test_a_runner_attempt_never_imports_the_module(layout: Layout) -> None:
    """The start path stays as cheap as it was: a whole attempt that needs no stacks never
    imports ``fsm.worker.stacks`` (Train imports it lazily, when a capture is needed)."""
    layout.write_worker("print('training'); complete()")
    layout.write_payload()
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fsm", *layout.run_args()],
        capture_output=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.decode().splitlines()
                if line.startswith("import time:")]
    assert "fsm.attempt.runner" in imported  # the measurement sees the runner's imports
    assert "fsm.worker.stacks" not in imported
