"""What the GPUs say about themselves: ``nvidia-smi``'s answers, read as data, and the
verdicts drawn from them (CONTRACT section 8).

A snapshot is three invocations of nvidia-smi's selective query interface, started together
(nvidia-smi takes *one* of ``--query-gpu``, ``--query-compute-apps``,
``--query-remapped-rows`` per invocation: its ``-h`` lists them under "[one of]"):

* ``--query-gpu=`` ``GPU_FIELDS``: the GPUs, their memory and their ECC / page retirement
  health;
* ``--query-remapped-rows=`` ``REMAP_FIELDS``: row remapping (Ampere and newer);
* ``--query-compute-apps=`` ``APP_FIELDS``: the processes holding a compute context

(the fields are :mod:`fsm.host.queries`'s).

Each with ``--format=csv,noheader,nounits``, in a session of its own, and each **ends on
its own**: its answer, or its bound (``FLASH_GPU_QUERY_S``, default
:data:`DEFAULT_QUERY_S`), when it is killed with its process group.

**Only what the GPUs say is evidence; silence is not.** nvidia-smi is slow on healthy
hosts (seconds on a loaded 8-GPU host, about 30 s without the persistence daemon), so a
query that did not answer says nothing about the GPUs. ``problem`` records the silence of
``--query-gpu`` (``hung``: killed at its bound; ``pending``: still within it); a silent
remapped-rows or compute-apps query leaves its part unknown and is only a warning. Every
verdict below reads rows and messages that nvidia-smi printed, never a ``problem``; the
one place silence decides anything is the start's ``host-gpu-unresponsive``
(:func:`before_setup`): ``--query-gpu`` unanswered at its bound, the driver itself not
answering.

What nvidia-smi prints is kept as it is meant:

* a field the GPU or driver does not support (``[N/A]``, ``N/A``, ``[Not Supported]``, an
  empty field, any ``[...]`` error token) is *unknown* (``None``), never sick;
* a GPU NVML cannot reach prints ``Unable to determine the device handle for GPU<bus id>:
  Unknown Error`` and the command exits non-zero, while the other GPUs' rows may still be
  printed: the rows are kept and the lost GPU is named (:class:`LostGpu`);
* a warning on stderr beside the rows is a warning, not a failure;
* no nvidia-smi on PATH is ``absent``: no fault unless the caller needs GPUs;
* ``No devices were found`` is an answer: no GPUs;
* a health field the driver refuses (``Field "..." is not a valid field to query.``: fields
  get renamed across driver releases) is dropped and ``--query-gpu`` asked again, within
  the same bound: that field is unknown, the rest is read.

:func:`snapshot` takes one, blocking; :func:`start` takes one in a daemon thread
(:class:`PendingSnapshot`), whose answers can be judged one by one as they come (the start
judges each the moment it arrives). :func:`parse_snapshot` is the reading alone, a pure
function of what nvidia-smi printed.

The verdicts are pure functions of snapshots, for the policy and for property tests:
:func:`before_setup` (sick, busy, short or unresponsive: the start's one judgment, from
:func:`unhealthy` and :func:`busy`) and :func:`changed` (while the worker runs, and after
it died). Each returns findings that name the GPU by index and UUID, as marker evidence
(:meth:`Verdict.evidence`) and as one line for the marker's ``error``
(:meth:`Verdict.describe`).

The standard library only (and ``fsm.worker.bounded``, which runs the queries, with
``fsm.clock``): this runs on the start path, before any setup.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from fsm.host import queries
from fsm.host.queries import QUERIES, Asked
from fsm.worker.bounded import Ran, Runs

#: ``FLASH_GPU_QUERY_S``'s default: each query's bound (CONTRACT section 8). nvidia-smi takes
#: about 30 s on a large host without the persistence daemon (Azure/aks-gpu#105).
DEFAULT_QUERY_S = 60.0
#: ``FLASH_GPU_QUERY_S`` is a number of at least this many seconds.
MIN_QUERY_S = 5.0
#: A GPU holding more memory than this before the attempt started anything is busy.
BUSY_MEMORY_MIB = 1024
#: How many times a refused ``--query-gpu`` is asked again with fewer fields.
RETRIES = 2
#: A message kept from nvidia-smi (a failure's last line, a warning) is at most this long.
MESSAGE_CHARS = 300
#: At most this many warnings are kept.
WARNINGS_KEPT = 10

Problem = Literal["absent", "failed", "hung", "pending"]

_BUS = r"[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]"
#: The message of a GPU NVML cannot reach, in the spellings drivers print:
#: ``for GPU 0000:0B:00.0: Unknown Error`` (older), ``for GPU0000:65:00.0: Unknown Error``,
#: ``for GPU1: 0000:34:00.0: Unknown Error`` (newer), ``for GPU1: Unknown Error``.
_LOST = re.compile(
    r"Unable to (?:determine|detect) the device handle for GPU\s*"
    rf"(?:(?P<bus>{_BUS})|(?P<index>\d+)(?::\s*(?P<bus2>{_BUS}))?)"
    r"\s*:\s*(?P<reason>.*?)\s*$",
    re.IGNORECASE,
)
_BUS_ID = re.compile(r"^(?:([0-9A-Fa-f]{1,8}):)?([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])$")
_NUMBER = re.compile(r"^(\d+)(?:\s*[A-Za-z%]+)?$")
_REFUSED = re.compile(r'Field "([^"]+)" is not a valid field to query')
#: nvidia-smi's answer on a host without a GPU it can see (an answer: none)
NO_DEVICES = "No devices were found"
_UNKNOWN_WORDS = frozenset({"", "n/a", "na", "not supported", "unknown error", "unknown"})
_FLAGS = {**dict.fromkeys(("yes", "true", "enabled", "active", "pending"), True),
          **dict.fromkeys(("no", "false", "disabled", "not active", "none"), False)}


# --- what a snapshot holds -----------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    """One GPU as ``--query-gpu`` (and ``--query-remapped-rows``) listed it. A field is
    ``None`` when nvidia-smi printed no value for it (unsupported, ``[N/A]``, an error
    token): *unknown*, never sick. ``unknown`` says what was printed instead."""

    index: int | None
    uuid: str | None
    name: str | None = None
    #: ``00000000:3B:00.0``: the 8-digit domain form of ``pci.bus_id``
    bus_id: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    driver: str | None = None
    #: ``ecc.errors.uncorrected.volatile.total``: since the driver loaded
    ecc_uncorrected: int | None = None
    #: ``retired_pages.pending`` (pre-Ampere; ``[N/A]`` on A100 and H100)
    retired_pages_pending: bool | None = None
    #: ``--query-remapped-rows`` (Ampere and newer)
    remapped_correctable: int | None = None
    remapped_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    #: (field, what nvidia-smi printed) for each field whose value is unknown
    unknown: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        """``GPU 3 (GPU-6d2b...)``: how a message names it."""
        where = self.uuid or (f"at {self.bus_id}" if self.bus_id else None)
        if self.index is not None:
            return f"GPU {self.index} ({where})" if where else f"GPU {self.index}"
        if self.uuid:
            return f"GPU {self.uuid}"
        return f"the GPU at {self.bus_id}" if self.bus_id else "a GPU"

    def evidence(self) -> dict[str, Any]:
        return _known_fields(self, skip=("driver", "unknown"))


@dataclass(frozen=True)
class LostGpu:
    """A GPU nvidia-smi names but NVML cannot reach (``Unable to determine the device
    handle``): its bus id, its index only when the message wrote one, and why."""

    bus_id: str | None
    index: int | None
    reason: str
    #: the message as nvidia-smi printed it
    line: str

    def evidence(self) -> dict[str, Any]:
        return _known_fields(self, skip=("line",))


@dataclass(frozen=True)
class App:
    """One entry of ``--query-compute-apps``. Inside a container ``pid`` is the host's
    number for the process (the driver knows no PID namespaces), which may name no process,
    or another one, in the container's own namespace."""

    gpu_uuid: str | None
    pid: int | None
    process_name: str | None
    used_memory_mib: int | None

    def evidence(self) -> dict[str, Any]:
        return _known_fields(self)


