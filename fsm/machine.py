"""The ``transitions`` machine built from ``fsm.table``.

The machine owns a dedicated model object (``transitions`` decorates its model with
dozens of attributes), has no automatic ``to_<state>`` triggers, marks the terminal
states final, and turns every illegal event into one typed error that names the state,
the event and the events allowed there, leaving the state unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transitions import Machine, State

from fsm import table
from fsm.errors import IllegalEvent


class _Model:
    """The object ``transitions`` decorates; nothing else lives on it."""

    state: str
    trigger: Callable[[str], bool]  # added by transitions


def machine_kwargs() -> dict[str, Any]:
    """The arguments every machine built from the table shares (plain, graph, markup)."""
    return {
        "states": [State(name, final=name in table.TERMINAL) for name in table.STATES],
        "transitions": [
            {"trigger": event, "source": source, "dest": dest}
            for event, source, dest in table.TRANSITIONS
        ],
        "initial": table.INITIAL,
        "auto_transitions": False,
        "ignore_invalid_triggers": False,
        "send_event": True,
    }


class RunMachine:
    """The lifecycle of one attempt. ``fire`` is the only way to move it."""

    def __init__(self, initial: str = table.INITIAL) -> None:
        self._model = _Model()
        self._machine = Machine(model=self._model, **{**machine_kwargs(), "initial": initial})

    @property
    def state(self) -> str:
        return self._model.state

    @property
    def is_terminal(self) -> bool:
        return self.state in table.TERMINAL

    def allowed(self) -> list[str]:
        """The events the current state accepts, in table order (the machine is built from
        the table: its triggers in a state are the table's events there)."""
        return list(table.allowed(self.state))

    def fire(self, event: str) -> str:
        """Apply ``event``; return the new state. Raises ``IllegalEvent`` and changes nothing
        when the current state does not allow it (unknown events included)."""
        allowed = self.allowed()
        if event not in allowed:
            raise IllegalEvent(self.state, event, allowed)
        self._model.trigger(event)  # the table has no conditions: an allowed event moves
        return self.state
