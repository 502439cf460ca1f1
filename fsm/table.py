"""The whole lifecycle on one screen: states, events, terminal states, transitions.

Everything that decides what may follow what lives in this file. It imports only the
standard library and performs no I/O; ``fsm.machine`` executes it with ``transitions``,
``fsm.diagram`` draws it, and the tests walk it as a graph.

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
