"""Pictures of the machine, drawn from the same table the runner executes.

``flash-bootstrap diagram --format``:

* ``mermaid``: a ``stateDiagram-v2`` (pure Python; GitHub renders it);
* ``dot``, ``svg``, ``png``: the drawing of the ``transitions`` GraphMachine (pygraphviz
  engine, the ``diagrams`` extra: ``pip install 'flash-bootstrap[diagrams]'``; its wheel
  bundles Graphviz), restyled with the GraphMachine's per-state styles.

Only what ``transitions`` cannot draw is drawn here. Its Mermaid engine does not mark the
final states of a flat machine, paints the initial state "active" and has no notes, so the
Mermaid text is written here. In Graphviz, the 28 shared failure transitions (four exits
of every working state but Mark) become one dashed edge from a box around those seven
states, and the start arrow is added. Terminal states are terminal (``--> [*]``, double
circles).

With a marker (``--marker FILE``) the picture shows the path that attempt took: its
states and transitions highlighted, the state where its fate was decided (the marker's
``state``) labelled with the deciding policy rule (``rule``), and, when the path reached
Mark, the terminal state the marker announces.

``python -m fsm.diagram --write diagrams`` regenerates the committed copies
(``lifecycle.mmd``, ``lifecycle.svg``, ``transitions.json``); ``--policy-doc
docs/policy.md`` refreshes the policy page (``fsm.policy_doc``). ``tests/test_diagram.py``
fails when a committed copy no longer matches the machine.

Importing this module is cheap: the standard library and ``fsm.table`` only.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsm import table

__all__ = [
    "FORMATS",
    "DiagramUnavailable",
    "InvalidMarker",
    "dot",
    "graph",
    "mermaid",
    "normalise_svg",
    "render",
    "transition_table",
    "write_all",
]

FORMATS: tuple[str, ...] = ("mermaid", "dot", "svg", "png")
INSTALL_HINT = "install flash-bootstrap[diagrams] (pip install 'flash-bootstrap[diagrams]')"

#: Where ``write_all`` puts each rendering.
MERMAID_FILE = "lifecycle.mmd"
SVG_FILE = "lifecycle.svg"
TABLE_FILE = "transitions.json"

REGENERATE = "python -m fsm.diagram --write diagrams --policy-doc docs/policy.md"


class DiagramUnavailable(Exception):
    """The requested picture cannot be drawn here (the CLI prints this one line, exit 2)."""


class InvalidMarker(DiagramUnavailable):
    """The ``--marker`` file is JSON but not an attempt marker.

    A subclass of :class:`DiagramUnavailable` because that is what the CLI turns into one
    line and exit status 2.
    """


FAILURE_LABEL = " / ".join(table.FAILURE_EVENTS)
#: The working states that share the four failure exits (every working state but Mark).
FAILING: tuple[str, ...] = tuple(dict.fromkeys(source for _, source, _ in table.FAILURES))


# --- the attempt a marker describes -----------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """What a marker says about the path one attempt took, checked against the table."""

    path: tuple[str, ...]  # the states it passed through, the implied terminal appended
    edges: frozenset[tuple[str, str, str]]  # (source, dest, event) it took
    decided: str | None  # the state where its fate was decided (the marker's ``state``)
    rule: str
    outcome: str  # ok, retriable or fatal
    title: str
    watchdog: bool


def attempt_of(marker: Mapping[str, Any]) -> Attempt:
    """The path ``marker`` took through the table. Unknown states in its ``path`` are
    skipped, and a step the table does not allow is not drawn: the picture never invents
    a transition."""
    if not isinstance(marker, Mapping):
        raise InvalidMarker(f"--marker: expected a JSON object, got {type(marker).__name__}")
    raw_path = marker.get("path")
    if not isinstance(raw_path, list) or not raw_path:
        raise InvalidMarker("--marker: the marker has no 'path' (a list of state names)")
    path = [s for s in raw_path if isinstance(s, str) and s in table.STATES]
    ok = marker.get("ok") is True
    retriable = marker.get("retriable") is True
    outcome = "ok" if ok else "retriable" if retriable else "fatal"
    rule = _clean(str(marker.get("rule") or ""), 80)
    terminal: str | None = None
    if path and path[-1] == table.MARK:
        terminal = (
            table.SUCCEEDED if ok else table.FAILED_RETRIABLE if retriable else table.FAILED_FATAL
        )
        path.append(terminal)
    edges: set[tuple[str, str, str]] = set()
    for source, dest in itertools.pairwise(path):
        event = _event_between(source, dest, ok, rule, retriable, terminal)
        if event is not None:
            edges.add((source, dest, event))
    state = marker.get("state")
    decided = state if isinstance(state, str) and state in table.STATES else None
    watchdog = marker.get("watchdog") is True
    attempt = marker.get("attempt")
    run_id = marker.get("run_id")
    title = "attempt {}{}: {}{}".format(
        attempt if isinstance(attempt, int) else "?",
        f" of run {_one_line(str(run_id), 80)}" if run_id else "",
        terminal or ("fatal, written by the deadline watchdog" if watchdog else outcome),
        f" (rule {rule})" if rule else "",
    )
    error = marker.get("error")
    if isinstance(error, str) and error.strip():
        title += "\n" + _one_line(error, 110)
    return Attempt(
        path=tuple(path),
        edges=frozenset(edges),
        decided=decided,
        rule=rule,
        outcome=outcome,
        title=title,
        watchdog=watchdog,
    )


def _event_between(
    source: str, dest: str, ok: bool, rule: str, retriable: bool, terminal: str | None
) -> str | None:
    """The event that took the attempt from ``source`` to ``dest``, or None when the table
    has no such transition."""
    events = [e for e, s, d in table.TRANSITIONS if s == source and d == dest]
    if not events:
        return None
    if source == table.MARK and terminal is not None:
        return table.OUTCOME_EVENT[terminal]
    if dest == table.MARK and not ok:
        # the state before Mark is where a failed attempt failed (the driver's path), by
        # the exit its rule names
        from fsm.policy import BY_ID  # only for a marker

        known = BY_ID.get(rule)
        if known is not None:
            return known.event
        return table.FAILED_RETRIABLE_EVENT if retriable else table.FAILED_FATAL_EVENT
    progress = [e for e in events if e not in table.FAILURE_EVENTS]
    return progress[0] if progress else None


def _clean(text: str, limit: int) -> str:
    """One line of marker text that is safe inside a Mermaid note as well."""
    return re.sub(r"[^\w .,:/()+=@'-]", "?", " ".join(text.split()))[:limit]


def _one_line(text: str, limit: int) -> str:
    """One line of marker text for a Graphviz label (``_gv`` escapes it), cut at ``limit``."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# --- Mermaid --------------------------------------------------------------------------

