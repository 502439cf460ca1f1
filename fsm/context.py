"""What every state handler receives: the run's settings, collaborators and findings.

Handlers get their store, clock and process machinery from here, so tests hand in real
local ones instead of patching modules. The context carries data between states; it
never decides where the machine goes next (handlers return events for that).
"""

from __future__ import annotations

import math
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from fsm import rules, table
from fsm.attempt.lease import DEFAULT_LEASE_S, MIN_LEASE_S
from fsm.attempt.lock import AttemptLock
from fsm.attempt.publish import READBACK_S, Publisher
from fsm.attempt.result import Persisted
from fsm.budget import MIN_TRY_S, Budget
from fsm.clock import Deadline
from fsm.errors import DeadlineExceeded, HostFault, Interrupted, PayloadError, RetriableError
from fsm.host import gpus
from fsm.interrupt import InterruptFlag
from fsm.output.outlet import Outlet
from fsm.output.redact import Redactor
from fsm.payload import Destination, Payload
from fsm.prefetch import Background, Branch
from fsm.store.base import Fence, Store, StoreStats

if TYPE_CHECKING:
    from fsm.attempt.lease import LeaseKeeper
    from fsm.host.probe import HostProbe
    from fsm.policy import Fault
    from fsm.worker.supervise import WorkerExit

#: Opens a store handle: (destination, budget, environment, the attempt's counters).
StoreFactory = Callable[[Destination, Budget, Mapping[str, str], StoreStats], Store]

_FALSY = ("", "0", "false", "no", "off")
_T = TypeVar("_T")

# After SIGTERM/SIGINT the host is going away: Docker's default stop timeout is 10 s.
# The worker gets its grace only up to SIGNAL_STOP_S after the signal, verification runs
# up to SIGNAL_VERIFY_S, and the marker must have landed by SIGNAL_MARK_S.
SIGNAL_STOP_S = 4.0
SIGNAL_VERIFY_S = 6.0
SIGNAL_MARK_S = 8.0

# --- the end of the attempt (docs/lifecycle.md, "The end of the attempt") ------------------
#: The end of the attempt (VerifyRemote, then Mark) never gets less than this, even when it
#: begins at or after the attempt deadline: the marker's time is not cut below it.
END_MIN_S = 10.0
#: VerifyRemote takes at most this share of the end; Mark keeps the rest.
VERIFY_SHARE = 0.5
#: Every store call of the end is sized so that this many tries fit in what is left.
END_TRIES = 3
#: How long past a bound of the end the deadline watchdog waits before it takes over.
END_GRACE_S = 1.0
#: One try of the marker's commit is given this many times the slowest recent commit.
COMMIT_MARGIN = 1.25
#: The marker is left at least this many whole tries at the observed speed, and its
#: read-back, by the verification before it.
MARKER_TRIES_KEPT = 2


def marker_try_s(stats: StoreStats | None) -> float:
    """How long one try of the marker's commit is given at least: a little more than the
    slowest of the attempt's last few commits (``StoreStats.commit_s``), never under
    ``MIN_TRY_S``."""
    observed = stats.commit_s() if stats is not None else None
    return max(MIN_TRY_S, COMMIT_MARGIN * observed) if observed else MIN_TRY_S


