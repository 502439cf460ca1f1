"""One attempt as a process, and the files it keeps in the store.

* :mod:`fsm.attempt.runner`: ``flash-bootstrap run``: the context built, the machine
  driven, the exit status;
* :mod:`fsm.attempt._watchdog`: the attempt's deadline, kept from a thread of its own;
* :mod:`fsm.attempt.outcome`: how the attempt ended, recorded and published once;
* the attempt's files: :mod:`fsm.attempt.marker` (the marker's format: its name, build,
  parse and checks; pure), :mod:`fsm.attempt.result` (the local result file),
  :mod:`fsm.attempt.publish` (the marker's commit, fenced), :mod:`fsm.attempt.lock` (one
  runner per attempt), :mod:`fsm.attempt.start` (the attempt's start, kept across a
  restart), :mod:`fsm.attempt.lease` (the lease the runner keeps while it runs).

The control plane's reader of these files is :mod:`fsm.attempts`. This package imports
nothing itself: importing :mod:`fsm.attempt.marker` loads the marker's format alone.
"""
