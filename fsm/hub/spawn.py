"""``huggingface_hub`` loaded beside the runner from its first instruction.

``flash-bootstrap run`` starts the agent process (``fsm.hub.agent``) before anything
else (:func:`start`): it imports the library on the other core while the runner imports
its own modules, reads the payload and checks the host, so FetchCode finds it loaded.
Nothing is started when the command line (or ``FLASH_STORE``) names a local directory
store: no Hub call is made then.

Once logging is set up, :func:`report` logs ``hub.import_started`` (when the agent was
started, ``at``, epoch seconds) and ``hub.import_finished`` (when the runner heard it was
loaded, the ``seconds`` since the start, the agent's own ``import_seconds``, and the
error's type if it failed), whichever thread gets there last, and passes the agent's
stderr on to the runner's from then.

Standard library only: this module is imported before anything heavy.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from fsm.hub import agent as hub_agent

__all__ = ["finish", "report", "start"]

_FINISH_BOUND_S = 0.5


def _local_store(argv: list[str]) -> bool:
    """Whether the command line (or the environment) names a local directory store: then
    no Hub call is made, and the import would only take CPU from the attempt."""
    for i, arg in enumerate(argv):
        if arg == "--store" and i + 1 < len(argv):
            return argv[i + 1].startswith("file:")
        if arg.startswith("--store="):
            return arg.removeprefix("--store=").startswith("file:")
    return os.environ.get("FLASH_STORE", "").startswith("file:")


def start(not_ours: Sequence[int] = ()) -> bool:
    """Start the agent (once); False when there is no Hub to call. ``not_ours``: the
    runner's descriptors the agent, a fork, must not keep."""
    if hub_agent.current() is not None:
        return True
    if _local_store(sys.argv[1:]):
        return False
    hub_agent.start(hold_output=True, not_ours=not_ours)
    return True


def report() -> None:
    """Log the agent's start, and its load once done (now, or when the agent says so);
    call once logging is set up."""
    agent = hub_agent.current()
    if agent is None:
        return
    import structlog

    log = structlog.get_logger("fsm.hub_import")
    log.info("hub.import_started", at=round(agent.started_at, 6), pid=agent.pid)
    agent.release_output()

    def finished(agent: hub_agent.Agent) -> None:
        assert agent.ended_at is not None
        log.info("hub.import_finished", at=round(agent.ended_at, 6),
                 seconds=round(agent.ended_at - agent.started_at, 4),
                 import_seconds=agent.import_s, accelerator=agent.accelerator, error=agent.error)

    agent.when_ready(finished)


def finish() -> None:
    """At the runner's end: the agent stopped and reaped, when its library has loaded
    (then it exits at once; an agent still importing exits by itself when done)."""
    agent = hub_agent.current()
    if agent is not None and agent.ready.is_set():
        agent.finish(_FINISH_BOUND_S)