class End:
    """The end of the attempt's own budget, fixed when it begins (VerifyRemote, or Mark
    when the attempt ends without verifying): it lasts until the attempt deadline, but at
    least :data:`END_MIN_S`; VerifyRemote gets the first :data:`VERIFY_SHARE` of it and
    Mark keeps the rest, so a worker that runs to its deadline is still verified and
    marked. After a signal verification ends :data:`SIGNAL_VERIFY_S` after it, and the
    marker's tries :data:`SIGNAL_MARK_S` after it. Each budget is split into
    :data:`END_TRIES` tries (``Budget.try_bound``).

    Whatever the verification's share, it leaves the marker :data:`MARKER_TRIES_KEPT`
    whole tries at the speed the attempt's commits were seen to go (:func:`marker_try_s`)
    and the marker's read-back (``fsm.attempt.publish.READBACK_S``): a slow Hub shortens the
    verification, never the marker's chance."""

    __slots__ = ("_deadline", "_interrupt", "began", "marker_try_s", "marking_since")

    def __init__(self, deadline: Deadline, interrupt: InterruptFlag,
                 stats: StoreStats | None = None) -> None:
        self.began = time.monotonic()
        #: When Mark began (None: not yet): from then on its bound is the one that counts.
        self.marking_since: float | None = None
        self._deadline = deadline
        self._interrupt = interrupt
        #: The least time one try of the marker gets (fixed when the end begins).
        self.marker_try_s = marker_try_s(stats)

    def _kept_for_marker(self) -> float:
        return MARKER_TRIES_KEPT * self.marker_try_s + READBACK_S

    def until(self) -> float:
        """When the end is over (monotonic), a signal aside."""
        return max(self._deadline.mono_at, self.began + END_MIN_S)

    def verify_by(self) -> float:
        """When VerifyRemote must be done (monotonic), a signal aside."""
        share = self.began + (self.until() - self.began) * VERIFY_SHARE
        return max(self.began, min(share, self.until() - self._kept_for_marker()))

    def signal_verify_s(self) -> float:
        """How long after a signal VerifyRemote may go on (its part of Docker's stop
        timeout): :data:`SIGNAL_VERIFY_S`, less what the marker must keep."""
        return max(0.0, min(SIGNAL_VERIFY_S, SIGNAL_MARK_S - self._kept_for_marker()))

    def verify_budget(self) -> Budget:
        """VerifyRemote's budget: split into tries, and not stopped by a signal (a
        confirmed completion outranks it), only bounded by it."""
        return Budget(Deadline.at_monotonic(self.verify_by()), self._interrupt,
                      split=END_TRIES, stops=False, signal_s=self.signal_verify_s())

    def mark_budget(self) -> Budget:
        """The marker's budget: the rest of the end, split into tries; a signal only
        bounds it (Docker's stop timeout)."""
        return Budget(Deadline.at_monotonic(self.until()), self._interrupt,
                      split=END_TRIES, stops=False, signal_s=SIGNAL_MARK_S,
                      min_try_s=self.marker_try_s)

    def watchdog_due(self) -> float:
        """When the deadline watchdog takes over (monotonic): a little after the bound of
        the part of the end under way (VerifyRemote's, else Mark's), a signal included."""
        if self.marking_since is None:
            by, after_signal = self.verify_by(), self.signal_verify_s()
        else:
            by, after_signal = self.until(), SIGNAL_MARK_S
        if (at := self._interrupt.at_mono) is not None:
            by = min(by, at + after_signal)
        return by + END_GRACE_S


@dataclass(frozen=True)
class Settings:
    """Where things are: from the command line, else the environment, else defaults."""

    payload_path: Path = Path("/root/flash/payload.json")
    #: ``--store`` as given; without it the store comes from the environment merged with
    #: the payload's env (``FLASH_STORE``, else the Hub at ``HF_ENDPOINT``).
    store_url: str | None = None
    code_root: Path = Path("/runcode")
    scratch_dir: Path = Path("/tmp")

    @classmethod
    def resolve(
        cls,
        environ: Mapping[str, str],
        *,
        payload: str | None = None,
        store: str | None = None,
        code_root: str | None = None,
        scratch_dir: str | None = None,
    ) -> Settings:
        # Absolute: the worker runs in another directory, and the paths it is handed (its
        # scratch dir, FLASH_PROGRESS_FILE) must name the runner's files.
        def pick(arg: str | None, var: str, default: Path) -> Path:
            return Path(arg or environ.get(var) or default).absolute()

        return cls(
            payload_path=pick(payload, "FLASH_PAYLOAD_PATH", cls.payload_path),
            store_url=store or None,
            code_root=pick(code_root, "FLASH_CODE_ROOT", cls.code_root),
            scratch_dir=pick(scratch_dir, "FLASH_SCRATCH_DIR", cls.scratch_dir),
        )


#: A watch's period (FLASH_STALL_S) is 0 (off) or at least this many seconds.
MIN_WATCH_S = 5.0


def watch_seconds(env: Mapping[str, str], key: str, default: float, *,
                  minimum: float = MIN_WATCH_S, can_be_off: bool = True) -> float:
    """The seconds a watch setting names: ``default`` when it is unset or empty, 0 for
    off (when it ``can_be_off``: a bound such as ``FLASH_GPU_QUERY_S`` cannot), else a
    finite number of at least ``minimum``; anything else raises
    :class:`~fsm.errors.PayloadError` naming ``key``."""
    raw = env.get(key)
    if raw is None or not raw.strip():
        return default
    value: float = _float(raw, math.nan)
    if value == 0 and can_be_off:
        return 0.0
    if not math.isfinite(value) or value < minimum:
        raise PayloadError(
            f"{key}={raw[:40]!r} is unusable: it must be "
            f"{'0 (off) or ' if can_be_off else ''}a number of seconds of "
            f"at least {minimum:g}"
        )
    return value