_BLUE = "#1f5fbf"  # the path taken
_PATH_FILL = "#cfe3ff"
#: (fill, line) per outcome: the deciding state's outline, the terminal states' colours.
_OUTCOME_COLORS = {"ok": ("#d7f5d7", "#2e8b2e"), "retriable": ("#ffe7bf", "#d9822b"),
                   "fatal": ("#ffd4d4", "#c62828")}


def mermaid(marker: Mapping[str, Any] | None = None) -> str:
    """A Mermaid ``stateDiagram-v2`` of the table (GitHub renders it).

    Mermaid cannot style the transitions of a state diagram, so a marker highlights the
    states of the path, and a note on the deciding state names the rule.
    """
    lines = ["stateDiagram-v2", f"    [*] --> {table.INITIAL}"]
    for event, source, dest in table.PROGRESS:
        lines.append(f"    {source} --> {dest}: {event}")
    for source in FAILING:
        lines.append(f"    {source} --> {table.MARK}: {FAILURE_LABEL}")
    lines += [f"    {state} --> [*]" for state in table.TERMINAL]
    if marker is not None:
        attempt = attempt_of(marker)
        decided_class = f"decided_{attempt.outcome}"
        fill, line = _OUTCOME_COLORS[attempt.outcome]
        lines += [f"    classDef taken fill:{_PATH_FILL},stroke:{_BLUE},stroke-width:2px",
                  f"    classDef {decided_class} fill:{fill},stroke:{line},stroke-width:4px"]
        for state in dict.fromkeys(attempt.path):
            if state != attempt.decided:
                lines.append(f"    class {state} taken")
        if attempt.decided is not None:
            lines.append(f"    class {attempt.decided} {decided_class}")
            # the block form: a one-line note may not hold a second colon
            lines += [f"    note right of {attempt.decided}",
                      f"        decided here: {attempt.outcome}"]
            if attempt.rule:
                lines.append(f"        rule {attempt.rule}")
            if attempt.watchdog:
                lines.append("        (deadline watchdog)")
            lines.append("    end note")
    return "\n".join(lines) + "\n"


# --- Graphviz: the transitions GraphMachine's drawing -----------------------------------

FONT = "Helvetica,Arial,sans-serif"
CLUSTER = "cluster_working"
TITLE = "flash-bootstrap: the lifecycle of one attempt"
_START = "__start__"
_MUTED = "#8a8a8a"
_ON = {"color": _BLUE, "fontcolor": _BLUE, "penwidth": "2.5"}
_TERMINAL_OUTCOME = {table.SUCCEEDED: "ok", table.FAILED_RETRIABLE: "retriable",
                     table.FAILED_FATAL: "fatal"}