def _present(facts: Mapping[str, Any]) -> dict[str, Any]:
    """``facts`` as marker evidence: those that are not None (unknown, or nothing to say)."""
    return {key: value for key, value in facts.items() if value is not None}


def _known_fields(facts: Any, skip: Collection[str] = ()) -> dict[str, Any]:
    """A dataclass's fields as marker evidence: those not skipped and not None."""
    return _present({f.name: getattr(facts, f.name) for f in fields(facts) if f.name not in skip})


@dataclass(frozen=True)
class Answer:
    """What one nvidia-smi invocation printed. ``status`` is None when it did not exit
    within the bound (``hung``) or could not be started (``error`` says why)."""

    stdout: str = ""
    stderr: str = ""
    status: int | None = 0
    hung: bool = False
    error: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Query:
    """How one invocation went: ``answered`` (exit 0, or rows printed beside a non-zero
    exit), ``failed``, ``hung`` (killed at its bound), ``pending`` (still running: a partial
    snapshot) or ``not-started``."""

    name: str
    outcome: Literal["answered", "failed", "hung", "pending", "not-started"]
    status: int | None
    seconds: float
    detail: str = ""

    def evidence(self) -> dict[str, Any]:
        return _present({"outcome": self.outcome, "seconds": round(self.seconds, 3),
                         "status": self.status, "detail": self.detail or None})


