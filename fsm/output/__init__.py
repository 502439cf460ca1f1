"""What the runner prints and how it keeps secrets out of it.

* :mod:`fsm.output.log`: the one JSON log stream (structlog), configured once;
* :mod:`fsm.output.redact`: the masks for secrets, whole, cut or encoded;
* :mod:`fsm.output.outlet`: the runner's own stderr, written without blocking.

This package imports nothing itself.
"""