@dataclass(frozen=True)
class Tuning:
    """Knobs read from the runner's environment merged with the payload's env."""

    upload_console: bool = False
    console_upload_interval_s: float = 30.0
    stop_grace_s: float = 10.0
    exit_reserve_s: float | None = None  # None: derived from the budget
    pip_backoff_s: float = 2.0
    #: Seconds without a sign of progress before the worker is stalled (0: no watch;
    #: the default is CONTRACT section 7's).
    stall_s: float = 1800.0
    #: FLASH_PY_SPY as given: the stack sampler's path, "none" for none, None to find it.
    py_spy: str | None = None
    #: Seconds between looks at the GPUs while the worker runs (0: no host watch; the
    #: default is CONTRACT section 8's, as is the next one's).
    host_watch_s: float = 30.0
    #: Each nvidia-smi query's bound (FLASH_GPU_QUERY_S): a slower answer is none.
    gpu_query_s: float = gpus.DEFAULT_QUERY_S
    #: Seconds between renewals of the attempt's lease (FLASH_LEASE_S; 0: no lease).
    lease_s: float = DEFAULT_LEASE_S

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Tuning:
        """The knobs of ``env``; an unusable watch setting (``FLASH_STALL_S``,
        ``FLASH_HOST_WATCH_S``, ``FLASH_GPU_QUERY_S``, ``FLASH_LEASE_S``) is an unusable payload:
        :class:`~fsm.errors.PayloadError` naming it."""
        return cls(
            upload_console=env.get("FLASH_UPLOAD_CONSOLE", "").strip().lower() not in _FALSY,
            console_upload_interval_s=max(5.0, _float(env.get("FLASH_CONSOLE_UPLOAD_INTERVAL_S"),
                                                      cls.console_upload_interval_s)),
            stop_grace_s=max(0.0, _float(env.get("FLASH_STOP_GRACE_S"), cls.stop_grace_s)),
            exit_reserve_s=_float(env.get("FLASH_EXIT_RESERVE_S"), None),
            pip_backoff_s=max(0.0, _float(env.get("FLASH_PIP_BACKOFF_S"), cls.pip_backoff_s)),
            stall_s=watch_seconds(env, "FLASH_STALL_S", cls.stall_s),
            py_spy=env.get("FLASH_PY_SPY") or None,
            host_watch_s=watch_seconds(env, "FLASH_HOST_WATCH_S", cls.host_watch_s),
            gpu_query_s=watch_seconds(env, "FLASH_GPU_QUERY_S", cls.gpu_query_s,
                                      minimum=gpus.MIN_QUERY_S, can_be_off=False),
            lease_s=watch_seconds(env, "FLASH_LEASE_S", cls.lease_s, minimum=MIN_LEASE_S),
        )


def _float(value: str | None, default: Any) -> Any:
    with suppress(ValueError):  # unset, empty or not a number: the default
        return float(value or "")
    return default


def host_fault(hostname: str, verdict: gpus.StartVerdict, snap: gpus.Snapshot) -> HostFault:
    """The start's verdict as the attempt's failure: its rule, a message naming the GPU
    (index and UUID) and what it reported, and the findings and snapshot as evidence."""
    rule = {"short": rules.HOST_GPU_MISSING, "unresponsive": rules.HOST_GPU_UNRESPONSIVE,
            "busy": rules.HOST_GPU_BUSY}.get(verdict.kind or "", rules.HOST_GPU_UNHEALTHY)
    retry = f"before the worker started, retry on a fresh host: {verdict.text}"
    message = {"short": f"host {hostname} is short of GPUs: {verdict.text}",
               "unresponsive": f"host {hostname}'s GPUs are not answering {retry}",
               }.get(verdict.kind or "", f"host {hostname} is {verdict.kind} {retry}")
    evidence = {"gpu_health": {"findings": verdict.findings.evidence(),
                               "snapshot": snap.evidence()}}
    return HostFault(message, rule=rule, evidence=evidence)