@dataclass(frozen=True)
class Snapshot:
    """What nvidia-smi said about the GPUs, once.

    ``problem`` is None when ``--query-gpu`` answered; else ``"absent"`` (no nvidia-smi on
    PATH), ``"failed"`` (it exited non-zero without a GPU row or a lost-GPU message, or
    could not start), ``"hung"`` (it did not answer within its bound and was killed) or
    ``"pending"`` (a partial snapshot: it is still within its bound). The other two
    queries' silence is no ``problem``: their part is unknown (a warning says so). ``apps``
    is None when ``--query-compute-apps`` did not answer (unknown, not empty). ``listed``
    is True when ``--query-gpu`` answered with its rows, so ``gpus`` and ``lost`` are every
    GPU nvidia-smi knows (a listing of nothing but lost-GPU messages may have stopped at the
    first one: not ``listed``)."""

    gpus: tuple[Gpu, ...] = ()
    lost: tuple[LostGpu, ...] = ()
    apps: tuple[App, ...] | None = None
    problem: Problem | None = None
    detail: str = ""
    listed: bool = False
    warnings: tuple[str, ...] = ()
    queries: tuple[Query, ...] = ()
    seconds: float = 0.0
    timeout_s: float = DEFAULT_QUERY_S

    @property
    def complete(self) -> bool:
        """Every query ended (answered, failed or killed at its bound)."""
        return all(query.outcome != "pending" for query in self.queries)

    def describe_problem(self) -> str:
        return {
            None: "nvidia-smi answered",
            "absent": "nvidia-smi is not on PATH (no NVIDIA driver visible)",
            "hung": f"nvidia-smi --query-gpu did not answer within {self.timeout_s:g}s "
                    "(FLASH_GPU_QUERY_S): the driver is not answering",
            "pending": f"nvidia-smi has not answered yet ({self.seconds:.1f}s so far)",
        }.get(self.problem, f"nvidia-smi failed: {self.detail}")

    def evidence(self) -> dict[str, Any]:
        """The snapshot as marker evidence (JSON-ready)."""
        return _present({
            "gpus": [gpu.evidence() for gpu in self.gpus],
            "seconds": round(self.seconds, 3),
            "lost": [lost.evidence() for lost in self.lost] or None,
            "apps": None if self.apps is None else [app.evidence() for app in self.apps],
            "problem": self.problem,
            "error": None if self.problem is None else self.describe_problem(),
            "warnings": list(self.warnings) or None,
            "queries": {query.name: query.evidence() for query in self.queries},
        })


# --- taking one ----------------------------------------------------------------------------


def snapshot(environ: Mapping[str, str], timeout_s: float = DEFAULT_QUERY_S) -> Snapshot:
    """Ask nvidia-smi (found on ``environ``'s PATH) about the GPUs: returns within
    ``timeout_s`` (plus :data:`fsm.worker.bounded.KILL_GRACE_S` when something had to be
    killed), never raises for anything nvidia-smi does."""
    return PendingSnapshot(environ, timeout_s, background=False).partial()  # taken: whole


