"""The whole lifecycle on one screen: states, events, terminal states, transitions.

Everything that decides what may follow what lives in this file. It imports only the
standard library and performs no I/O; ``fsm.machine`` executes it with ``transitions``,
``fsm.ops.diagram`` draws it, and the tests walk it as a graph.

Events are facts, named for what happened (``code_fetched``), never for what to do next.
"""

from __future__ import annotations

from typing import Final

# --- states ---------------------------------------------------------------------------

LOAD_PAYLOAD: Final = "LoadPayload"
INSTALL_EXTRAS: Final = "InstallExtras"
FETCH_CODE: Final = "FetchCode"
RESOLVE_SPEC: Final = "ResolveSpec"
TRAIN: Final = "Train"
VERIFY_REMOTE: Final = "VerifyRemote"
PRELOAD: Final = "Preload"
MARK: Final = "Mark"
SUCCEEDED: Final = "Succeeded"
FAILED_RETRIABLE: Final = "FailedRetriable"
FAILED_FATAL: Final = "FailedFatal"

INITIAL: Final = LOAD_PAYLOAD

#: States whose handler does work; ``Mark`` is the last of them.
WORKING: Final[tuple[str, ...]] = (
    LOAD_PAYLOAD,
    INSTALL_EXTRAS,
    FETCH_CODE,
    RESOLVE_SPEC,
    TRAIN,
    VERIFY_REMOTE,
    PRELOAD,
    MARK,
)
#: Where every run ends, after exactly one marker.
TERMINAL: Final[tuple[str, ...]] = (SUCCEEDED, FAILED_RETRIABLE, FAILED_FATAL)
STATES: Final[tuple[str, ...]] = WORKING + TERMINAL

# --- events ---------------------------------------------------------------------------

TRAIN_REQUESTED: Final = "train_requested"
PRELOAD_REQUESTED: Final = "preload_requested"
RESULT_REPLAYED: Final = "result_replayed"
EXTRAS_INSTALLED: Final = "extras_installed"
CODE_FETCHED: Final = "code_fetched"
SPEC_RESOLVED: Final = "spec_resolved"
WORKER_EXITED: Final = "worker_exited"
#: The worker made no progress for FLASH_STALL_S and was stopped: its exit is not its own.
WORKER_STALLED: Final = "worker_stalled"
#: The host's GPUs failed under the worker (the host watch) and it was stopped.
HOST_FAILED: Final = "host_failed"
COMPLETION_CONFIRMED: Final = "completion_confirmed"
CACHE_WARMED: Final = "cache_warmed"
FAILED_RETRIABLE_EVENT: Final = "failed_retriable"
FAILED_FATAL_EVENT: Final = "failed_fatal"
INTERRUPTED: Final = "interrupted"
DEADLINE_EXCEEDED: Final = "deadline_exceeded"
MARKED_SUCCEEDED: Final = "marked_succeeded"
MARKED_RETRIABLE: Final = "marked_retriable"
MARKED_FATAL: Final = "marked_fatal"

#: The four exits every working state but Mark shares; all of them lead to Mark.
FAILURE_EVENTS: Final[tuple[str, ...]] = (
    FAILED_RETRIABLE_EVENT,
    FAILED_FATAL_EVENT,
    INTERRUPTED,
    DEADLINE_EXCEEDED,
)

# --- transitions: (event, source, destination) ----------------------------------------

PROGRESS: Final[tuple[tuple[str, str, str], ...]] = (
    (TRAIN_REQUESTED, LOAD_PAYLOAD, INSTALL_EXTRAS),
    (PRELOAD_REQUESTED, LOAD_PAYLOAD, PRELOAD),
    (RESULT_REPLAYED, LOAD_PAYLOAD, MARK),
    (EXTRAS_INSTALLED, INSTALL_EXTRAS, FETCH_CODE),
    (CODE_FETCHED, FETCH_CODE, RESOLVE_SPEC),
    (SPEC_RESOLVED, RESOLVE_SPEC, TRAIN),
    (WORKER_EXITED, TRAIN, VERIFY_REMOTE),
    (WORKER_STALLED, TRAIN, VERIFY_REMOTE),
    (HOST_FAILED, TRAIN, VERIFY_REMOTE),
    (COMPLETION_CONFIRMED, VERIFY_REMOTE, MARK),
    (CACHE_WARMED, PRELOAD, MARK),
    (MARKED_SUCCEEDED, MARK, SUCCEEDED),
    (MARKED_RETRIABLE, MARK, FAILED_RETRIABLE),
    (MARKED_FATAL, MARK, FAILED_FATAL),
)

