"""The generated blocks of the Markdown pages: the policy table, the exit statuses, the
machine drawn in Mermaid.

A page marks a generated block with ``<!-- name:begin -->`` and ``<!-- name:end -->``:
``policy`` holds ``fsm.policy.render_table()``, ``exits`` holds ``fsm.exits.render_table()``,
``diagram`` the table drawn by ``fsm.diagram.mermaid()`` in a fenced block.
:func:`refresh_doc` rewrites every such block a page has; ``python -m fsm.diagram --doc
README.md --doc docs/policy.md --doc docs/contract.md --doc deploy/README.md`` calls it,
and the tests fail when a committed copy is stale.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

__all__ = ["BLOCKS", "generated_block", "refresh_doc", "refresh_policy_doc", "replace_block"]


def _block(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(?P<begin><!-- {re.escape(name)}:begin -->\n)(?P<body>.*?)"
        rf"(?P<end><!-- {re.escape(name)}:end -->)",
        re.S,
    )


def generated_block(text: str, name: str) -> str | None:
    """The text between ``<!-- name:begin -->`` and ``<!-- name:end -->``, or None."""
    match = _block(name).search(text)
    return match["body"] if match else None


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with its ``name`` block replaced by ``body``; ValueError when it has none."""
    if generated_block(text, name) is None:
        raise ValueError(f"no <!-- {name}:begin --> ... <!-- {name}:end --> block")
    return _block(name).sub(lambda m: m["begin"] + body.strip("\n") + "\n" + m["end"], text, 1)


def _policy_table() -> str:
    from fsm.policy import render_table

    return render_table()


def _exits_table() -> str:
    from fsm.exits import render_table

    return render_table()


def _diagram() -> str:
    from fsm.diagram import mermaid

    return "```mermaid\n" + mermaid() + "```\n"


#: The generated blocks a page may hold, by name, and what renders each.
BLOCKS: dict[str, Callable[[], str]] = {
    "policy": _policy_table, "exits": _exits_table, "diagram": _diagram,
}


def refresh_doc(path: Path | str) -> bool:
    """Regenerate every block of :data:`BLOCKS` that ``path`` holds; True when the file
    changed (ValueError when it holds none)."""
    doc = Path(path)
    text = doc.read_text(encoding="utf-8")
    names = [name for name in BLOCKS if generated_block(text, name) is not None]
    if not names:
        raise ValueError(f"{doc} holds no generated block ({', '.join(BLOCKS)})")
    new = text
    for name in names:
        new = replace_block(new, name, BLOCKS[name]())
    if new != text:
        doc.write_text(new, encoding="utf-8")
        return True
    return False


def refresh_policy_doc(path: Path | str) -> bool:
    """Regenerate the generated blocks of ``path`` (the name ``--policy-doc`` keeps)."""
    return refresh_doc(path)
