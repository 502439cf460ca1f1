"""The generated blocks of the Markdown pages: the policy table, the exit statuses, the
machine drawn in Mermaid.

A page marks a generated block with ``<!-- name:begin -->`` and ``<!-- name:end -->``;
:func:`refresh_doc` rewrites every such block a page has, from the renderers it is given
(``fsm.ops.diagram.BLOCKS``: ``policy``, ``exits`` and ``diagram``). ``python -m fsm.ops.diagram
--doc README.md --doc docs/policy.md --doc docs/contract.md --doc deploy/README.md`` calls
it, and the tests fail when a committed copy is stale. This module imports nothing of the
runner's: what a block holds is its caller's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = ["generated_block", "refresh_doc", "replace_block"]


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


def refresh_doc(path: Path | str, blocks: Mapping[str, Callable[[], str]]) -> bool:
    """Regenerate every block of ``blocks`` (what renders a generated block, by its name)
    that ``path`` holds; True when the file changed (ValueError when it holds none)."""
    doc = Path(path)
    text = doc.read_text(encoding="utf-8")
    names = [name for name in blocks if generated_block(text, name) is not None]
    if not names:
        raise ValueError(f"{doc} holds no generated block ({', '.join(blocks)})")
    new = text
    for name in names:
        new = replace_block(new, name, blocks[name]())
    if new != text:
        doc.write_text(new, encoding="utf-8")
    return new != text
