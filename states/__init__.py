"""The handlers of the working states: each ``(ctx) -> event``, one module per state.

The handler of state ``FooBar`` is the function ``foo_bar`` of module ``states.foo_bar``:
a new state of the table needs its module and nothing here. A state that a download of its
own may start ahead of it (``table.PREFETCH``) says what it downloads in that module's
``ahead(ctx)``; states never import each other. A state whose module is
missing is left out of ``HANDLERS``; the driver says so at start-up and ends an attempt
that reaches it with an ``internal-error`` marker.
"""

from __future__ import annotations

import importlib
import re

from fsm import table
from fsm.context import Ahead
from fsm.driver import Handler


def _handlers() -> tuple[dict[str, Handler], dict[str, Ahead]]:
    found: dict[str, Handler] = {}
    ahead: dict[str, Ahead] = {}
    for state in table.WORKING:
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", state).lower()  # VerifyRemote: verify_remote
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the module exists and failed to import something else: a real error
            continue
        if callable(handler := getattr(module, name, None)):
            found[state] = handler
        if callable(plan := getattr(module, "ahead", None)):
            ahead[state] = plan
    return found, ahead


#: The handler of each working state; and, of a state that a download of its own may be
#: started ahead of it (``table.PREFETCH``), its module's ``ahead(ctx)``.
HANDLERS, AHEAD = _handlers()

__all__ = ["AHEAD", "HANDLERS"]