class PendingSnapshot:
    """A snapshot being taken: its three queries run at once, each ending on its own (its
    answer, or the bound). In a daemon thread unless ``background`` is False.

    ``partial()`` is what has answered so far, as a :class:`Snapshot` whose unfinished
    queries are ``pending``: a caller judges each answer the moment it comes.
    ``result(wait_s)`` is the whole snapshot once every query ended. ``limit(s)`` moves
    the bound (counted from the start) while the queries run: the runner asks before it
    has read the payload that may set ``FLASH_GPU_QUERY_S``. ``subscribe(fn)`` calls
    ``fn()`` (from the taking thread) after each answer."""

    def __init__(self, environ: Mapping[str, str], timeout_s: float = DEFAULT_QUERY_S, *,
                 background: bool = True, asked: Asked | None = None) -> None:
        # ``asked``: the queries, when already started (``fsm.host.queries.ask``): the bound
        # counts from their start
        self.started = asked.started if asked is not None else time.monotonic()
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._answers: dict[str, Answer] = {}
        self._fields: tuple[str, ...] = queries.GPU_FIELDS
        self._refused: list[str] = []
        self._final: Snapshot | None = None
        self._listeners: list[Callable[[], None]] = []
        if background:
            threading.Thread(target=self._take, args=(dict(environ), asked), name="gpu-snapshot",
                             daemon=True).start()
        else:
            self._take(environ, asked)

    def limit(self, timeout_s: float) -> None:
        """Bound every query at ``timeout_s`` from the start (applied within
        :data:`fsm.worker.bounded.POLL_S`)."""
        self.timeout_s = timeout_s

    def deadline(self) -> float:
        """When the queries still running are killed (monotonic)."""
        return self.started + self.timeout_s

    def done(self) -> bool:
        return self._final is not None

    def result(self, wait_s: float | None = None) -> Snapshot | None:
        """The whole snapshot, or None when it is not taken within ``wait_s`` (None: wait
        for it; it takes at most its bound plus :data:`fsm.worker.bounded.KILL_GRACE_S`)."""
        with self._cond:
            self._cond.wait_for(lambda: self._final is not None, wait_s)
            return self._final

    def partial(self) -> Snapshot:
        """What has answered so far (the whole snapshot once it is taken)."""
        with self._cond:
            if self._final is not None:
                return self._final
            answers, fields = dict(self._answers), self._fields
        return parse_snapshot(answers, gpu_fields=fields, seconds=time.monotonic() - self.started,
                              timeout_s=self.timeout_s, pending=set(QUERIES) - set(answers))

    def wait(self, seconds: float) -> None:
        """Wait at most ``seconds`` for the next answer (or the end)."""
        with self._cond:
            if self._final is None:
                self._cond.wait(max(0.0, seconds))

    def subscribe(self, listener: Callable[[], None]) -> None:
        """``listener()`` after every answer from now on, and once now."""
        with self._cond:
            self._listeners.append(listener)
        listener()

    def _take(self, environ: Mapping[str, str], asked: Asked | None) -> None:
        try:
            final = self._ask(asked if asked is not None else queries.ask(environ))
        except Exception as exc:  # a bug here must not leave the caller waiting forever
            final = Snapshot(problem="failed", timeout_s=self.timeout_s,
                             detail=f"snapshot crashed: {type(exc).__name__}: {exc}")
        with self._cond:
            self._final = final
            self._cond.notify_all()
        self._tell()

    def _tell(self) -> None:
        for listener in tuple(self._listeners):
            with contextlib.suppress(Exception):  # a listener's bug must not stop the snapshot
                listener()

    def _ask(self, asked: Asked) -> Snapshot:
        if asked.exe is None:
            return Snapshot(problem="absent", timeout_s=self.timeout_s)
        runs = Runs(self.deadline, reaper="nvidia-smi-reaper")
        for name, proc in asked.procs.items():
            runs.adopt(name, proc, asked.started)
        for name, ran in runs.answers():
            answer = _answer(ran)
            if name == "gpu" and len(self._refused) < RETRIES:
                fewer = _without_refused(answer, self._fields)
                if fewer is not None and time.monotonic() < self.deadline():
                    # its last line (never none: the refusal is a line of it)
                    self._refused.append(_lines(answer.stdout + "\n" + answer.stderr)[-1])
                    self._fields = fewer
                    runs.start("gpu", (asked.exe, f"--query-gpu={','.join(fewer)}", queries.FORMAT),
                               asked.env)
                    continue
            with self._cond:
                self._answers[name] = answer
                self._cond.notify_all()
            self._tell()
        snap = self.partial()  # every query answered: nothing pending
        if self._refused:
            note = (f"nvidia-smi refused a field ({'; '.join(self._refused)}); asked again "
                    "without it: unknown for every GPU")
            snap = replace(snap, warnings=(*snap.warnings, note[:MESSAGE_CHARS])[:WARNINGS_KEPT])
        return snap


#: Start a snapshot in the background: ``start(environ, timeout_s)``.
start = PendingSnapshot


def _answer(ran: Ran) -> Answer:
    """An invocation's :class:`Answer` from how its run ended."""
    if ran.start_error is not None:
        return Answer(status=None, error=f"could not start ({ran.start_error})")
    return Answer(stdout=ran.stdout.decode("utf-8", "replace"),
                  stderr=ran.stderr.decode("utf-8", "replace"),
                  status=ran.status, hung=ran.hung, seconds=ran.seconds)


def _without_refused(answer: Answer, fields: tuple[str, ...]) -> tuple[str, ...] | None:
    """The fields to ask again when nvidia-smi refused one (``Field "x" is not a valid
    field to query.``: a driver that renamed or dropped a health field): all but ``x``, or
    only ``queries.GPU_BASE_FIELDS`` when it names none of ours; None when nothing was
    refused or nothing is left to drop."""
    if answer.status in (None, 0) or _rows(answer.stdout, fields)[0]:
        return None
    found = _REFUSED.search(answer.stdout + "\n" + answer.stderr)
    if found is None or fields == queries.GPU_BASE_FIELDS:
        return None
    name = found.group(1)
    if name in fields and name in queries.GPU_HEALTH_FIELDS:
        return tuple(f for f in fields if f != name)
    return queries.GPU_BASE_FIELDS


# --- reading what it printed ---------------------------------------------------------------


