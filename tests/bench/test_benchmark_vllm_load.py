"""benchmarks/vllm_load.py's own arithmetic: what it reads from an engine's output, and its verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
from repo_paths import REPO

BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import vllm_load  # noqa: E402


def _log(load: float, ready: float, placement=None) -> str:
    return ("INFO 12-04 [gpu_model_runner.py:2000] Model loading took 8.05 GiB memory and "
            f"{load} seconds\nother line\n" + vllm_load._MARKER
            + json.dumps({"ready_s": ready, "engine_s": ready - 0.1, "placement": placement}) + "\n")


def test_an_engines_figures_are_read_from_its_output() -> None:
    got = vllm_load.parse_engine_log(_log(2.5, 9.25, {"placed": 291, "fallback": 0}), 0)
    assert got["load_s"] == 2.5 and got["model_gib"] == 8.05 and got["ready_s"] == 9.25
    assert got["placement"] == {"placed": 291, "fallback": 0}


def test_an_engine_that_failed_or_never_answered_is_an_error_row() -> None:
    assert "error" in vllm_load.parse_engine_log(_log(2.5, 9.0), 1)
    assert "error" in vllm_load.parse_engine_log("Model loading took 8 GiB and 2.0 seconds\n", 0)
    assert "error" in vllm_load.parse_engine_log(vllm_load._MARKER + '{"ready_s": 1}\n', 0)


def test_verdicts_follow_the_medians() -> None:
    def rows(*pairs):
        return [{"load_s": a, "ready_s": b} for a, b in pairs]
    runs = {"hot": {"safetensors": rows((3.0, 20.0), (3.2, 21.0), (2.9, 19.0)),
                    "runai_streamer": rows((2.0, 18.0)),
                    "gdskit": rows((1.4, 15.0), (1.5, 16.0), (9.0, 30.0))}}
    lines, verdicts = vllm_load.summarize(runs, ["safetensors", "runai_streamer", "gdskit"], 8 << 30)
    assert verdicts["hot: gdskit load <= 0.5x safetensors"].startswith("met")       # 1.5 / 3.0
    assert verdicts["hot: gdskit load <= 0.7x runai_streamer"].startswith("NOT met")  # 1.5 / 2.0
    assert verdicts["hot: gdskit the lowest time to first token"].startswith("met")  # 16 against 18 and 20
    assert len(lines) == 5
    runs["hot"]["runai_streamer"] = rows((2.0, 12.0))
    _, verdicts = vllm_load.summarize(runs, ["safetensors", "runai_streamer", "gdskit"], 8 << 30)
    assert verdicts["hot: gdskit the lowest time to first token"].startswith("NOT met")


def test_a_run_of_nothing_is_refused_before_anything_is_made(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "vllm_load.py"), "--dir", str(tmp_path), "--no-hot"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and not any(tmp_path.iterdir())
