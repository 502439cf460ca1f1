"""flash-bootstrap: the GPU-host bootstrap runner, as an explicit finite-state machine.

The lifecycle is ``fsm.table``; ``fsm.machine`` executes it, ``fsm.driver`` runs it, and
``states`` holds one handler per working state. Importing this package is cheap: nothing
heavy loads until a command needs it.
"""

__version__ = "0.1.0"
