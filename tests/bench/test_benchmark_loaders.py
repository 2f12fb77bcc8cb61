"""The loader benchmark's own set-up must not favour gdskit (benchmarks/loaders.py)."""

from __future__ import annotations

import json
import sys

import pytest

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.torch

from repo_paths import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import loaders  # noqa: E402

from gdskit.formats import safetensors_format  # noqa: E402


def test_target_made_before_the_clock_leaves_no_header_remembered(tmp_path) -> None:
    # Enough names for a header over the remembering threshold: a load that found it parsed
    # already would skip work a real program's first load does.
    values = {f"layer.{i}.weight": torch.zeros(2, dtype=torch.bfloat16) for i in range(2000)}
    path = tmp_path / "many.safetensors"
    st_torch.save_file(values, str(path))
    safetensors_format.forget_headers()
    target = loaders._prepare("gdskit-into", str(path), "cpu")
    assert {k: tuple(v.shape) for k, v in target.state_dict().items()} == {k: (2,) for k in values}
    assert not safetensors_format._memo


# --------------------------------------------------------------------------- exit status
BENCHMARKS = REPO / "benchmarks"


def test_a_benchmark_whose_every_row_failed_exits_non_zero(tmp_path) -> None:
    # kvikio is a peer of preload-shards that is not installed here: its only row is an error row.
    import importlib.util
    import os
    import subprocess

    if importlib.util.find_spec("kvikio") is not None:
        pytest.skip("kvikio is installed: its row would measure")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "data.py"), "--device", "cpu", "--quick",
                           "--workloads", "preload-shards", "--peers", "kvikio", "--dir", str(tmp_path / "data"),
                           "--json", str(tmp_path / "rows.json")],
                          capture_output=True, text=True, timeout=240, env=env)
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]   # the run got as far as its table
    assert rows and all("error" in r for r in rows)
    assert proc.returncode == 1


@pytest.mark.parametrize("rows, status", [
    ([], 1),
    ([{"error": "ModuleNotFoundError: No module named 'gdskit'"}], 1),
    ([{"error": "not installed"}, {"error": "timed out after 120 s"}], 1),
    ([{"error": "not installed"}, {"wall_s": 0.5}], 0),
    ([{"wall_s": 0.5}], 0),
])
def test_exit_status_is_one_only_when_no_row_measured(rows, status) -> None:
    import fresh_process

    assert fresh_process.exit_status(rows) == status
