"""Tools for people, beside the runner: none of them runs in an attempt.

* :mod:`fsm.ops.fleet`: ``status`` and ``explain``, the fleet's attempts as a table;
* :mod:`fsm.ops.demo`: ``demo``, one attempt on the embedded local store
  (``demo_tree/``);
* :mod:`fsm.ops.diagram`: the state diagrams and the generated blocks of the docs.

This package imports nothing itself.
"""
