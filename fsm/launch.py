"""The process's first instructions: the ``flash-bootstrap`` console script and
``python -m fsm`` start here.

What a runner must do before anything else is imported is done here, in a function on
the run path, never in a module's body: importing ``fsm.cli`` (a test, the demo, a tool
that renders the policy) changes nothing in the process that imports it.

Every command first reopens closed descriptors 0, 1 and 2 on ``/dev/null`` (``fsm.output.outlet``):
no file opened later takes their number. ``run`` before that points SIGTERM/SIGINT at the
process's interrupt flag (until its handlers exist a stop signal is dropped, as PID 1, or
kills it with nothing written; ``fsm.interrupt`` imports only the standard library's
cheapest modules and opens no descriptor then), and after it:

1. asks the GPUs (``fsm.host.queries``): on a big host their answer is the longest wait
   before the worker, so only what the asking needs comes before it (after the
   reopening: its pipes never take 0, 1 or 2);
2. arms the flag's wake-up pipe;
3. defers the imports the runner does not use before the worker starts
   (``fsm.deferred``);
4. starts the process that loads ``huggingface_hub`` (``fsm.hub.spawn``: forked while
   this process has one thread, before anything the runner alone needs is imported; it
   closes its copies of the GPU queries' pipes);
5. imports structlog without its optional extras;
6. reads the GPUs' answers in the background (``fsm.host.probe``): setup overlaps them, the
   worker waits for them.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # ``typing`` costs milliseconds before the GPUs are asked
if TYPE_CHECKING:
    from typing import NoReturn


def main() -> NoReturn:
    """Start the process as its command needs, then hand over to ``fsm.cli``."""
    runner = sys.argv[1:2] == ["run"]
    if runner:
        from fsm import interrupt

        interrupt.install_early()
    from fsm.output import outlet

    outlet.reopen_closed()
    if runner:
        _start_runner()
    from fsm.cli import entrypoint

    entrypoint()


def _start_runner() -> None:
    from fsm.host import queries as gpu_queries

    asked = gpu_queries.ask(os.environ)
    from fsm import deferred, interrupt

    interrupt.arm_wakeup()
    deferred.defer(deferred.UNUSED_BEFORE_THE_WORKER)
    from fsm.hub import spawn as hub_spawn

    hub_spawn.start(not_ours=asked.fds())
    deferred.import_without("structlog", deferred.OPTIONAL_FOR_STRUCTLOG)
    from fsm.host.probe import HostProbe

    HostProbe.start_early(os.environ, asked)