#: What a state downloads ahead of itself (``table.PREFETCH``, ``states.AHEAD``): given
#: the context, the work to start, or None when there is nothing to download.
Ahead = Callable[["Context"], Callable[[Store], object] | None]


@dataclass
class Timeline:
    """The states the attempt passed through, in order (the marker's ``path``), and the
    seconds it spent in each (the last log line's ``seconds``): the one record of both."""

    path: list[str] = field(default_factory=list)
    _spent: dict[str, float] = field(default_factory=dict)
    _entered: float = 0.0

    def enter(self, state: str) -> float:
        """The attempt is in ``state`` from now; returns now (monotonic)."""
        now = time.monotonic()
        if self.path:
            left = self.path[-1]
            self._spent[left] = self._spent.get(left, 0.0) + now - self._entered
        self.path.append(state)
        self._entered = now
        return now

    def seconds(self) -> dict[str, float]:
        """Seconds spent in each state so far, the current one included."""
        spent = dict(self._spent)
        if self.path:
            spent[self.path[-1]] = spent.get(self.path[-1], 0.0) + time.monotonic() - self._entered
        return {state: round(seconds, 3) for state, seconds in spent.items()}


#: How the worker is started, after the runner's own interpreter (CONTRACT section 5):
#: ResolveSpec measures it, Train runs it.
WORKER_ARGV: tuple[str, ...] = ("-m", "flash.engine.worker")


@dataclass
class Stall:
    """Where a stalled worker was (the marker's ``stall``, CONTRACT section 7)."""

    silent_s: float
    last_line: str
    where: str | None
    where_in_code: str | None
    #: The previous attempt that stalled on the same line, when VerifyRemote found one.
    previous: dict[str, Any] | None = None

    @property
    def place(self) -> str | None:
        """The worker's own innermost frame, ``function (path:line)``, when known (a
        library's wait is where every hang of a kind ends up), else the innermost one: the
        same line of the same file is the same hang."""
        return self.where_in_code or self.where or None

    def evidence(self) -> dict[str, Any]:
        """Every field, ``previous`` only when there is one."""
        return {k: v for k, v in asdict(self).items() if k != "previous" or v is not None}