def parse_snapshot(
    answers: Mapping[str, Answer],
    *,
    gpu_fields: Sequence[str] = queries.GPU_FIELDS,
    seconds: float = 0.0,
    timeout_s: float = DEFAULT_QUERY_S,
    pending: Collection[str] = (),
) -> Snapshot:
    """The snapshot the three answers (keyed as :data:`QUERIES`) make: a pure function of
    what nvidia-smi printed and how it exited. The queries named in ``pending`` are still
    running (a partial snapshot); any other missing one was not asked."""
    warnings: list[str] = []
    lost: dict[str, LostGpu] = {}
    asked: list[Query] = []
    parsed: dict[str, list[dict[str, str]]] = {}
    for name, its_fields in (("gpu", gpu_fields), ("remapped-rows", queries.REMAP_FIELDS),
                             ("compute-apps", queries.APP_FIELDS)):
        answer = answers.get(name)
        if answer is None:
            asked.append(Query(name, "pending", None, seconds, "still running") if name in pending
                         else Query(name, "not-started", None, 0.0, "not asked"))
            continue
        rows, stray = _rows(answer.stdout, its_fields)
        lines = stray + _lines(answer.stderr)
        said: list[str] = []
        for line in lines:
            if gone := _lost_gpu(line):
                lost.setdefault(gone.bus_id or gone.line, gone)
            elif line != NO_DEVICES:
                said.append(line[:MESSAGE_CHARS])
        # a line not said named a lost GPU, or that there is none: an answer too
        query = _outcome(name, answer, bool(rows) or len(said) < len(lines), said)
        asked.append(query)
        if query.outcome == "answered":
            parsed[name] = rows
            warnings += [line for line in said if line not in warnings]
        elif name != "gpu" and query.outcome == "failed":
            warnings.append(f"--query-{name} failed: {query.detail}")
        elif name != "gpu" and query.outcome == "hung":
            warnings.append(f"--query-{name} did not answer within {timeout_s:g}s: unknown")
    gpu_query = asked[0]
    problem = _PROBLEMS.get(gpu_query.outcome, "failed")
    detail = {"hung": "--query-gpu killed at its bound", "failed": gpu_query.detail}.get(
        problem or "", "")
    gpus = tuple(_gpu(row, parsed.get("remapped-rows")) for row in parsed.get("gpu", []))
    apps_rows = parsed.get("compute-apps")
    apps = None if apps_rows is None else tuple(_app(row) for row in apps_rows)
    return Snapshot(
        gpus=gpus,
        lost=tuple(lost.values()),
        apps=apps,
        problem=problem,
        detail=detail[:MESSAGE_CHARS],
        # A listing that printed only lost-GPU messages may have stopped at the first one
        # (drivers differ): then the GPUs it did not list are unknown, not gone.
        listed=gpu_query.outcome == "answered" and (
            bool(gpus) or gpu_query.status == 0 or _says(answers.get("gpu"), NO_DEVICES)),
        warnings=tuple(warnings[:WARNINGS_KEPT]),
        queries=tuple(asked),
        seconds=seconds,
        timeout_s=timeout_s,
    )


#: ``--query-gpu``'s outcome as the snapshot's ``problem`` (any other: ``failed``).
_PROBLEMS: dict[str, Problem | None] = {"answered": None, "hung": "hung", "pending": "pending"}


def _outcome(name: str, answer: Answer, listed: bool, said: list[str]) -> Query:
    if answer.error:
        return Query(name, "not-started", None, answer.seconds, answer.error[:MESSAGE_CHARS])
    if answer.hung:
        return Query(name, "hung", None, answer.seconds)
    if answer.status == 0 or listed:
        partial = "" if answer.status == 0 else f"exit {answer.status}"
        return Query(name, "answered", answer.status, answer.seconds, partial)
    return Query(name, "failed", answer.status, answer.seconds,
                 f"exit {answer.status}: {' / '.join(said) or 'no output'}"[:MESSAGE_CHARS])


def _says(answer: Answer | None, line: str) -> bool:
    return answer is not None and line in (answer.stdout + "\n" + answer.stderr).splitlines()


def _rows(text: str, fields: Sequence[str]) -> tuple[list[dict[str, str]], list[str]]:
    """The lines of ``text`` that are rows of ``fields`` (split at most ``len - 1`` times,
    so the last field keeps its commas), and the other non-empty lines."""
    rows: list[dict[str, str]] = []
    other: list[str] = []
    for line in _lines(text):
        parts = [part.strip() for part in line.split(",", len(fields) - 1)]
        row = dict(zip(fields, parts, strict=False))  # of another length: no row
        if len(parts) == len(fields) and _plausible(row):
            rows.append(row)
        else:
            other.append(line)
    return rows, other


