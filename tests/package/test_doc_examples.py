"""Every ```python example in README.md and docs/*.md runs as written.

Each example runs in a fresh interpreter, with a timeout and an address-space cap, in a temporary
directory shared by the examples of the same document, in document order (a later example may
read what an earlier one wrote: "the file written above"). An example that needs what this
machine may lack says so on its first line, e.g. ``# needs: gpu`` or ``# needs: torch``; it is
skipped where that is missing (GPU examples run on the GPU machine: ``pytest -m gpu``).
Needs no machine here can meet (``torchrun``: several GPU processes; ``inputs``: files or objects the
example names and the reader brings) keep the example out of the run altogether. A block after
``<!-- signature -->`` lists call signatures, not an example: each line is checked against the
function it names.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from repo_paths import REPO
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TIMEOUT_S = 180
ADDRESS_SPACE_CAP = 16 << 30   # torch maps much more than it uses; 16 GiB still stops a runaway
NEEDS = {"gpu", "torch", "transformers", "vllm", "torchrun", "inputs"}
NEVER_HERE = {"torchrun", "inputs"}

_BLOCK = re.compile(r"^```python\n(?P<code>.*?)^```", re.S | re.M)
_NEEDS_LINE = re.compile(r"#\s*needs:\s*(?P<what>[^;\n]*)")


@dataclass(frozen=True)
class Example:
    doc: Path
    line: int
    code: str
    signature: bool

    @property
    def needs(self) -> set[str]:
        first = self.code.splitlines()[0] if self.code.strip() else ""
        m = _NEEDS_LINE.match(first.strip())
        return {w.strip() for w in m.group("what").split(",") if w.strip()} if m else set()

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def examples(doc: Path) -> list[Example]:
    text = doc.read_text()
    found = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code"))   # the fence's line, 1-based
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append(Example(doc, line, m.group("code"), before.startswith("<!-- signature")))
    return found


ALL = [e for doc in DOCS for e in examples(doc)]
RUNNABLE = [e for e in ALL if not e.signature]


def test_every_example_is_found_and_says_its_needs_in_known_words():
    assert len(ALL) >= 15   # the parser still sees the blocks
    for e in ALL:
        assert e.needs <= NEEDS, (e.id, e.needs - NEEDS)


def _have(need: str) -> bool:
    if need == "gpu":
        from gdskit.engine import cuda
        return cuda.device_count() > 0
    if need in ("torch", "transformers", "vllm"):
        return importlib.util.find_spec(need) is not None
    return need not in NEVER_HERE


def _cap_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_CAP, ADDRESS_SPACE_CAP))


def _run(example: Example, cwd: Path) -> subprocess.CompletedProcess:
    script = cwd / f"example_{example.line}.py"
    script.write_text(example.code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    # The CUDA driver reserves far more address space than it uses (a GPU's memory is mapped
    # into the process): an example that touches a GPU (every torch example does where one is
    # present) fails under the cap with "out of memory" at its first copy. CPU machines keep it.
    cap = None if "gpu" in example.needs or _have("gpu") else _cap_address_space
    return subprocess.run([sys.executable, script.name], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, preexec_fn=cap)


def _cases() -> list:
    """Per document: its examples that need no GPU, and (on the GPU machine) all of them in order."""
    cases = []
    for d in DOCS:
        mine = [e for e in RUNNABLE if e.doc == d]
        name = str(d.relative_to(REPO))
        if any("gpu" not in e.needs for e in mine):
            cases.append(pytest.param(d, False, id=name))
        if any("gpu" in e.needs for e in mine):
            cases.append(pytest.param(d, True, id=f"{name}-gpu", marks=pytest.mark.gpu))
    return cases


@pytest.mark.parametrize("doc, with_gpu", _cases())
def test_examples_run_as_written(doc, with_gpu, tmp_path):
    ran, skipped = [], []
    for e in (e for e in RUNNABLE if e.doc == doc):
        if "gpu" in e.needs and not with_gpu:
            continue
        missing = sorted(n for n in e.needs if not _have(n))
        if missing:
            skipped.append(f"{e.id} needs {', '.join(missing)}")
            continue
        proc = _run(e, tmp_path)
        assert proc.returncode == 0, f"{e.id}:\n{e.code}\n{proc.stderr[-3000:]}"
        ran.append(e.id)
    if not ran:
        pytest.skip("; ".join(skipped))


# --------------------------------------------------------------------------- signatures
def _resolve(dotted: str, default_owner: str | None):
    parts = dotted.split(".")
    if len(parts) == 1:
        assert default_owner, f"{dotted}: a bare name needs <!-- signature: owner -->"
        parts = [*default_owner.split("."), *parts]
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _parameters(header: str) -> list[tuple[str, str, str | None]]:
    """A documented signature line's parameters: (name, kind, default source) each."""
    fn = ast.parse(f"def {header}: ...").body[0].args
    positional = fn.posonlyargs + fn.args
    defaults = [None] * (len(positional) - len(fn.defaults)) + [ast.unparse(d) for d in fn.defaults]
    out = [(a.arg, "positional", d) for a, d in zip(positional, defaults)]
    out += [(a.arg, "keyword", None if d is None else ast.unparse(d)) for a, d in zip(fn.kwonlyargs, fn.kw_defaults)]
    return out


def _actual(fn) -> list[tuple[str, str, str | None]]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        kind = "keyword" if p.kind is p.KEYWORD_ONLY else "positional"
        out.append((p.name, kind, None if p.default is p.empty else repr(p.default)))
    return out


SIGNATURES = [e for e in ALL if e.signature]


@pytest.mark.parametrize("example", SIGNATURES, ids=[e.id for e in SIGNATURES])
def test_documented_signatures_match_the_code(example):
    fence = example.doc.read_text().split("\n")[:example.line - 1]
    owner = re.search(r"<!-- signature: ([\w.]+) -->", "\n".join(fence).rstrip().rsplit("\n", 1)[-1])
    for line in example.code.splitlines():
        header = line.split("#", 1)[0].strip()
        if not header:
            continue
        name, rest = header.split("(", 1)
        documented = _parameters(f"{name.rsplit('.', 1)[-1]}({rest}")
        fn = _resolve(name, owner.group(1) if owner else None)
        assert _in_order(documented) == _in_order(_actual(fn)), f"{example.id}: {line}"


def _in_order(params: list[tuple[str, str, str | None]]) -> tuple[list, list]:
    """Positional parameters in their order; keyword-only ones in any order (a call cannot tell)."""
    return [p for p in params if p[1] == "positional"], sorted(p for p in params if p[1] == "keyword")