@dataclass
class GpuChange:
    """What the GPUs reported changed since the start (the marker's ``gpu_change``)."""

    when: str
    findings: list[dict[str, Any]]
    text: str

    def kinds(self) -> set[str]:
        return {f["kind"] for f in self.findings if isinstance(f.get("kind"), str)}

    def evidence(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StacksNote:
    """What became of the worker's stacks (the marker's ``stacks``): the artifact they went
    into, what they were taken for and where the worker was, or why none were taken."""

    file: str | None = None
    why_not: str | None = None
    taken_for: str | None = None
    where_in_code: str | None = None
    #: The capture's own evidence (``fsm.worker.stacks.Stacks.evidence``).
    detail: dict[str, Any] = field(default_factory=dict)

    def evidence(self) -> dict[str, Any]:
        if self.file is None:
            return {"taken": False, "why": self.why_not}
        return {"file": self.file, "for": self.taken_for, "where_in_code": self.where_in_code,
                **self.detail}


@dataclass
class WorkerRun:
    """What Train learned about the worker, as typed facts: VerifyRemote reads them, and the
    marker shows them (:meth:`evidence`)."""

    #: How it ended; None until it has.
    exit: WorkerExit | None = None
    #: Whether the kernel's OOM killer ended a process of the container while it ran (None:
    #: the cgroup's count could not be read).
    oom_killed: bool | None = None
    stall: Stall | None = None
    stacks: StacksNote | None = None
    gpu_change: GpuChange | None = None
    #: The host watch's own evidence while the worker ran.
    gpu_watch: dict[str, Any] | None = None

    def evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.exit is not None:
            out["worker"] = {
                "exit_code": self.exit.returncode,
                "signal": signal.Signals(self.exit.signal).name if self.exit.signal else None,
                "reason": self.exit.reason,
                "seconds": round(self.exit.duration_s, 3),
                **({} if self.oom_killed is None else {"oom_killed": self.oom_killed}),
            }
        facts = {"stall": self.stall, "stacks": self.stacks, "gpu_change": self.gpu_change}
        out.update((key, fact.evidence()) for key, fact in facts.items() if fact is not None)
        if self.gpu_watch is not None:
            out["gpu_watch"] = self.gpu_watch
        return out


@dataclass(frozen=True)
class Failure:
    """Why the attempt failed: what Mark publishes."""

    rule: rules.Rule
    message: str  # redacted, one line
    state: str

    @property
    def retriable(self) -> bool:
        return self.rule.retriable


@dataclass
class Context:
    settings: Settings
    environ: Mapping[str, str]
    open_store: StoreFactory
    interrupt: InterruptFlag = field(default_factory=InterruptFlag)
    redactor: Redactor = field(default_factory=Redactor)
    python: str = sys.executable
    #: Where the worker's console is passed on (the runner's stdout), never blocking it.
    out: Outlet | None = None
    publisher: Publisher = field(default_factory=Publisher)
    lock: AttemptLock | None = None
    #: Sealed when the final commit starts: no optional upload lands after it.
    fence: Fence = field(default_factory=Fence)
    #: Commits and 429s of every store handle of the attempt (the marker's evidence).
    store_stats: StoreStats = field(default_factory=StoreStats)
    # --- learned as the run goes -----------------------------------------------------
    #: The attempt's first start (epoch): this process's until LoadPayload reads the
    #: persisted one (``fsm.attempt.start``); the exit reserve is derived from it.
    started_at: float = 0.0
    deadline: Deadline = field(default_factory=lambda: Deadline.after(86_400.0))
    tuning: Tuning = field(default_factory=Tuning)
    dest: Destination | None = None
    payload: Payload | None = None
    store: Store | None = None
    worker_env: dict[str, str] | None = None
    #: What Train learned about the worker (typed; the marker's evidence of it).
    worker: WorkerRun = field(default_factory=WorkerRun)
    #: VerifyRemote's judgement of the worker's fault (the marker's ``fault``).
    judged_fault: Fault | None = None
    #: The marker as published (Mark), or as replayed.
    published_marker: dict[str, Any] | None = None
    #: ``nvidia-smi``'s answer, asked for once the attempt is owned (LoadPayload)
    host: HostProbe | None = None
    #: The GPUs' health before the worker started (``fsm.host.gpus``): what later snapshots
    #: are compared with.
    host_start: gpus.Snapshot | None = None
    #: What ends the running state at once, set from another thread (the driver raises
    #: it): a fault the GPUs reported while setup ran (:meth:`watch_host`), or a later
    #: attempt found by the preload's lease (:meth:`halt_with`).
    halt: RetriableError | None = None
    #: Stops setup's waits (the extras install, downloads and their retries): every stop
    #: signal, and a fault the GPUs report (:meth:`watch_host`).
    setup_stop: InterruptFlag = field(default_factory=InterruptFlag)
    #: The worker's process group while it runs (the deadline watchdog kills it).
    worker_pgid: int | None = None
    #: The attempt's lease while the worker or the preload runs (CONTRACT section 10):
    #: the marker's commit removes what it wrote.
    lease: LeaseKeeper | None = None
    failure: Failure | None = None
    replayed: Persisted | None = None
    #: The payload's env as read (even from an invalid payload): it decides the store.
    raw_env: Mapping[str, str] = field(default_factory=dict)
    #: Downloads started ahead of the state that joins them (``fsm.prefetch``), by the
    #: joining state.
    prefetch: dict[str, Branch[Any]] = field(default_factory=dict)
    #: What a state downloads ahead of itself, by state (``states.AHEAD``): given the
    #: context, the work to start, or None when there is nothing to download.
    ahead: Mapping[str, Ahead] = field(default_factory=dict)
    #: Artifacts that go up in the marker's commit (name -> text), e.g. preload_result.json.
    end_artifacts: dict[str, str] = field(default_factory=dict)
    #: The states passed through, and the time spent in each.
    timeline: Timeline = field(default_factory=Timeline)
    #: The marker's evidence the states put in, every key of it published as it is (the
    #: worker's facts are :attr:`worker`'s, typed).
    evidence: dict[str, Any] = field(default_factory=dict)
    #: The end of the attempt once it began (:meth:`begin_end`).
    end: End | None = None
    _tail_store: Store | None = None
    #: The filesystems under the runner's directories at its start (``fsm.host.storage``), by
    #: mount point: a full disk is judged against them.
    storage_start: dict[str, Any] = field(default_factory=dict)
    #: While False, a signal only sets the flag (the handler watches it itself).
    raise_on_interrupt: bool = False

    def __post_init__(self) -> None:
        self.setup_stop = self.interrupt.follower()

    def watch_host(self, expected: int | None) -> None:
        """From now until the worker starts, a fault the GPUs report (``fsm.host.probe``) ends
        setup the moment it comes: it is kept as :attr:`host_fault`, and
        :attr:`setup_stop` stops the install and the downloads under way."""
        probe = self.host
        assert probe is not None, "LoadPayload starts the probe"
        probe.limit(self.tuning.gpu_query_s)
        probe.watch(expected, lambda verdict, snap: self.halt_with(
            host_fault(probe.hostname, verdict, snap)))

    def halt_with(self, fault: RetriableError) -> None:
        """End the running state with ``fault`` (from any thread): the first one stays, and
        :attr:`setup_stop` stops the install and the downloads under way."""
        if self.halt is None:
            self.halt = fault
        self.setup_stop.trigger(15)

    def settle_host(self, expected: int | None) -> None:
        """Before the worker starts (or a preload claims success): wait for the GPUs'
        verdict (at most ``FLASH_GPU_QUERY_S``; a signal ends the wait), raise the fault
        it reports, and keep the snapshot as the baseline of later looks."""
        if (probe := self.host) is None:
            return
        deadline = self.work_deadline
        waiting_since = time.monotonic()
        verdict, snap = probe.settle(
            expected, stopped=lambda: self.interrupt.is_set() or deadline.expired())
        # How long nvidia-smi took from the runner's start, and how much of it the worker
        # (or the preload's verdict) waited for after setup: the start's one serial wait.
        structlog.get_logger("fsm.host").info(
            "host.gpus_settled", seconds=round(snap.seconds, 3),
            waited_s=round(time.monotonic() - waiting_since, 3), decided=verdict.decided)
        if self.interrupt.is_set():
            raise Interrupted(self.interrupt.signum or 15)
        if not verdict.decided and deadline.expired():
            raise DeadlineExceeded("run wall deadline exceeded while waiting for the GPUs' "
                                   "answer before the worker")
        if self.halt is not None:
            raise self.halt
        if verdict.kind is not None:
            raise host_fault(probe.hostname, verdict, snap)
        self.host_start = snap

    @property
    def path(self) -> list[str]:
        """The states the attempt passed through, in order (:attr:`timeline`)."""
        return self.timeline.path

    def hostname(self) -> str:
        """This machine's name: the probe's, else the kernel's."""
        return self.host.hostname if self.host is not None else socket.gethostname()

    def host_id(self) -> str:
        """What names this machine (``host.id``, CONTRACT section 9): from the GPUs' answer
        before the worker when there was one, else from what the probe has (the boot id
        and the hostname where nvidia-smi lists no GPU)."""
        from fsm.host.probe import facts_of, host_id

        if (probe := self.host) is None:
            return host_id(self.hostname())
        start = self.host_start
        facts = facts_of(probe.hostname, start) if start is not None else probe.facts(0.0)
        return facts.id or host_id(probe.hostname)

    @property
    def reserve_s(self) -> float:
        """Seconds of the budget kept back from the worker for the tail, the verification
        and the marker: FLASH_EXIT_RESERVE_S, else a tenth of the budget (1 to 60 s)."""
        if self.tuning.exit_reserve_s is not None:
            return max(0.0, self.tuning.exit_reserve_s)
        return min(60.0, max(1.0, (self.deadline.at - self.started_at) * 0.1))

    @property
    def work_deadline(self) -> Deadline:
        """When work (the worker included) must stop so the exit still fits."""
        return self.deadline.earlier_by(self.reserve_s)

    @property
    def stop_deadline(self) -> Deadline:
        """When a worker being stopped must be gone: half the reserve stays for the exit,
        and after a signal no later than SIGNAL_STOP_S after it."""
        deadline = self.deadline.earlier_by(self.reserve_s / 2)
        at = self.interrupt.at_mono
        return deadline if at is None else deadline.earliest(
            Deadline.at_monotonic(at + SIGNAL_STOP_S))

    def begin_end(self) -> End:
        """The end of the attempt, fixed the first time it is asked for (VerifyRemote, or
        Mark): see :class:`End`."""
        if self.end is None:
            self.end = End(self.deadline, self.interrupt, self.store_stats)
        return self.end

    def run_past_signal(self, fn: Callable[[], _T], *, until_s: float) -> _T:
        """``fn()``, which a signal does not cut short but bounds: once SIGTERM/SIGINT has
        come, ``fn`` gets until ``until_s`` seconds after it, then ``Interrupted`` is raised
        and ``fn`` is abandoned in its daemon thread (it holds no lock of ours)."""
        call = Background(fn, "flash-past-signal")
        # Short slices: the flag is set inside a signal handler, which must not set an Event.
        while not call.done.wait(0.05):
            if (at := self.interrupt.at_mono) is not None and time.monotonic() >= at + until_s:
                raise Interrupted(self.interrupt.signum or 15)
        return call.result()

    @property
    def owns_attempt(self) -> bool:
        """Whether this process holds the attempt's lock: nothing is written before."""
        return self.lock is not None and self.lock.held

    def require_payload(self) -> Payload:
        assert self.payload is not None, "LoadPayload sets the payload"
        return self.payload

    def require_store(self) -> Store:
        """The store for work, bounded by the work deadline."""
        assert self.store is not None, "LoadPayload opens the store"
        return self.store

    def tail_store(self) -> Store:
        """The store for the periodic console tails while the worker runs, bounded by the
        attempt deadline; a signal stops its retries."""
        if self._tail_store is None:
            self._tail_store = self.store_for(self.budget)
        return self._tail_store

    @cached_property
    def verify_store(self) -> Store:
        """The store for VerifyRemote (one handle, made when first asked for): bounded by its
        share of the end, split into tries."""
        return self.store_for(self.begin_end().verify_budget())

    def setup_store(self, flag: InterruptFlag | None = None) -> Store:
        """The store for setup (FetchCode, ResolveSpec, Preload): bounded by the work
        deadline, its retries stopped by ``flag`` (a prefetch branch's cancel, which a signal
        triggers too), else by :attr:`setup_stop`."""
        return self.store_for(Budget(self.work_deadline, self.setup_stop if flag is None else flag))

    def store_for(self, budget: Budget) -> Store:
        """A store handle for the attempt's destination, every call bounded by ``budget``."""
        assert self.dest is not None, "LoadPayload finds the destination"
        return self.open_store(self.dest, budget, self.store_env(), self.store_stats)

    def start_ahead(self, state: str) -> None:
        """Start the downloads the table says ``state`` starts ahead of later states
        (``table.PREFETCH``), each as the branch of the state that joins it, with what that
        state's module says it downloads (``ahead``, from ``states.AHEAD``): once, and only
        where there is something to download. Each branch has a store handle of its own
        (:meth:`setup_store`)."""
        for joiner in table.PREFETCH.get(state, ()):
            plan = self.ahead.get(joiner)
            work = plan(self) if plan is not None and joiner not in self.prefetch else None
            if work is not None:
                flag = self.setup_stop.follower()
                self.prefetch[joiner] = Branch(joiner, partial(work, self.setup_store(flag)), flag)

    @property
    def budget(self) -> Budget:
        """The attempt's budget: its deadline, its interrupt flag, its clock."""
        return Budget(self.deadline, self.interrupt)

    def store_env(self) -> dict[str, str]:
        """What the store obeys: the runner's environment with the payload's env over it
        (CONTRACT section 2), known even before the rest of the payload is valid."""
        return {**self.environ, **self.raw_env}

    @property
    def scratch(self) -> Path:
        return self.settings.scratch_dir

    def merged_env(self) -> dict[str, str]:
        """The runner's environment with the payload's env merged over it."""
        return {**self.environ, **(self.payload.env if self.payload is not None else {})}

    @contextmanager
    def interrupts_handled(self) -> Iterator[None]:
        """Within this block the handler watches ``interrupt`` itself: a signal only sets
        the flag. (The driver looks at the flag again before the next state.)"""
        previous, self.raise_on_interrupt = self.raise_on_interrupt, False
        try:
            yield
        finally:
            self.raise_on_interrupt = previous

    def on_signal(self, signum: int, _frame: object = None) -> None:
        """The SIGTERM/SIGINT handler: set the flag; raise into interruptible work."""
        self.interrupt.trigger(signum)
        if self.raise_on_interrupt:
            self.raise_on_interrupt = False  # raise once; the driver takes it from here
            raise Interrupted(signum)