#: Every working state but Mark can fail four ways, and each way leads to Mark.
FAILURES: Final[tuple[tuple[str, str, str], ...]] = tuple(
    (event, source, MARK) for source in WORKING if source != MARK for event in FAILURE_EVENTS
)

TRANSITIONS: Final[tuple[tuple[str, str, str], ...]] = PROGRESS + FAILURES

#: States whose handler still runs after SIGTERM/SIGINT (every other working state takes
#: ``interrupted`` at once): LoadPayload, to learn where the retriable marker goes, and
#: VerifyRemote, because a worker's confirmed completion outranks a late signal. Both
#: leave by the events above; this only decides whether the handler is called.
RUN_AFTER_SIGNAL: Final[tuple[str, ...]] = (LOAD_PAYLOAD, VERIFY_REMOTE)

# --- per-state facts: what is no transition but belongs to one state ------------------

#: The one state that publishes the marker. The driver runs it on a path of its own: no
#: signal, deadline or halt check before it, and a failure inside it is the runner's
#: defect (``internal-error``), never one of the four failure exits.
PUBLISHES: Final = MARK

#: States whose handler runs even when the attempt's deadline passed before they began:
#: LoadPayload, which learns where the marker goes and whether the budget is spent (a
#: restart after it marks the attempt ``deadline`` at once). Every other working state
#: but Mark takes ``deadline_exceeded`` without starting.
RUN_AFTER_DEADLINE: Final[tuple[str, ...]] = (LOAD_PAYLOAD,)

#: Downloads a state starts ahead of the states that join them, overlapping its own work
#: (``fsm.prefetch``), named by the joining state. LoadPayload starts the code's and a
#: spilled spec's when the run has extras to install (the install runs meanwhile);
#: FetchCode starts the spilled spec's beside its own download. The joining state's
#: module says what it downloads ahead (``states.AHEAD``); a failure is raised where it
#: is joined, so the earliest failing state's rule decides, as in a serial run.
PREFETCH: Final[dict[str, tuple[str, ...]]] = {
    LOAD_PAYLOAD: (FETCH_CODE, RESOLVE_SPEC),
    FETCH_CODE: (RESOLVE_SPEC,),
}

#: The folders each state writes (besides the interpreter's site-packages, which the
#: extras go into). The room on each is measured before any state writes
#: (``fsm.host.storage``: the runner measures ``payload``, ``code`` and ``scratch`` at its
#: start, LoadPayload ``cache`` once the payload names it), so that a full disk is judged
#: against the room it had. ``payload``: next to the payload (the lock, the start, the
#: result); ``scratch``: the scratch dir (the console, the installer's output, a spilled
#: spec, the marker's local copy); ``code``: the code root; ``cache``: the model cache
#: (``HF_HOME``) a preload warms and a worker reads. A state's folders are where a full or
#: read-only disk under one of its writes is looked for first (``driver.storage_dirs``).
WRITES: Final[dict[str, tuple[str, ...]]] = {
    LOAD_PAYLOAD: ("payload",),
    INSTALL_EXTRAS: ("scratch",),
    FETCH_CODE: ("code",),
    RESOLVE_SPEC: ("scratch",),
    TRAIN: ("scratch", "code", "cache"),
    VERIFY_REMOTE: ("scratch",),
    PRELOAD: ("cache",),
    MARK: ("payload", "scratch"),
}
#: The folders of :data:`WRITES` the runner knows before the payload is read.
WRITTEN_AT_START: Final[tuple[str, ...]] = ("payload", "code", "scratch")

#: The terminal state Mark leads to for each outcome it publishes.
OUTCOME_EVENT: Final[dict[str, str]] = {
    SUCCEEDED: MARKED_SUCCEEDED,
    FAILED_RETRIABLE: MARKED_RETRIABLE,
    FAILED_FATAL: MARKED_FATAL,
}

EVENTS: Final[tuple[str, ...]] = tuple(dict.fromkeys(event for event, _, _ in TRANSITIONS))


def allowed(state: str) -> tuple[str, ...]:
    """The events the table allows in ``state`` (none in a terminal state)."""
    return tuple(event for event, source, _ in TRANSITIONS if source == state)


def successors(state: str) -> tuple[str, ...]:
    """The states one transition away from ``state``."""
    return tuple(dict.fromkeys(dest for _, source, dest in TRANSITIONS if source == state))
