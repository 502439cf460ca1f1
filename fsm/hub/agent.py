"""The process that makes the runner's Hub calls: ``huggingface_hub`` loaded beside the runner.

Importing ``huggingface_hub`` costs a quarter to half a second of CPU (its HTTP stack:
httpx2 and anyio on 2.x, requests and urllib3 on 0.x), and an import holds the GIL: in a
thread of the runner it would not overlap the runner's own start, it would add to it. So
the runner starts one Python process for the library at its first instruction
(:func:`start`), which imports it on the other core while the runner reads its payload
and checks the host, and every call of ``fsm.hub.client.HubClient`` the adapter
makes is sent to it (:meth:`Agent.call`, :meth:`Agent.each`). The
adapter (``fsm.store.hub``) keeps everything else: bounds, retries, the fence.

The two talk over the agent's stdin and stdout in frames (one pickle each, of plain
data: the runner's own types, paths, strings). The runner sends ``("call", id, key,
method, args, kwargs)``, ``("configure", id, settings)`` and ``("probe", id, names)``
(what the agent holds for those settings); the agent answers
``("ready", at, seconds, error)`` once, when the library is loaded (or failed to load),
then ``("ok", id, value)`` or ``("err", id, failure)`` per request, each call in a thread
of its own (a folder's files are fetched several at once); settings are applied in the
order they come, before any call sent after them, so the runner sends them without
waiting for the library to load. An agent whose library did not load gets no call and
its replies are not read (the adapter starts another, or gives up). A failure travels as the
adapter's classification of the exception (``fsm.hub.library.classify``: the status, the
asked wait, the error code, the transport type's name), never as the exception's text,
which may hold a URL (a digest mismatch reads as a transport failure, by its type's
name); an error of the agent's own filesystem writes travels as itself (its errno,
message and path: a full code root is judged as the runner's own writes are). ``key`` is
the endpoint, the token and the metadata timeout: the token the runner took from the
payload goes to the agent only through the pipe, never into its argv or environment (the
agent inherits the runner's own environment, as the runner was given it).

The agent is the runner's to stop: it ignores the signals that stop a runner (the runner
decides, and still needs it for the marker), runs in a session of its own (a terminal's
Ctrl-C reaches only the runner's group), and exits when its stdin closes, which is when
the runner exits, however it exits. Should it exit early (the OOM killer), every request
in flight fails as a connection error (the adapter retries it) and the next call starts
another agent. Its stderr (a warning, a traceback) is passed to the runner's stderr, which
makes each line a ``library.stderr`` event (``fsm.output.log.quiet_libraries``), once the runner's
logging is set up.

The agent sets the fast-transfer switch in its own environment before its import
(``fsm.hub.library.switch_transfer``), unless the runner's environment was configured
already (a test's choice, inherited as it is). Standard library only, on both sides until
the library loads: :func:`start` runs at the runner's first instruction, and the agent
loads nothing of the runner's but ``fsm.hub``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
import pickle
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from queue import SimpleQueue

__all__ = ["Agent", "AgentGone", "current", "serve", "start"]

_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding the fsm package
#: The signals that stop a runner: the agent ignores them (the runner stops it by closing
#: its stdin, after the marker).
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPWR,
            signal.SIGXCPU, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGPIPE)
#: The agent's own, as the runner's (``fsm.output.log.QUIET_SETTINGS``; a test keeps them equal):
#: no progress bars on a stderr that becomes the runner's events.
QUIET_SETTINGS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


class AgentGone(ConnectionError):
    """The agent exited with the request unanswered (a transport failure: retried)."""


# --- frames --------------------------------------------------------------------------------


def _write(stream: IO[bytes], message: tuple[Any, ...]) -> None:
    pickle.dump(message, stream, protocol=pickle.HIGHEST_PROTOCOL)
    stream.flush()


def _read(stream: IO[bytes]) -> tuple[Any, ...] | None:
    """The next frame (a pickle ends itself), or None at the end of the stream."""
    try:
        message = pickle.load(stream)
    except (EOFError, pickle.UnpicklingError):  # the end, or a frame cut by an exit
        return None
    return message if isinstance(message, tuple) else None


# --- the runner's side ---------------------------------------------------------------------


class Pending(threading.Event):
    """A request sent to the agent, its reply still to come (:meth:`Agent.result`): set
    once it has come."""

    def __init__(self, queue: SimpleQueue[Pending] | None = None) -> None:
        super().__init__()
        self.reply: tuple[Any, ...] | None = None
        self._queue = queue

    def settle(self, reply: tuple[Any, ...] | None) -> None:
        """The reply came (None: the agent is gone): waiters are told, and the queue."""
        self.reply = reply
        self.set()
        if self._queue is not None:
            self._queue.put(self)


def _launch(switch: bool, not_ours: Sequence[int]) -> tuple[int, int, int, int]:
    """Start the agent: its pid, and the runner's ends of its stdin, stdout and stderr
    (close-on-exec: no installer or worker the runner starts holds the agent's stdin open
    after the runner is gone).

    In a process with one thread (the runner's first instruction) it is a fork, which
    costs no interpreter start; otherwise a fresh interpreter (``posix_spawn``: a fork of
    a process with threads may copy a lock some other thread holds). Either way the agent
    has a session of its own. A fork copies every descriptor: the agent closes
    ``not_ours`` (the runner's ends of pipes to its other children)."""
    (req_r, req_w), (rep_r, rep_w), (err_r, err_w) = (os.pipe2(os.O_CLOEXEC) for _ in range(3))
    child_ends, ours = (req_r, rep_w, err_w), (req_w, rep_r, err_r)
    if threading.active_count() == 1:
        pid = os.fork()
        if pid == 0:  # the agent
            try:
                for target, fd in enumerate(child_ends):
                    os.dup2(fd, target)
                # not_ours: another child's (gone already is as good as closed)
                for fd in (*child_ends, *ours, *not_ours):
                    with contextlib.suppress(OSError):
                        os.close(fd)
                os.setsid()
                with contextlib.suppress(ValueError):
                    signal.set_wakeup_fd(-1)  # the runner's signal pipe is not ours
                serve(switch=switch)
            finally:
                os._exit(70)
    else:
        code = (f"import sys; sys.path.insert(0, {_ROOT!r}); "
                f"from fsm.hub.agent import serve; serve(switch={switch!r})")
        actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(child_ends)]
        pid = os.posix_spawn(sys.executable, [sys.executable, "-c", code], os.environ,
                             file_actions=actions, setsid=True)
    for fd in child_ends:
        os.close(fd)
    return pid, *ours


class Agent:
    """One agent process, from the runner's side."""

    def __init__(self, *, switch: bool = True, hold_output: bool = False,
                 not_ours: Sequence[int] = ()) -> None:
        self.started_at = time.time()
        #: When the library was loaded (epoch seconds), how long it took, and the type of
        #: the error if it failed: set by the ``ready`` frame.
        self.ended_at: float | None = None
        self.import_s: float | None = None
        self.error: str | None = None
        #: The fast-transfer accelerator the agent switched on (None: it kept the switch
        #: its environment gave it).
        self.accelerator: str | None = None
        self.ready = threading.Event()
        self.returncode: int | None = None
        #: Whether the runner took it away (:meth:`kill`), rather than it exiting.
        self.killed = False
        self._exited = threading.Event()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        self.alive = True
        self._on_ready: list[Callable[[Agent], None]] = []
        #: The agent's last lines of stderr, for the event that says it exited.
        self.tail: deque[str] = deque(maxlen=5)
        self._held: list[str] | None = [] if hold_output else None
        self.pid, stdin, stdout, stderr = _launch(switch, not_ours)
        self._stdin: IO[bytes] | None = os.fdopen(stdin, "wb")
        threading.Thread(target=self._replies, args=(os.fdopen(stdout, "rb"),),
                         name="hub-agent", daemon=True).start()
        threading.Thread(target=self._stderr, args=(os.fdopen(stderr, "rb"),),
                         name="hub-agent-stderr", daemon=True).start()

    def when_ready(self, callback: Callable[[Agent], None]) -> None:
        """Call ``callback(self)`` once the ``ready`` frame has come (at once if it has)."""
        with self._lock:
            if not self.ready.is_set():
                self._on_ready.append(callback)
                return
        callback(self)

    def call(self, key: tuple[str, str | bool, float], method: str, *args: Any,
             **kwargs: Any) -> Any:
        """``HubClient(*key).<method>(*args, **kwargs)`` in the agent; its value, or its
        failure raised here. Unbounded: the adapter bounds the thread that waits here."""
        return self.result(self._send("call", key, method, args, kwargs))

    def each(self, key: tuple[str, str | bool, float], method: str,
             calls: Iterable[tuple[tuple[Any, ...], Mapping[str, Any]]], *, window: int,
             before: Callable[[], None]) -> Iterator[Any]:
        """:meth:`call` of ``method(*args, **kwargs)`` for each of ``calls``, up to
        ``window`` at once, from this one thread (the agent runs each in a thread of its
        own): their values as they arrive, in the order they arrive. ``before()`` runs
        before each call is sent (a signal, a cancelled branch: it raises there). The first
        failure is raised once the calls in flight have ended, as a pool's ``map`` would:
        nothing of the batch still writes after it (a retry of the batch, a mismatched
        blob's removal)."""
        from queue import SimpleQueue

        arrived: SimpleQueue[Pending] = SimpleQueue()
        todo = iter(calls)
        in_flight = 0
        failure: BaseException | None = None
        while True:
            # Up to the window, until a failure: then only the calls in flight are awaited.
            while failure is None and in_flight < window and (call := next(todo, None)):
                try:
                    before()
                    self._send("call", key, method, *call, queue=arrived)
                    in_flight += 1
                except BaseException as exc:  # raised once the calls in flight have ended
                    failure = exc
            if not in_flight:
                break
            pending = arrived.get()
            in_flight -= 1
            try:
                value = self.result(pending)
            except BaseException as exc:
                failure = failure or exc
                continue
            if failure is None:
                yield value
        if failure is not None:
            raise failure

    def result(self, pending: Pending) -> Any:
        """The value of a request sent, once its reply has come; its failure raised here."""
        pending.wait()
        reply = pending.reply
        if reply is None:
            raise AgentGone(self._gone())
        if reply[0] == "ok":
            return reply[2]
        raise _decode(reply[2])

    def configure(self, settings: Mapping[str, str]) -> Pending:
        """The hub's settings sent to the agent (into its environment before its import,
        its frozen constants after), applied before any request sent after them. The
        reply (:meth:`result`) lists the ones the library keeps nowhere it can still be
        told."""
        return self._send("configure", dict(settings))

    def ping(self) -> Pending:
        """A request the agent answers at once from its reading loop, whatever its calls
        are doing (:meth:`probe` of nothing): no answer means the process is silent
        (stopped, wedged in the kernel, or holding its interpreter), not one call slow."""
        return self._send("probe", [])

    def probe(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """What the agent holds for each setting in ``names``: the library's constant of
        that name (``constant``, absent when it has none) and its environment's value
        (``environ``). For diagnosis, and for tests that the settings arrived."""
        value: dict[str, dict[str, Any]] = self.result(self._send("probe", list(names)))
        return value

    def stop(self) -> None:
        """Close the agent's stdin: it exits (its calls in flight fail as connection errors)."""
        with self._lock:
            stdin, self._stdin = self._stdin, None
        if stdin is not None:
            with contextlib.suppress(OSError):
                stdin.close()

    def kill(self) -> None:
        """Take the agent away at once (SIGKILL): it fell silent (stopped, or wedged in the
        kernel or in a library, a call's bound passed without an answer). From now on it
        counts as gone, so the next call starts another, even while the kernel has not
        yet let it die (an uninterruptible wait); its requests in flight fail as
        :class:`AgentGone` once it has."""
        with self._lock:
            self.alive = False
            self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def finish(self, bound_s: float) -> bool:
        """Stop the agent and reap it within ``bound_s`` (so its CPU is counted with the
        runner's by whoever waits for the runner); False when it has not exited by then
        (it exits by itself once its import is done)."""
        self.stop()
        return self._exited.wait(bound_s)

    def _send(self, kind: str, *body: Any, queue: SimpleQueue[Pending] | None = None,
              ) -> Pending:
        """A request sent to the agent, without waiting: its reply is :meth:`result`'s (and
        the request is put on ``queue`` once it has one). A call is ``("call", key,
        method, args, kwargs)``: ``HubClient(*key).<method>(*args, **kwargs)``."""
        pending = Pending(queue)
        with self._lock:
            if not self.alive or self._stdin is None:
                raise AgentGone(self._gone())
            ident = next(self._ids)
            self._pending[ident] = pending
            try:
                _write(self._stdin, (kind, ident, *body))
            except (OSError, ValueError):
                del self._pending[ident]
                raise AgentGone(self._gone()) from None
        return pending

    def _gone(self) -> str:
        status = self.returncode
        how = ("no status yet" if status is None else f"killed by signal {-status}"
               if status < 0 else f"exit status {status}")
        return f"the huggingface_hub process (pid {self.pid}) is gone ({how})"

    def _replies(self, stdout: IO[bytes]) -> None:
        with contextlib.suppress(Exception):  # a frame that does not read: of no further use
            while (message := _read(stdout)) is not None:
                if message[0] == "ready":
                    self._got_ready(message)
                    continue
                with self._lock:
                    pending = self._pending.pop(message[1], None)
                if pending is not None:
                    pending.settle(message)
        self._ended()

    def _got_ready(self, message: tuple[Any, ...]) -> None:
        _, self.import_s, self.error, self.accelerator = message
        self.ended_at = time.time()
        with self._lock:
            self.ready.set()
            callbacks, self._on_ready = self._on_ready, []
        for callback in callbacks:
            callback(self)

    def _ended(self) -> None:
        with self._lock:
            self.alive = False
            pending, self._pending = list(self._pending.values()), {}
        # The exit status, once stdout has closed (by its exit: the wait is short); none
        # when someone else reaped it (a PID 1's reaper).
        with contextlib.suppress(ChildProcessError):
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        self._exited.set()
        for each in pending:
            each.settle(None)  # AgentGone
        self.stop()
        if not self.ready.is_set():
            self._got_ready(("ready", None, "AgentGone", None))

    def _stderr(self, stderr: IO[bytes]) -> None:
        for raw in stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            with self._lock:
                if self._held is not None:
                    self._held.append(line)
                    continue
            _say(line)

    def release_output(self) -> None:
        """Pass the agent's stderr on from now (the lines held so far first)."""
        with self._lock:
            held, self._held = self._held or [], None
        for line in held:
            _say(line)


def _say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)  # fsm.output.log makes it a library.stderr event


_agent: Agent | None = None
_agent_lock = threading.Lock()
_agent_pid: int | None = None  # the process that started it (a fork starts its own)


def start(*, switch: bool = True, hold_output: bool = False, not_ours: Sequence[int] = ()
          ) -> Agent:
    """The process's agent, started now if there is none (or the last one is gone), in the
    process environment; ``switch``: it sets the transfer switch in its own; ``not_ours``:
    descriptors a forked agent closes."""
    global _agent, _agent_pid
    with _agent_lock:
        if _agent is None or not _agent.alive or _agent_pid != os.getpid():
            _agent = Agent(switch=switch, hold_output=hold_output, not_ours=not_ours)
            _agent_pid = os.getpid()
        return _agent


def current() -> Agent | None:
    """The agent this process started, if any."""
    return _agent if _agent_pid == os.getpid() else None


def _decode(failure: tuple[Any, ...]) -> BaseException:
    from fsm.hub.library import RemoteFailure

    if failure[0] == "oserror":  # ("oserror", errno, strerror, filename)
        return OSError(*failure[1:])
    return RemoteFailure(failure[1], failure[2])


# --- the agent's side ----------------------------------------------------------------------


def serve(*, switch: bool = True) -> None:
    """The agent's main: set the transfer switch (``switch``), load the library, say so,
    answer requests until stdin closes."""
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # a library's print goes to stderr, never between the frames
    for signum in _IGNORED:
        signal.signal(signum, signal.SIG_IGN)
    write_lock = threading.Lock()

    def reply(message: tuple[Any, ...]) -> None:
        with write_lock:
            _write(replies, message)

    from fsm import oom
    from fsm.hub import library

    oom.lower_own_oom_score()  # as the runner's: the worker is the OOM killer's choice
    began = time.monotonic()
    error: str | None = None
    accelerator: str | None = None
    os.environ.update(QUIET_SETTINGS)
    # The import makes some 100,000 objects and frees few of them: the collector's passes
    # over them meanwhile would find nothing, and they are the library's for good.
    gc.disable()
    try:
        if switch:
            accelerator = library.switch_transfer(os.environ)[0]
        library.load_library()
    except BaseException as exc:  # every call answers it
        error = type(exc).__name__
    finally:
        gc.freeze()  # never looked at again: only what the calls make is collected
        gc.enable()
    reply(("ready", round(time.monotonic() - began, 6), error, accelerator))

    @functools.cache  # one client per endpoint, token and timeout
    def client(key: tuple[Any, ...]) -> Any:
        from fsm.hub.client import HubClient

        return HubClient(*key)  # (endpoint, token, timeout_s)

    def run(message: tuple[Any, ...]) -> None:
        kind, ident = message[0], message[1]
        try:
            if kind == "configure":
                value: Any = library.apply_settings(message[2])
            elif kind == "probe":
                value = library.probe(message[2])
            else:
                _, _, key, method, args, kwargs = message
                value = getattr(client(key), method)(*args, **kwargs)
            reply(("ok", ident, value))
        except Exception as exc:
            reply(("err", ident, _encode(exc)))

    while (message := _read(requests)) is not None:
        if message[0] == "call":
            threading.Thread(target=run, args=(message,), daemon=True).start()
        else:  # settings, and what they are: in order, before the calls sent after them
            run(message)
    os._exit(0)  # the runner has gone: calls still in flight are of no use to anyone


def _encode(exc: Exception) -> tuple[Any, ...]:
    from fsm.hub.library import classify

    failure = classify(exc)  # a digest mismatch (ContentMismatch) reads as a transport one
    if failure.kind == "unknown" and isinstance(exc, OSError) and exc.errno is not None:
        # The agent's own disk (a full code root, a read-only one): the runner judges it
        # by its errno and path as it judges its own writes (fsm.host.storage).
        return ("oserror", exc.errno, exc.strerror, exc.filename)
    return ("failure", failure, type(exc).__name__)
