"""``python -m fsm`` is the ``flash-bootstrap`` command."""

from fsm.launch import main

main()
