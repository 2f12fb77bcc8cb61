"""Without torch: the core works, and every torch-facing module fails at import, alike.

Each case runs in a fresh interpreter in which torch cannot be imported (a finder on
``sys.meta_path`` refuses ``torch`` and its submodules, as an environment without torch
would), whether or not torch is installed here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# What `import torch` does where torch is not installed; put in place before anything else.
_BLOCK = """
import importlib.abc, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, NotInstalled())
"""

# Each torch-facing module, and the extra whose install brings what it needs.
TORCH_MODULES = {
    "gdskit.safetensors": "gdskit[torch]",
    "gdskit.torch": "gdskit[torch]",
    "gdskit.data": "gdskit[torch]",
    "gdskit.dcp": "gdskit[torch]",
    "gdskit.transformers": "gdskit[transformers]",
}


def _run(code: str, blocked: tuple[str, ...] = ("torch",)) -> dict:
    """``code``'s last line of output (JSON), run where the packages ``blocked`` cannot be imported."""
    env = {k: v for k, v in os.environ.items() if k != "GDSKIT_STATS"}
    out = subprocess.run([sys.executable, "-c", _BLOCK.format(blocked=set(blocked)) + code], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


_IMPORT_TWICE = """
import importlib, json
import gdskit
from gdskit.errors import GdskitError, MissingDependencyError
seen = []
for attempt in range(2):  # a second import fails the same way: no half-made module is left behind
    try:
        importlib.import_module({module!r})
        seen.append(None)
    except BaseException as exc:
        seen.append({{"type": type(exc).__name__, "missing_dependency": isinstance(exc, MissingDependencyError),
                     "import_error": isinstance(exc, ImportError), "gdskit_error": isinstance(exc, GdskitError),
                     "hint": "pip install '{extra}'" in str(exc)}})
print(json.dumps({{"seen": seen, "left": {module!r} in sys.modules, "torch": "torch" in sys.modules}}))
"""

_REFUSED = {"type": "MissingDependencyError", "missing_dependency": True, "import_error": True,
            "gdskit_error": True, "hint": True}


@pytest.mark.parametrize("module", sorted(TORCH_MODULES))
def test_a_torch_facing_module_fails_at_import_with_the_install_hint(module) -> None:
    result = _run(_IMPORT_TWICE.format(module=module, extra=TORCH_MODULES[module]))
    assert result == {"seen": [_REFUSED, _REFUSED], "left": False, "torch": False}


def test_gdskit_transformers_without_transformers_fails_at_import_with_the_install_hint() -> None:
    pytest.importorskip("torch")
    result = _run(_IMPORT_TWICE.format(module="gdskit.transformers", extra="gdskit[transformers]"),
                  blocked=("transformers",))
    assert result == {"seen": [_REFUSED, _REFUSED], "left": False, "torch": True}


_CORE = """
import json
import gdskit
data = bytes(range(256)) * 4099
with open({path!r}, "wb") as f:
    f.write(data)
buf = bytearray(len(data))
with gdskit.open({path!r}) as f:
    n = f.read(buf)
with gdskit.settings.set(chunk_size="64KiB"):
    with gdskit.open({path!r}) as f:
        part = bytearray(10000)
        m = f.read(part, file_offset=12345)
print(json.dumps({{"n": n, "same": bytes(buf) == data, "m": m, "part": bytes(part) == data[12345:22345],
                  "bytes_read": gdskit.stats().bytes_read, "torch": "torch" in sys.modules}}))
"""


def test_the_core_imports_and_reads_host_memory_without_torch(tmp_path) -> None:
    result = _run(_CORE.format(path=str(tmp_path / "data.bin")))
    size = 256 * 4099
    assert result == {"n": size, "same": True, "m": 10000, "part": True, "bytes_read": size + 10000, "torch": False}


_PLACEMENT = """
import json
from gdskit.formats.placement import LayerKind, ParamFacts, Record, plan_placements
param = ParamFacts("o.weight", LayerKind.ROW, (2, 3), "BF16", 1, 2, output_dim=0, input_dim=1)
plan = plan_placements({"o.weight": param}, [Record("o.weight", "f", 100, 24, "BF16", (2, 6))])
print(json.dumps({"runs": [list(r) for p in plan.placements for r in p.runs], "torch": "torch" in sys.modules}))
"""


def test_the_placement_plan_is_pure_arithmetic_without_torch() -> None:
    result = _run(_PLACEMENT)
    # rank 1 of 2 keeps columns 3..5 of each 6-column BF16 row: 6 bytes from byte 6 of each 12-byte row
    assert result == {"runs": [[106, 6, 0], [118, 6, 6]], "torch": False}
