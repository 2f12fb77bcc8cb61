"""The loader benchmark's own set-up must not favour gdskit (benchmarks/loaders.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
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
