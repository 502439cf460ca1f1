"""``python -m fsm`` is the ``flash-bootstrap`` command."""

from fsm.cli import entrypoint

entrypoint()