def _lines(text: str) -> list[str]:
    """The non-empty lines of ``text``, stripped."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def _plausible(row: Mapping[str, str]) -> bool:
    """A row, not a message that happens to hold commas: its key field (a GPU's ``index``,
    an app's ``pid``, a remapping's GPU) reads right."""
    if "index" in row:
        return row["index"].isdigit()
    if "pid" in row:
        return row["pid"].isdigit() or _known(row["pid"]) is None
    return _bus_id(row["gpu_bus_id"]) is not None or row["gpu_uuid"].startswith(("GPU-", "MIG-"))


def _gpu(row: Mapping[str, str], remaps: list[dict[str, str]] | None) -> Gpu:
    uuid = _known(row["uuid"])
    bus = _bus_id(row["pci.bus_id"])
    # its row of --query-remapped-rows: by UUID, else by bus id
    remap: Mapping[str, str] = next((
        candidate for candidate in remaps or ()
        if (uuid and _known(candidate["gpu_uuid"]) == uuid)
        or (not uuid and bus and _bus_id(candidate["gpu_bus_id"]) == bus)), {})
    unknown = tuple((f, value) for f, value in {**row, **remap}.items()
                    if f not in ("gpu_uuid", "gpu_bus_id") and _known(value) is None)
    return Gpu(
        index=int(row["index"]),  # a row's index reads as a number (_plausible)
        uuid=uuid,
        name=_known(row["name"]),
        bus_id=bus,
        memory_total_mib=_int(row["memory.total"]),
        memory_used_mib=_int(row["memory.used"]),
        driver=_known(row["driver_version"]),
        ecc_uncorrected=_int(row.get("ecc.errors.uncorrected.volatile.total", "")),
        retired_pages_pending=_flag(row.get("retired_pages.pending", "")),
        remapped_correctable=_int(remap.get("remapped_rows.correctable", "")),
        remapped_uncorrectable=_int(remap.get("remapped_rows.uncorrectable", "")),
        remap_pending=_flag(remap.get("remapped_rows.pending", "")),
        remap_failure=_flag(remap.get("remapped_rows.failure", "")),
        unknown=unknown,
    )


def _app(row: Mapping[str, str]) -> App:
    name = _known(row["process_name"])
    return App(
        gpu_uuid=_known(row["gpu_uuid"]),
        pid=_int(row["pid"]),
        process_name=name[:MESSAGE_CHARS] if name else None,
        used_memory_mib=_int(row["used_gpu_memory"]),
    )


def _lost_gpu(line: str) -> LostGpu | None:
    found = _LOST.search(line)
    if found is None:
        return None
    return LostGpu(
        bus_id=_bus_id(found.group("bus") or found.group("bus2") or ""),
        index=int(found.group("index")) if found.group("index") else None,
        reason=found.group("reason") or "unknown",
        line=line.strip()[:MESSAGE_CHARS],
    )


def _known(value: str) -> str | None:
    """The value, or None for what nvidia-smi prints instead of one: ``[N/A]``,
    ``[Not Supported]``, any ``[...]`` error token, bare ``N/A``, nothing."""
    text = value.strip()
    bracketed = text.startswith("[") and text.endswith("]")
    return None if bracketed or text.lower() in _UNKNOWN_WORDS else text


def _int(value: str) -> int | None:
    """A count or a size, with or without its unit (``81559``, ``81559 MiB``)."""
    found = _NUMBER.match(_known(value) or "")
    return int(found.group(1)) if found else None


def _flag(value: str) -> bool | None:
    """``Yes``/``No`` (and ``1``/``0``, as some drivers print remapping flags)."""
    lowered = (_known(value) or "").lower()
    return int(lowered) > 0 if lowered.isdigit() else _FLAGS.get(lowered)


def _bus_id(value: str) -> str | None:
    """A PCI bus id in the form ``pci.bus_id`` prints it, ``00000000:3B:00.0``, whatever
    the width of the domain it was written with (messages write ``0000:3B:00.0``)."""
    found = _BUS_ID.match(value.strip())
    if found is None:
        return None
    domain, bus, device, function = found.groups()
    return f"{int(domain or '0', 16):08X}:{bus.upper()}:{device.upper()}.{function}"


# --- verdicts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One thing wrong with one GPU (or, for ``unanswered``, with nvidia-smi itself).

    ``kind`` is one of ``ecc-uncorrected``, ``retired-pages-pending``,
    ``row-remap-pending``, ``row-remap-failure``, ``unreachable`` (:func:`unhealthy`);
    ``memory-used``, ``compute-app`` (:func:`busy`); ``gone``, ``unreachable``,
    ``ecc-rose``, ``fewer``, ``unanswered`` (:func:`changed`). ``reported`` holds what
    nvidia-smi reported, under nvidia-smi's own field names."""

    kind: str
    index: int | None
    uuid: str | None
    bus_id: str | None
    text: str
    reported: tuple[tuple[str, Any], ...] = ()

    def evidence(self) -> dict[str, Any]:
        return {"kind": self.kind, "index": self.index, "uuid": self.uuid,
                **_present({"bus_id": self.bus_id}), **dict(self.reported)}


