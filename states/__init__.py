"""The handlers of the working states: each ``(ctx) -> event``, one module per state.

The handler of state ``FooBar`` is the function ``foo_bar`` of module ``states.foo_bar``:
a new state of the table needs its module and nothing here. A state whose module is
missing is left out of ``HANDLERS``; the driver says so at start-up and ends an attempt
that reaches it with an ``internal-error`` marker.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from typing import cast

from fsm import table
from fsm.context import Context

Handler = Callable[[Context], str]


def module_name(state: str) -> str:
    """``VerifyRemote`` -> ``verify_remote``: the module and the function of its handler."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", state).lower()


def _handlers() -> dict[str, Handler]:
    found: dict[str, Handler] = {}
    for state in table.WORKING:
        name = module_name(state)
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the module exists and failed to import something else: a real error
            continue
        handler = getattr(module, name, None)
        if callable(handler):
            found[state] = cast(Handler, handler)
    return found


HANDLERS: Mapping[str, Handler] = _handlers()

__all__ = ["HANDLERS", "module_name"]
