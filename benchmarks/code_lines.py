"""Production code lines of fsm/ and states/ (issue 39's measure), run by hand.

A line counts when it holds a token of code: blank lines, comments and docstrings (a
module's, a class's or a function's first string, and any other bare string statement)
do not. The test helpers (``fsm/testing``) and the demo's worker tree are not production
code and are left out. Logical lines are counted too (tokenize's NEWLINE tokens, one per
statement or clause header, docstrings left out): a measure that re-wrapping cannot move.

    python benchmarks/code_lines.py [ROOT]
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
            tokenize.DEDENT, tokenize.ENDMARKER}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def code_lines(path: Path) -> int:
    source = path.read_text(encoding="utf-8")
    docs = _docstring_lines(ast.parse(source))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in NOT_CODE:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(lines)


def logical_lines(path: Path) -> int:
    source = path.read_text(encoding="utf-8")
    docs = _docstring_lines(ast.parse(source))
    return sum(1 for tok in tokenize.generate_tokens(io.StringIO(source).readline)
               if tok.type == tokenize.NEWLINE and tok.start[0] not in docs)


def main(root: Path) -> None:
    modules = [p for package in ("fsm", "states") for p in sorted((root / package).rglob("*.py"))
               if "testing" not in p.parts and "demo_tree" not in p.parts]
    total = sum(code_lines(p) for p in modules)
    top = len(list((root / "fsm").glob("*.py")))
    logical = sum(logical_lines(p) for p in modules)
    print(f"{total} code lines ({logical} logical) in {len(modules)} modules; "
          f"{top} modules at fsm/'s top level")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
