"""The host: what the runner learns about the machine it runs on.

* :mod:`fsm.host.probe`: the host's identity (its GPUs' UUIDs, the boot), the GPUs asked
  once from the runner's first step and judged before the worker starts, the OOM kills
  counted by the container's memory cgroup;
* :mod:`fsm.host.gpus`: what ``nvidia-smi``'s documented query interface answers, read
  into a snapshot, and which answers show a sick host (CONTRACT section 8);
* :mod:`fsm.host.queries`: the queries started among the runner's first instructions
  (standard library only);
* :mod:`fsm.host.watch`: the GPUs asked again while the worker runs;
* :mod:`fsm.host.storage`: the filesystems the attempt writes, and a full one's verdict.

This package imports nothing itself: :mod:`fsm.host.queries` must load in milliseconds.
"""
