"""The stacks of the worker's process group, taken before anything stops it (issue 23, item 2).

When the worker stalls, and when the deadline stops it, the runner leaves the stacks of
every process of the worker's group behind as ``stacks_<phase>.txt`` (CONTRACT section 7).
:func:`capture` takes them and never raises; the caller (Train) decides when, uploads the
text and puts :meth:`Stacks.evidence` and :attr:`Stacks.where` in the marker.

Each process is tried with py-spy first (``py-spy dump --pid P --json``, attaching with
ptrace), with ``--native`` first (C frames too) and plain when py-spy refuses that or does
not manage within its share of the time. Where py-spy is missing, cannot attach (no ptrace
permission), the process runs no Python, or py-spy hangs, the process gets the /proc
fallback instead: its state, kernel wait channel and kernel stack (when readable), and the
same for each of its threads. Every section says which method gave it and, for a
fallback, why.

py-spy's JSON is rendered in ``py-spy dump``'s own format (``Thread <tid> (<status>):
"<name>"`` then one ``    <function> (<file>:<line>)`` per frame, innermost first, threads
in py-spy's order), with full file names as ``--full-filenames`` prints them; the JSON is
what :attr:`Stacks.where` is read from. One attach gives both (a second run for the human
text would double the time and could disagree with the first). py-spy's two header
lines (``Process``, ``Python v``) are replaced by the section's own header. py-spy lists
only threads that run Python: the others (a CUDA or NCCL thread, an OpenMP pool) follow
from /proc, grouped by what they wait in.

Bounds: a py-spy gets at most ``per_process_s`` (both tries together) and is then killed
with its process group (it runs in a session of its own, like every child of the runner);
nothing is tried past ``budget_s`` after the start, and :func:`capture` returns by then
whatever is still running: a process whose turn never came gets the cheap fallback, saying
so. py-spy 0.4 attaches with ``PTRACE_SEIZE`` and ``PTRACE_INTERRUPT`` (checked with strace),
so a py-spy killed mid-dump leaves no process stopped behind; taking the stacks sends no
signal to the worker's group.

Every section is redacted whole (before any cut) with the caller's ``redact``, and so is
every other text :class:`Stacks` carries. Imports only the standard library (and
``fsm.clock``, ``fsm.worker.bounded``): Train imports this module lazily, when a capture
is needed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any, Final, Literal

from fsm.clock import os_timeout
from fsm.worker import bounded
from fsm.worker.bounded import Ran

__all__ = [
    "BUDGET_S",
    "FIND",
    "PER_PROCESS_S",
    "ProcessStacks",
    "Stacks",
    "artifact_name",
    "capture",
    "find_py_spy",
]

BUDGET_S: Final = 20.0
"""At most this long for the whole capture (CONTRACT section 7)."""
PER_PROCESS_S: Final = 5.0
"""At most this long for py-spy on one process (issue 23)."""

_NATIVE_SHARE = 0.6  # of a process's time, what ``--native`` may take before plain gets the rest
#: Kept for a py-spy killed at its bound: the kill's grace (bounded.KILL_GRACE_S) and more.
_REAP_S = 0.25
_PROC_S = 0.25  # kept back from py-spy for the /proc fallback that may follow it
_MIN_TRY_S = 0.5  # py-spy is not started with less time than this left
_CMDLINE_CHARS = 4_000  # a command line is cut to this (after redaction)
_SECTION_CHARS = 256_000  # a process's section is cut to this (after redaction)
_THREADS_MAX = 512  # threads listed from /proc per process
_SAID_LINES = 5  # lines of a failed py-spy's stderr kept in the section
_EVIDENCE_MAX = 64  # processes listed in :meth:`Stacks.evidence`
_PARALLEL_MAX = 4  # py-spys at once, at most (fewer on a machine with fewer cores)
# Environment settings that make py-spy's errors long (Rust backtraces, debug logs).
_NOISY_ENV = ("RUST_BACKTRACE", "RUST_LIB_BACKTRACE", "RUST_LOG")


class _Find(Enum):
    FIND = "find"


FIND: Final = _Find.FIND
"""``capture(py_spy=FIND)``: look for py-spy with :func:`find_py_spy` (the default)."""

Method = Literal["py-spy --native", "py-spy", "proc", "none"]


@dataclass(frozen=True)
class ProcessStacks:
    """One process of the capture.

    ``method`` is what gave its stacks: ``py-spy --native``, ``py-spy``, ``proc`` (the /proc
    fallback) or ``none`` (the capture ran out of time while still reading it). ``why`` says
    why not a better method (``py-spy: permission denied``, ``--native: timed out after
    3.0 s``, ...; None when py-spy --native gave them). ``text`` is its section of the file,
    redacted.
    """

    pid: int
    method: Method
    why: str | None
    text: str
    seconds: float


@dataclass(frozen=True)
class Stacks:
    """What :func:`capture` took.

    ``text`` is the whole ``stacks_<phase>.txt`` (redacted): a short header, then one
    section per process. ``where`` is the innermost Python frame of the leader's main
    thread as ``function (path:line)``, the path relative to ``code_dir`` when inside it
    (CONTRACT section 7). C frames (``--native``) are skipped for it: they name addresses
    and libraries, no line, and differ from host to host. ``where_in_code`` is the innermost
    frame of that thread that is inside ``code_dir``: the worker's own line that led there,
    when ``where`` is in a library (``Condition.wait`` in threading.py for every wait on an
    Event). Both are None when unknown (no py-spy stacks for the leader).
    """

    text: str
    where: str | None
    where_in_code: str | None
    processes: tuple[ProcessStacks, ...]
    seconds: float

    def evidence(self) -> dict[str, Any]:
        """For the marker: seconds taken, ``where``, and each process's method (and why not
        better), at most 64 processes (then ``more``: how many were left out)."""
        listed = [
            {"pid": p.pid, "method": p.method, **({"why": p.why} if p.why else {})}
            for p in self.processes[:_EVIDENCE_MAX]
        ]
        more = len(self.processes) - _EVIDENCE_MAX
        return {"seconds": round(self.seconds, 3), "where": self.where, "processes": listed,
                **({"more": more} if more > 0 else {})}


def artifact_name(phase: str) -> str:
    """The stacks file's name under the prefix (CONTRACT section 7)."""
    return f"stacks_{phase}.txt"