@dataclass(frozen=True)
class Verdict:
    """Findings: false when there are none."""

    findings: tuple[Finding, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.findings)

    def evidence(self) -> list[dict[str, Any]]:
        return [finding.evidence() for finding in self.findings]

    def describe(self, limit: int = 4) -> str:
        """One line for the marker's ``error``: the first ``limit`` findings."""
        more = len(self.findings) - limit
        texts = [finding.text for finding in self.findings[:limit]]
        return "; ".join(texts + ([f"and {more} more"] if more > 0 else []))

    def kinds(self) -> frozenset[str]:
        return frozenset(finding.kind for finding in self.findings)


def _finding(kind: str, gpu: Gpu, text: str, **reported: Any) -> Finding:
    return Finding(kind, gpu.index, gpu.uuid, gpu.bus_id, f"{gpu.label} {text}",
                   tuple(reported.items()))


def unhealthy(snap: Snapshot) -> Verdict:
    """The GPUs that report themselves sick (CONTRACT section 8, before setup):
    uncorrectable ECC errors since the driver loaded (> 0), pages pending retirement, rows
    pending remapping, a row-remapping failure; and a GPU NVML cannot reach at all. An
    unknown field is never a finding."""
    found: list[Finding] = []
    for gpu in snap.gpus:
        if gpu.ecc_uncorrected:
            found.append(_finding(
                "ecc-uncorrected", gpu,
                f"reports {gpu.ecc_uncorrected} uncorrectable ECC error"
                f"{'s' if gpu.ecc_uncorrected != 1 else ''} since the driver loaded "
                "(ecc.errors.uncorrected.volatile.total)",
                **{"ecc.errors.uncorrected.volatile.total": gpu.ecc_uncorrected}))
        if gpu.retired_pages_pending:
            found.append(_finding(
                "retired-pages-pending", gpu,
                "has memory pages pending retirement (retired_pages.pending: Yes)",
                **{"retired_pages.pending": True}))
        if gpu.remap_pending:
            found.append(_finding(
                "row-remap-pending", gpu,
                "has memory rows pending remapping, which takes a GPU reset "
                "(remapped_rows.pending)",
                **{"remapped_rows.pending": True,
                   "remapped_rows.uncorrectable": gpu.remapped_uncorrectable}))
        if gpu.remap_failure:
            found.append(_finding(
                "row-remap-failure", gpu, "has had a row-remapping failure (remapped_rows.failure)",
                **{"remapped_rows.failure": True}))
    for lost in snap.lost:
        found.append(_finding("unreachable", Gpu(lost.index, None, bus_id=lost.bus_id),
                              f"cannot be reached: {lost.line}", reason=lost.reason))
    return Verdict(tuple(found))


def busy(snap: Snapshot, own_pids: Collection[int] = ()) -> Verdict:
    """The GPUs someone else is using (CONTRACT section 8, before setup): more than
    :data:`BUSY_MEMORY_MIB` MiB used, or any compute process not in ``own_pids``.

    nvidia-smi reports host pids (inside a container too), so ``own_pids`` only matches
    when the runner shares the host's PID namespace; before setup the attempt started
    nothing and ``own_pids`` is empty. A GPU listing one of ``own_pids`` is not counted
    busy for its memory. Unknown memory or an unanswered ``--query-compute-apps`` is no
    finding."""
    own = set(own_pids)
    apps = snap.apps or ()
    by_uuid = {gpu.uuid: gpu for gpu in snap.gpus if gpu.uuid}
    found: list[Finding] = []
    for gpu in snap.gpus:
        used = gpu.memory_used_mib
        ours = any(app.pid in own for app in apps if app.gpu_uuid == gpu.uuid)
        if used is not None and used > BUSY_MEMORY_MIB and not ours:
            found.append(_finding(
                "memory-used", gpu,
                f"already holds {used} MiB of memory (memory.used; more than "
                f"{BUSY_MEMORY_MIB} MiB)",
                **{"memory.used": used, "memory.total": gpu.memory_total_mib}))
    for app in apps:
        if app.pid is not None and app.pid in own:
            continue
        owner = by_uuid.get(app.gpu_uuid or "") or Gpu(None, app.gpu_uuid)
        what = ", ".join(filter(None, (
            app.process_name, f"{app.used_memory_mib} MiB" if app.used_memory_mib else None)))
        pid = f"pid {app.pid}" if app.pid is not None else "a process"
        text = (f"lists compute process {pid}{f' ({what})' if what else ''} that the attempt "
                "did not start (--query-compute-apps; pids are the host's)")
        found.append(_finding("compute-app", owner, text, pid=app.pid,
                              process_name=app.process_name, used_gpu_memory=app.used_memory_mib))
    return Verdict(tuple(found))


