"""Pictures of the machine, drawn from the same table the runner executes.

Mermaid text is pure Python. The four exits every working state shares are drawn as one
edge per state labelled with all four, not as a hairball of parallel edges.
"""

from __future__ import annotations

from typing import Any

from fsm import table


class DiagramUnavailable(Exception):  # noqa: N818 - names the fact for the CLI's one line
    """The requested format needs an optional dependency that is not installed."""


FAILURE_LABEL = " / ".join(table.FAILURE_EVENTS)


def mermaid(marker: dict[str, Any] | None = None) -> str:
    """A Mermaid ``stateDiagram-v2`` of the table (GitHub renders it)."""
    lines = ["stateDiagram-v2", f"    [*] --> {table.INITIAL}"]
    for event, source, dest in table.PROGRESS:
        lines.append(f"    {source} --> {dest}: {event}")
    for source in table.WORKING:
        if source != table.MARK:
            lines.append(f"    {source} --> {table.MARK}: {FAILURE_LABEL}")
    lines += [f"    {state} --> [*]" for state in table.TERMINAL]
    if marker:
        taken = [s for s in marker.get("path", []) if s in table.STATES]
        lines.append("    classDef taken fill:#dfd,stroke:#393,stroke-width:2px")
        lines += [f"    class {state} taken" for state in dict.fromkeys(taken)]
    return "\n".join(lines) + "\n"


def render(fmt: str, marker: dict[str, Any] | None = None) -> bytes:
    if fmt == "mermaid":
        return mermaid(marker).encode()
    raise DiagramUnavailable(f"diagram format {fmt!r} is not available yet")