def find_py_spy() -> str | None:
    """The py-spy executable to run, or None: ``py-spy`` next to the runner's interpreter
    (where ``pip install 'flash-bootstrap[fast]'`` puts the wheel's binary), else ``py-spy``
    on the runner's ``PATH``. The order
    :func:`fsm.extras.installer.find_uv` follows (py-spy's wheel has no Python module to ask)."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy", path=os.environ.get("PATH", os.defpath))


def capture(
    pids: Sequence[int],
    *,
    leader: int,
    code_dir: Path,
    redact: Callable[[str], str],
    budget_s: float = BUDGET_S,
    per_process_s: float = PER_PROCESS_S,
    py_spy: str | _Find | None = FIND,
    native: bool = True,
    parallel: int | None = None,
) -> Stacks:
    """The stacks of every process in ``pids`` (the live members of the worker's group:
    :func:`fsm.worker.procs.group_members`), ``leader`` (the worker's own process) first.

    ``py_spy``: the executable (a path), None for the /proc fallback only, or :data:`FIND`
    (:func:`find_py_spy`). ``native``: try ``--native`` first (C frames too; the default).
    ``parallel``: how many processes are taken at once (default: the machine's cores, at
    most 4); each py-spy pauses only its own target, for the moment of its dump.
    ``per_process_s`` bounds py-spy on one process, ``budget_s`` the whole call: it returns
    within about ``budget_s`` whatever happens. Never raises: a failure is text in the file.
    """
    started = time.monotonic()
    try:
        # Each pid once, the leader first (a stable sort keeps the others' order).
        order = sorted(dict.fromkeys(int(p) for p in pids), key=lambda pid: pid != leader)
        shared = _Shared(
            exe=find_py_spy() if py_spy is FIND else py_spy,
            end=started + os_timeout(budget_s),
            per_process_s=os_timeout(per_process_s),
            leader=leader,
            code_dir=code_dir,
            redact=redact,
            native=native,
        )
        width = parallel if parallel is not None else min(_PARALLEL_MAX, os.cpu_count() or 1)
        results = _run_all(order, shared, max(1, width))
        ran_out = "the capture's time ran out while this process was being read"
        processes = tuple(r or _unread(pid, shared, ran_out)
                          for pid, r in zip(order, results, strict=True))
        # The leader's thread set them before its result came (none: not in time).
        where, where_in_code = shared.where if results and results[0] else (None, None)
        seconds = time.monotonic() - started
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        spy = (f"{shared.exe} (dump --json, shown in py-spy dump's format with full file names)"
               if shared.exe else "not installed: /proc only")
        header = "\n".join([
            _TITLE,
            f"taken {when}: {len(order)} processes, leader {leader}, in {seconds:.2f} s "
            f"(at most {budget_s:g} s, {per_process_s:g} s a process)",
            f"py-spy: {spy}",
            f"where: {where or 'unknown'}",
            "",
        ])
        text = "\n".join([_redacted(redact, header), *(p.text for p in processes)])
        return Stacks(text, where, where_in_code, processes, seconds)
    except Exception as exc:  # the evidence is optional; the marker is not
        note = _redacted(redact, f"stack capture failed: {type(exc).__name__}: {exc}")
        text = f"{_TITLE}\n{note}\n"
        return Stacks(text, None, None, (), time.monotonic() - started)


# --- the capture ----------------------------------------------------------------------------

_TITLE = "flash-bootstrap: stacks of the worker's process group, taken before any signal"


@dataclass
class _Shared:
    """What the capture's threads share: the bounds, and what py-spy turned out to accept."""

    exe: str | None
    end: float  # monotonic: nothing is tried past this
    per_process_s: float
    leader: int
    code_dir: Path
    redact: Callable[[str], str]
    native: bool  # try --native first; cleared when py-spy refuses it as an option
    native_refused: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: The leader's ``where`` and ``where_in_code`` (:class:`Stacks`), set by its thread.
    where: tuple[str | None, str | None] = (None, None)


def _run_all(order: list[int], shared: _Shared, width: int) -> list[ProcessStacks | None]:
    """Each pid taken on one of ``width`` daemon threads, the first pids first; waits until
    all are done or the budget is gone, and returns what is done by then."""
    results: list[ProcessStacks | None] = [None] * len(order)
    done = threading.Condition()
    next_index = iter(range(len(order)))

    def work() -> None:
        while True:
            with done:
                i = next(next_index, None)
            if i is None:
                return
            try:
                taken = _take(order[i], shared)
            except Exception as exc:  # a bug here must not cost the other processes
                taken = _unread(order[i], shared, f"failed: {type(exc).__name__}: {exc}")
            with done:
                results[i] = taken
                done.notify_all()

    # Daemon threads, not a pool: a thread stuck in a /proc read must not hold the exit.
    for n in range(min(width, len(order))):
        threading.Thread(target=work, name=f"stacks-{n}", daemon=True).start()
    with done:
        done.wait_for(lambda: all(r is not None for r in results),
                      os_timeout(shared.end - time.monotonic()))
        return list(results)


def _take(pid: int, shared: _Shared) -> ProcessStacks:
    """One process: py-spy when there is one and time for it, else (or when it fails) /proc."""
    t0 = time.monotonic()
    cmdline = _cmdline(pid)
    tried: list[str] = []  # what py-spy said, for the section
    least = _MIN_TRY_S + _REAP_S + _PROC_S
    method: Method = "proc"
    threads = None
    if shared.exe is None:
        why = "py-spy: not installed"
    elif shared.end - t0 < least:
        why = "py-spy: not tried, the capture's time was spent"
    elif shared.per_process_s < least:
        why = f"py-spy: not tried, less than {least:g} s a process"
    else:
        method, threads, why = _py_spy(shared.exe, pid, shared, t0, tried)
    body = _proc_body(pid) if threads is None else _dump_lines(pid, threads, shared)
    return _section(pid, cmdline, shared, method, why or None, tried + body, t0)


def _unread(pid: int, shared: _Shared, why: str) -> ProcessStacks:
    """A process whose stacks could not be read (``why``): its header, method ``none``."""
    return _section(pid, "(not read)", shared, "none", why, [])


# --- py-spy -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Frame:
    name: str
    filename: str
    line: int
    native: bool  # a C frame (py-spy names its module); Python frames have none


@dataclass(frozen=True)
class _Thread:
    thread_id: int
    os_thread_id: int | None
    name: str | None
    active: bool
    owns_gil: bool
    frames: tuple[_Frame, ...]


# What py-spy's errors say (main.rs prints "Permission Denied: ..." for EPERM/EACCES as a
# user, "Error: ..." otherwise), and what each means for the next try.
_TARGET_SPECIFIC = {
    "permission denied": ("Permission Denied", "Permission denied", "Operation not permitted",
                          "os error 1)", "os error 13)"),
    "not a Python process": ("Failed to find python version",
                             "Failed to find a python interpreter"),
    "process gone": ("Check that the process is running", "No such process", "os error 3)"),
}


def _py_spy(
    exe: str, pid: int, shared: _Shared, t0: float, tried: list[str]
) -> tuple[Method, tuple[_Thread, ...] | None, str]:
    """py-spy on ``pid`` within its bounds: --native first, then plain. Returns the method
    that gave the threads (as py-spy's JSON lists them) and why it is not a native one (""
    when it is, or when native was not asked for), or "proc", None and why py-spy gave
    nothing."""
    stop_at = min(t0 + shared.per_process_s, shared.end) - _REAP_S - _PROC_S
    why = ""
    for native in (True, False):
        if native and not shared.native:
            why = "--native: refused by this py-spy" if shared.native_refused else ""
            continue
        until = t0 + (stop_at - t0) * _NATIVE_SHARE if native else stop_at
        began = time.monotonic()
        ran = _run_py_spy(exe, pid, native, until)
        flag: Method = "py-spy --native" if native else "py-spy"
        threads = _parse(ran.stdout) if ran.status == 0 else None  # None when killed
        if threads is not None:
            return flag, threads, why
        reason = _reason(ran, until - began)
        said = " | ".join(_said(ran))
        tried.append(f"tried {flag}: {reason}{f'; it said: {said}' if said else ''}")
        if not native or reason in _TARGET_SPECIFIC:
            return "proc", None, f"py-spy: {reason}"
        if ran.status == 2:  # a usage error (clap): this py-spy has no --native
            with shared.lock:
                shared.native, shared.native_refused = False, True
        why = f"--native: {reason}"
    return "proc", None, why or "py-spy: not tried"


def _run_py_spy(exe: str, pid: int, native: bool, until: float) -> Ran:
    """``py-spy dump --pid PID --json [--native]``, killed with its group at ``until``
    (monotonic)."""
    argv = [exe, "dump", "--pid", str(pid), "--json", *(["--native"] if native else [])]
    env = {k: v for k, v in os.environ.items() if k not in _NOISY_ENV}
    env["RUST_BACKTRACE"] = "0"  # one line of error, not a Rust backtrace
    ran = bounded.run(argv, env, until, reaper="py-spy-reaper")
    return ran if ran.start_error is None else replace(ran, start_error=f"{ran.start_error}: {exe}")


def _reason(ran: Ran, allowed_s: float) -> str:
    """Why a py-spy run gave no stacks, in a few words (the keys of _TARGET_SPECIFIC first)."""
    if ran.start_error is not None:
        return f"could not be started ({ran.start_error})"
    if ran.hung:
        return f"timed out after {max(0.0, allowed_s):.1f} s, killed"
    if ran.status == 0:
        return "printed no stacks it could read"
    said = ran.stderr.decode(errors="replace")
    for reason, needles in _TARGET_SPECIFIC.items():
        if any(needle in said for needle in needles):
            return reason
    return f"failed (exit {ran.status})"


def _said(ran: Ran) -> list[str]:
    """The first lines a py-spy wrote to stderr (empty ones dropped)."""
    lines = [line.strip() for line in ran.stderr.decode(errors="replace").splitlines()]
    return [line[:300] for line in lines if line][:_SAID_LINES]


def _parse(stdout: bytes) -> tuple[_Thread, ...] | None:
    """py-spy's ``dump --json``: a list of traces (py-spy's ``StackTrace``), or None when it
    is not that."""
    try:
        data = json.loads(stdout)
        if not isinstance(data, list):
            return None
        return tuple(
            _Thread(
                thread_id=int(trace.get("thread_id") or 0),
                os_thread_id=(int(trace["os_thread_id"]) if trace.get("os_thread_id") is not None
                              else None),
                name=str(trace["thread_name"]) if trace.get("thread_name") is not None else None,
                active=bool(trace.get("active")),
                owns_gil=bool(trace.get("owns_gil")),
                frames=tuple(
                    _Frame(
                        name=str(f["name"]),
                        filename=str(f["filename"]),
                        line=int(f.get("line") or 0),
                        native=f.get("module") is not None,
                    )
                    for f in trace["frames"]
                ),
            )
            for trace in data
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _dump_lines(pid: int, threads: tuple[_Thread, ...], shared: _Shared) -> list[str]:
    """py-spy's threads as ``py-spy dump`` prints them, then the threads without Python
    frames from /proc; the leader's ``where`` is set on ``shared`` on the way."""
    lines = []
    for thread in reversed(threads):  # py-spy dump prints them in this order
        lines.append(_thread_line(thread))
        lines.extend(f"    {_frame_text(f.name, f.filename, f.line)}" for f in thread.frames)
    lines.extend(_task_groups(
        pid, {t.os_thread_id for t in threads},
        "Threads without Python frames (from /proc: state, wait channel, kernel stack):"))
    if pid == shared.leader:
        shared.where = _where(pid, threads, shared)
    return lines


def _thread_line(thread: _Thread) -> str:
    """py-spy dump's thread line (dump.rs, stack_trace.rs ``format_threadid``)."""
    tid = (str(thread.os_thread_id) if thread.os_thread_id is not None
           else f"0x{thread.thread_id:X}")
    status = "idle" if not thread.active else "active+gil" if thread.owns_gil else "active"
    name = f': "{thread.name}"' if thread.name is not None else ""
    return f"Thread {tid} ({status}){name}"


def _frame_text(name: str, filename: str, line: int) -> str:
    """A frame as py-spy dump prints it (indented there, under its thread)."""
    return f"{name} ({filename}:{line})" if line else f"{name} ({filename})"


def _where(pid: int, threads: tuple[_Thread, ...], shared: _Shared) -> tuple[str | None,
                                                                              str | None]:
    """The main thread's innermost Python frame, and its innermost frame inside code_dir."""
    main = next((t for t in threads if t.os_thread_id == pid), None)
    main = main or next((t for t in threads if t.name == "MainThread"), None)
    if main is None:
        return None, None
    where = in_code = None
    for frame in (f for f in main.frames if not f.native):
        relative = _relative(frame.filename, shared.code_dir)
        text = _redacted(shared.redact, _frame_text(frame.name, relative or frame.filename,
                                                    frame.line))
        if where is None:
            where = text
        if relative is not None:
            in_code = text
            break
    return where, in_code


def _relative(filename: str, code_dir: Path) -> str | None:
    """``filename`` relative to ``code_dir`` when it is inside it (as given or with links
    resolved, on either side), else None."""
    if not filename.startswith("/"):
        return None  # "<frozen runpy>", "<string>"
    bases = {str(code_dir), os.path.realpath(code_dir)}
    for candidate in dict.fromkeys([os.path.normpath(filename), os.path.realpath(filename)]):
        for base in bases:
            with contextlib.suppress(ValueError):
                return Path(candidate).relative_to(base).as_posix()
    return None


# --- /proc --------------------------------------------------------------------------------------


def _cmdline(pid: int) -> str:
    """The process's command line as /proc shows it (or why it could not)."""
    data = _read(f"/proc/{pid}/cmdline")
    if isinstance(data, str):
        return data
    args = [arg.decode(errors="replace") for arg in data.split(b"\0") if arg]
    return " ".join(args) if args else "(empty)"


def _read(path: str) -> bytes | str:
    """The file's bytes, or ``(unreadable: why)`` / ``(gone)``."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return "(gone)"
    except OSError as exc:
        return f"(unreadable: {exc.strerror or exc})"


def _text(path: str) -> str:
    data = _read(path)
    return data if isinstance(data, str) else data.decode(errors="replace").strip()


def _state(task: str) -> str:
    """The ``State:`` of ``/proc/<task>/status`` (``S (sleeping)``)."""
    status = _read(f"/proc/{task}/status")
    if isinstance(status, str):
        return status
    for line in status.decode(errors="replace").splitlines():
        if line.startswith("State:"):
            return line.partition(":")[2].strip()
    return "(no State line)"


def _kernel_stack(task: str) -> list[str]:
    stack = _read(f"/proc/{task}/stack")
    if isinstance(stack, str):
        return [stack]
    lines = [line.strip() for line in stack.decode(errors="replace").splitlines()]
    return [line for line in lines if line] or ["(empty)"]


def _proc_body(pid: int) -> list[str]:
    """The fallback: state, wait channel and kernel stack of the process, then its threads."""
    return [
        f"State: {_state(str(pid))}",
        f"wchan: {_text(f'/proc/{pid}/wchan')}",
        f"kernel stack (/proc/{pid}/stack):",
        *(f"    {line}" for line in _kernel_stack(str(pid))),
        *_task_groups(pid, {pid}, f"Other threads (/proc/{pid}/task):"),
    ]


def _task_groups(pid: int, skip: set[int | None], title: str) -> list[str]:
    """``title``, then the process's threads but ``skip``, grouped by state, wait channel
    and kernel stack: a pool of 96 threads in one futex is one entry naming them all, its
    stack shown once. Nothing when there are no such threads."""
    try:
        tids = sorted(int(n) for n in os.listdir(f"/proc/{pid}/task") if n.isdigit())
    except OSError:
        tids = []
    tids = [tid for tid in tids if tid not in skip]
    if not tids:
        return []
    groups: dict[tuple[str, str, tuple[str, ...]], list[str]] = {}
    for tid in tids[:_THREADS_MAX]:
        task = f"{pid}/task/{tid}"
        key = (_state(task), _text(f"/proc/{task}/wchan"), tuple(_kernel_stack(task)))
        groups.setdefault(key, []).append(f'{tid} "{_text(f"/proc/{task}/comm")}"')
    lines = [title]
    for (state, wchan, stack), names in groups.items():
        label = "Thread" if len(names) == 1 else f"{len(names)} threads"
        lines.append(f"    {label} {', '.join(names)}: {state}, wchan {wchan}")
        lines.extend(f"        {line}" for line in stack)
    if len(tids) > _THREADS_MAX:
        lines.append(f"    ({len(tids) - _THREADS_MAX} more threads not listed)")
    return lines


# --- text ---------------------------------------------------------------------------------------


def _section(pid: int, cmdline: str, shared: _Shared, method: Method, why: str | None,
             body: list[str], t0: float | None = None) -> ProcessStacks:
    """Process ``pid``'s part of the file: a header naming it and its ``cmdline``, then
    ``body``; redacted whole, then cut (so no cut leaves a piece of a secret). Its seconds
    count from ``t0`` (none without it)."""
    role = " (the worker)" if pid == shared.leader else ""
    cmdline = _redacted(shared.redact, cmdline)
    if len(cmdline) > _CMDLINE_CHARS:
        cmdline = f"{cmdline[:_CMDLINE_CHARS]} [... {len(cmdline) - _CMDLINE_CHARS} more]"
    text = "\n".join([
        f"== process {pid}{role} ==",
        f"command line: {cmdline}",
        f"method: {method}{f' ({why})' if why else ''}",
        *body,
        "",
    ])
    text = _redacted(shared.redact, text)
    if len(text) > _SECTION_CHARS:
        cut = len(text) - _SECTION_CHARS
        text = f"{text[:_SECTION_CHARS]}\n[... {cut} more characters of this section cut]\n"
    seconds = time.monotonic() - t0 if t0 is not None else 0.0
    return ProcessStacks(pid, method, why, text, seconds)


def _redacted(redact: Callable[[str], str], text: str) -> str:
    """``redact(text)``; when the redactor itself fails, nothing of the text."""
    try:
        return redact(text)
    except Exception as exc:
        return f"(withheld: the redactor failed: {type(exc).__name__})"
