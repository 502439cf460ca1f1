"""The generated blocks of the Markdown pages: the policy table of ``docs/policy.md``.

A page marks a generated block with ``<!-- name:begin -->`` and ``<!-- name:end -->``.
:func:`refresh_policy_doc` rewrites the ``policy`` block of a page from
``fsm.policy.render_table()``; ``python -m fsm.diagram --policy-doc docs/policy.md`` calls
it, and ``tests/test_docs.py`` fails when the committed copy is stale.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["generated_block", "refresh_policy_doc", "replace_block"]


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


def refresh_policy_doc(path: Path | str) -> bool:
    """Regenerate the ``policy`` block of ``path`` from ``fsm.policy.render_table()``;
    True when the file changed."""
    from fsm.policy import render_table

    doc = Path(path)
    text = doc.read_text(encoding="utf-8")
    new = replace_block(text, "policy", render_table())
    if new != text:
        doc.write_text(new, encoding="utf-8")
        return True
    return False
