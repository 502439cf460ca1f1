"""The training worker: starting it, watching it, stopping it, and what it leaves.

* :mod:`fsm.worker.supervise`: a process group run under a bound, its output pumped, its
  watches (stall, GPUs, lease) looked at;
* :mod:`fsm.worker.procs`: the members of a process group, read from ``/proc``;
* :mod:`fsm.worker.stacks`: a stalled or stopped worker's stacks, by py-spy;
* :mod:`fsm.worker.console`: the console's tail uploaded while it runs;
* :mod:`fsm.worker.files`: the completion files the worker writes and the runner checks;
* :mod:`fsm.worker.termination`: the worker's own last words
  (``/dev/termination-log``).

This package imports nothing itself.
"""