def changed(start: Snapshot, now: Snapshot) -> Verdict:
    """What got worse since ``start`` that the GPUs report (CONTRACT section 8, while the
    worker runs and after it died): a GPU gone from a listing that answered (its UUID
    missing), one nvidia-smi reports it cannot reach, fewer GPUs listed than at the start,
    uncorrectable ECC errors whose count rose.

    Silence is no change: a ``now`` whose queries did not answer (hung, failed, pending)
    says nothing about the GPUs it did not list. Nothing is a change without a baseline
    either: a ``start`` that did not answer gives no findings. A count unknown at either
    end is no finding, nor one that did not rise."""
    if start.problem is not None:
        return Verdict()
    found: list[Finding] = []
    at_start = len(start.gpus)
    for gpu in start.gpus:
        later = _same_gpu(gpu, now.gpus)
        if later is not None:
            before, after = gpu.ecc_uncorrected, later.ecc_uncorrected
            if before is not None and after is not None and after > before:
                found.append(_finding(
                    "ecc-rose", gpu,
                    f"reports new uncorrectable ECC errors: {before} at the start, {after} "
                    "now (ecc.errors.uncorrected.volatile.total)",
                    **{"ecc.errors.uncorrected.volatile.total": after, "at_start": before}))
            continue
        lost = _same_lost(gpu, now.lost)
        if lost is not None:
            found.append(_finding("unreachable", gpu, f"can no longer be reached: {lost.line}",
                                  reason=lost.reason))
        elif now.listed:
            found.append(_finding(
                "gone", gpu,
                f"is gone: nvidia-smi no longer lists it ({at_start} GPUs at the start, "
                f"{len(now.gpus)} now)", gpus_at_start=at_start, gpus_now=len(now.gpus)))
    attributed = any(f.kind in ("gone", "unreachable") for f in found)
    if now.listed and not attributed and len(now.gpus) + len(now.lost) < at_start:
        found.append(Finding(
            "fewer", None, None, None,
            f"fewer GPUs than at the start: {at_start} then, {len(now.gpus)} now",
            (("gpus_at_start", at_start), ("gpus_now", len(now.gpus)))))
    return Verdict(tuple(found))


def _same_gpu(gpu: Gpu, candidates: Iterable[Gpu]) -> Gpu | None:
    """The same GPU: by UUID when it had one, else by bus id, else by index."""
    key = "uuid" if gpu.uuid else "bus_id" if gpu.bus_id else "index"
    mine = getattr(gpu, key)
    return next((other for other in candidates
                 if mine is not None and getattr(other, key) == mine), None)


def _same_lost(gpu: Gpu, lost: Iterable[LostGpu]) -> LostGpu | None:
    """The lost GPU ``gpu`` is: by bus id, else (a message without one) by index."""
    return next((lost_gpu for lost_gpu in lost
                 if (gpu.bus_id and lost_gpu.bus_id == gpu.bus_id)
                 or (lost_gpu.bus_id is None and gpu.index is not None
                     and lost_gpu.index == gpu.index)), None)


# --- the start's one judgment ---------------------------------------------------------------

@dataclass(frozen=True)
class StartVerdict:
    """What the GPUs' answers so far say before the worker starts (CONTRACT section 8).

    ``kind`` is None while they say nothing wrong; else ``short`` (fewer GPUs than
    ``expect_gpus``, or no working nvidia-smi where GPUs are expected), ``unresponsive``
    (``--query-gpu`` killed at its bound), ``unhealthy`` or ``busy``. ``decided`` is True
    when no later answer can change the verdict: a fault reported, or every query ended."""

    kind: Literal["short", "unresponsive", "unhealthy", "busy"] | None
    decided: bool
    text: str = ""
    findings: Verdict = Verdict()


def before_setup(snap: Snapshot, expected: int | None = None) -> StartVerdict:
    """The start's judgment of ``snap`` (partial or whole), each query on its own: only
    what answered can make a GPU sick (``--query-gpu``, ``--query-remapped-rows``, and
    lost-GPU messages) or busy (the memory ``--query-gpu`` reports, the entries
    ``--query-compute-apps`` lists). Silence decides only at ``--query-gpu``'s bound."""
    if expected is not None:
        wanted = f"the payload expects {expected} (expect_gpus), "
        if snap.problem in ("absent", "failed"):
            return StartVerdict("short", True, wanted + snap.describe_problem())
        if snap.problem is None and len(snap.gpus) < expected:
            seen = ", ".join(gpu.uuid or gpu.label for gpu in snap.gpus) or "none"
            return StartVerdict("short", True, f"{wanted}{len(snap.gpus)} visible ({seen})")
        if snap.problem == "pending":
            # The count decides first (a lost GPU is a short host too): one rule, whichever
            # query answers first.
            return StartVerdict(None, False)
    if snap.problem == "hung":
        return StartVerdict("unresponsive", True, snap.describe_problem())
    for kind, verdict in (("unhealthy", unhealthy(snap)), ("busy", busy(snap))):
        if verdict:
            return StartVerdict(kind, True, verdict.describe(), verdict)  # type: ignore[arg-type]
    return StartVerdict(None, snap.complete)
