"""``python -m fsm`` is the ``flash-bootstrap`` command."""

import sys

from fsm.cli import main

sys.exit(main())