def _styles() -> dict[str, Any]:
    """The GraphMachine's ``style_attributes``: the named styles ``set_node_style`` applies."""
    node: dict[str, dict[str, str]] = {
        "default": {"shape": "box", "style": "rounded,filled", "fillcolor": "white",
                    "color": "black", "fontname": FONT, "fontsize": "12",
                    "margin": "0.15,0.06"},
        "active": {},  # a picture of the table has no current state
        "path": {"fillcolor": _PATH_FILL, "color": _BLUE, "penwidth": "2.5"},
        "path_terminal": {"color": _BLUE, "penwidth": "2.5"},  # keeps its outcome's fill
    }
    for outcome, (fill, line) in _OUTCOME_COLORS.items():
        node[f"terminal_{outcome}"] = {  # centred: the engine's labels end in "\\l"
            "shape": "doublecircle", "style": "filled", "fillcolor": fill, "color": line,
            "fontsize": "11", "margin": "0.02", "label": "\\N",
        }
        node[f"decided_{outcome}"] = {"color": line, "fontcolor": line, "penwidth": "4"}
    edge = {"default": {"fontname": FONT, "fontsize": "10", "color": "#333333"}}
    return {"node": node, "edge": edge, "graph": {}}


def _gv(text: str) -> str:
    """Label text for Graphviz: backslashes kept, newlines as centred line breaks."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _pygraphviz() -> Any:
    try:
        import pygraphviz
    except ImportError as exc:
        raise DiagramUnavailable(f"dot, svg and png need pygraphviz: {INSTALL_HINT}") from exc
    return pygraphviz


def graph(marker: Mapping[str, Any] | None = None) -> Any:
    """The machine as a ``pygraphviz.AGraph``: what the ``transitions`` GraphMachine built
    from ``fsm.machine.machine_kwargs()`` draws, restyled, with ``marker``'s path on it.

    The engine is pinned and checked: ``transitions`` silently falls back to another
    engine (a log warning only) when the one asked for is not installed.
    """
    pygraphviz = _pygraphviz()
    from transitions.extensions.diagrams import GraphMachine

    from fsm.machine import machine_kwargs

    class Drawing(GraphMachine):
        machine_attributes = {
            # pygraphviz takes any non-empty string as true: transitions' own "false"
            # makes a strict graph, which cannot hold the failure edges drawn below
            "name": "lifecycle", "directed": "true", "strict": "", "rankdir": "LR",
            "compound": "true", "newrank": "true", "fontname": FONT, "fontsize": "14",
            "labelloc": "t", "nodesep": "0.35", "ranksep": "0.45", "pad": "0.2",
        }
        style_attributes = _styles()

    class _Model:
        state: str

    attempt = attempt_of(marker) if marker is not None else None
    model = _Model()
    machine = Drawing(model=model, graph_engine="pygraphviz",
                      title=_gv(attempt.title if attempt else TITLE), **machine_kwargs())
    agraph = model.get_graph()  # type: ignore[attr-defined]  # bound by GraphMachine
    if not isinstance(agraph, pygraphviz.AGraph):
        raise DiagramUnavailable(
            f"transitions drew with {machine.graph_cls.__module__}, not pygraphviz: "
            + INSTALL_HINT
        )
    styles = machine.model_graphs[id(model)]  # set_node_style: transitions' per-state styling
    # The engine merges parallel transitions into one "a | b" edge: take the four shared
    # failure exits off each state's edge to Mark, to draw them once from the box (a test
    # checks that the picture still draws exactly the table).
    for source in FAILING:
        edge = agraph.get_edge(source, table.MARK)
        events = str(edge.attr["label"]).split(" | ")
        kept = [event for event in events if event not in table.FAILURE_EVENTS]
        if kept:
            edge.attr["label"] = " | ".join(kept)
        else:
            agraph.delete_edge(edge)
    for state in table.TERMINAL:
        styles.set_node_style(state, f"terminal_{_TERMINAL_OUTCOME[state]}")
    agraph.add_subgraph(
        FAILING, name=CLUSTER, label="each state in this box may also fail", labeljust="l",
        style="dashed,rounded", color=_MUTED, fontcolor="#555555", fontsize="10",
    )
    agraph.add_subgraph(table.TERMINAL, name="terminal", rank="same")
    agraph.add_node(_START, label="", shape="point", width="0.14", fillcolor="black")
    agraph.add_edge(_START, table.INITIAL)
    if attempt is not None:
        for state in attempt.path:
            styles.set_node_style(state, "path_terminal" if state in table.TERMINAL else "path")
        if attempt.path[:1] == (table.INITIAL,):
            agraph.get_edge(_START, table.INITIAL).attr.update(_ON)
        # while each pair of states has one edge, get_edge finds the progress edge
        for source, dest, event in attempt.edges:
            if event not in table.FAILURE_EVENTS:
                agraph.get_edge(source, dest).attr.update(_ON)
        if attempt.decided is not None:
            styles.set_node_style(attempt.decided, f"decided_{attempt.outcome}")
            label = f"{attempt.decided}\ndecided here: {attempt.outcome}"
            label += f"\nrule {attempt.rule}" if attempt.rule else ""
            label += "\n(deadline watchdog)" if attempt.watchdog else ""
            agraph.get_node(attempt.decided).attr["label"] = _gv(label)
    # The 28 failure transitions, as one edge from the box. Drawn from one of its last
    # members so the edge does not pull the layout out of shape; ltail clips it at the box.
    agraph.add_edge(
        FAILING[-2], table.MARK, key="failures", label=_gv("\n".join(table.FAILURE_EVENTS)),
        ltail=CLUSTER, style="dashed", color=_MUTED, fontcolor="#555555", arrowhead="empty",
    )
    for source, dest, event in sorted(attempt.edges if attempt else ()):
        if event in table.FAILURE_EVENTS:  # the failure exit taken, drawn on its own
            agraph.add_edge(source, dest, key=event, label=event, **_ON)
    return agraph


def dot(marker: Mapping[str, Any] | None = None) -> str:
    """The Graphviz source of :func:`graph` (what ``svg`` and ``png`` lay out)."""
    return str(graph(marker).string())


_GENERATOR_COMMENT = re.compile(rb"<!-- Generated by graphviz version[^>]*-->\n")


def normalise_svg(svg: bytes) -> bytes:
    """The SVG without what varies between Graphviz builds but not between drawings (the
    generator's version comment), so two renders compare byte for byte."""
    return _GENERATOR_COMMENT.sub(b"", svg)


def render(fmt: str, marker: Mapping[str, Any] | None = None) -> bytes:
    """The machine in ``fmt`` (one of :data:`FORMATS`), highlighting ``marker``'s path."""
    if fmt == "mermaid":
        return mermaid(marker).encode()
    if fmt == "dot":
        return dot(marker).encode()
    if fmt == "svg":
        return normalise_svg(graph(marker).draw(format="svg", prog="dot"))
    if fmt == "png":
        return bytes(graph(marker).draw(format="png", prog="dot", args="-Gdpi=110"))
    raise DiagramUnavailable(f"unknown diagram format {fmt!r}; one of {', '.join(FORMATS)}")


# --- the committed copies -------------------------------------------------------------


def transition_table() -> dict[str, Any]:
    """The machine as JSON-ready data: states, terminal, events, transitions."""
    return {
        "generated_by": f"{REGENERATE} (do not edit)",
        "initial": table.INITIAL,
        "states": list(table.STATES),
        "working": list(table.WORKING),
        "terminal": list(table.TERMINAL),
        "events": list(table.EVENTS),
        "failure_events": list(table.FAILURE_EVENTS),
        "transitions": [
            {
                "event": event,
                "source": source,
                "dest": dest,
                "kind": "failure" if event in table.FAILURE_EVENTS else "progress",
            }
            for event, source, dest in table.TRANSITIONS
        ],
    }


def renderings(*, images: bool = True) -> dict[str, bytes]:
    """The committed copies of ``diagrams/``, by file name, as a fresh render makes them
    (without the SVG, which needs pygraphviz, when ``images`` is false)."""
    files = {
        MERMAID_FILE: mermaid().encode(),
        TABLE_FILE: (json.dumps(transition_table(), indent=2) + "\n").encode(),
    }
    if images:
        files[SVG_FILE] = render("svg")
    return files


def write_all(directory: Path | str) -> list[Path]:
    """Write every rendering into ``directory``; return the files that changed."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, data in renderings().items():
        path = root / name
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)
            changed.append(path)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fsm.diagram --write diagrams [--policy-doc docs/policy.md]``."""
    import argparse

    from fsm.policy_doc import refresh_policy_doc

    parser = argparse.ArgumentParser(
        prog="python -m fsm.diagram", description="Regenerate the committed renderings."
    )
    parser.add_argument("--write", metavar="DIR", type=Path, help="write diagrams/ here")
    parser.add_argument("--policy-doc", metavar="FILE", type=Path,
                        help="refresh this page's <!-- policy:begin/end --> block")
    args = parser.parse_args(argv)
    if args.write is None and args.policy_doc is None:
        parser.error("nothing to do: give --write DIR and/or --policy-doc FILE")
    try:
        changed: Iterable[Path] = write_all(args.write) if args.write is not None else []
        if args.policy_doc is not None and refresh_policy_doc(args.policy_doc):
            changed = [*changed, args.policy_doc]
    except (DiagramUnavailable, OSError, ValueError) as exc:
        print(f"python -m fsm.diagram: {exc}")
        return 2
    for path in changed:
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
