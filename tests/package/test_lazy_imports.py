"""Every import inside a function of gdskit says, on its own line, why it is not at the top of its module.

An import belongs at the top of its module. One inside a function (a lazy import) is allowed for
the reasons below only, written on the import's line (the last line of a parenthesised one) in
one form: ``# noqa: PLC0415 - <reason>``. The imports are read from the source with ``ast``.
"""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from pathlib import Path

from repo_paths import SRC

PACKAGE = SRC / "gdskit"

#: The one form of the comment (other codes may come first: ``# noqa: F401, PLC0415 - ...``); the reason follows the dash.
FORM = re.compile(r"#\s*noqa: (?:[A-Z]+[0-9]+, )*PLC0415 - (?P<reason>.+?)\s*$")

#: The reasons a lazy import may give, one line each (a regular expression for the whole reason).
REASONS = {
    # an extra's package (pyproject.toml's optional-dependencies), absent where the extra is not installed
    r"optional dependency \((torch|safetensors|transformers|matplotlib|prometheus_client|vllm|botocore)\)": "optional",
    # a cost `import gdskit`, an entry module (safetensors, torch, data), the CLI's start or a first call would
    # otherwise pay for something only some calls need (rich, typer, psutil, pynvml, cuda.bindings, numpy
    # under the core, the engine's heavier modules)
    r"import time": "import time",
    # the two modules named import each other at import time; only where no order of the two works
    r"import cycle \(gdskit(\.\w+)+ <-> gdskit(\.\w+)+\)": "cycle",
    # a module attribute a test replaces, looked up at each call so that the replacement is seen
    r"test seam": "seam",
}


def lazy_imports(source: str) -> list[tuple[int, int]]:
    """(first line, last line) of each import statement inside a function or method of ``source``."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child.lineno, child.end_lineno or child.lineno))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return found


def comments_by_line(source: str) -> dict[int, str]:
    """The comment on each line of ``source`` (the tokenizer's, so a ``#`` inside a string is no comment)."""
    return {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT}


def reason_of(comment: str | None) -> str | None:
    """The reason ``comment`` gives for a lazy import, or None where it gives none the house accepts."""
    match = FORM.search(comment or "")
    if match is None:
        return None
    reason = match.group("reason")
    return reason if any(re.fullmatch(pattern, reason) for pattern in REASONS) else None


def unexplained(source: str) -> list[int]:
    """The first lines of the lazy imports in ``source`` whose last line gives no accepted reason."""
    comments = comments_by_line(source)
    return [first for first, last in lazy_imports(source) if reason_of(comments.get(last)) is None]


# -- the checker itself ------------------------------------------------------------------

def test_the_checker_finds_imports_in_functions_methods_and_nested_blocks():
    source = textwrap.dedent("""\
        import os
        if os.name:
            import json
        def f():
            import re
            try:
                from a import (b,
                               c)
            except ImportError:
                pass
        class K:
            def m(self):
                import io
            import abc
        """)
    assert lazy_imports(source) == [(5, 5), (7, 8), (13, 13)]


def test_the_checker_accepts_only_the_house_form_with_a_known_reason_on_the_last_line():
    source = textwrap.dedent("""\
        def f():
            import re  # noqa: PLC0415 - import time
            import a  # noqa: PLC0415 - optional dependency (torch)
            import b  # noqa: PLC0415 - optional dependency (leftpad)
            import c  # noqa: PLC0415
            import d  # import time
            import e  # noqa: PLC0415 - lazy on purpose
            from f import (g,  # noqa: PLC0415 - import time
                           h)
            from i import (j,
                           k)  # noqa: PLC0415 - test seam
            import m  # noqa: PLC0415 - import cycle (gdskit.engine.file <-> gdskit.engine.pool)
            import n  # noqa: PLC0415 - import cycle (somewhere)
            import p  # noqa: F401, PLC0415 - optional dependency (torch)
            s = "# noqa: PLC0415 - import time"; import o
            import q  # noqa: PLC0415, F401 - import time
        """)
    assert unexplained(source) == [4, 5, 6, 7, 8, 13, 15, 16]


# -- gdskit ------------------------------------------------------------------------------

def test_every_lazy_import_of_gdskit_gives_its_reason():
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        missing += [f"{path.relative_to(PACKAGE.parent)}:{line}" for line in unexplained(source)]
    assert not missing, (f"{len(missing)} imports inside functions without '# noqa: PLC0415 - <reason>' "
                         f"(reasons: {', '.join(REASONS)}):\n  " + "\n  ".join(missing))
