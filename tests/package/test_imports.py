"""What the library's entry modules import, and that their first call works once they are imported lazily.

Each case runs in a fresh interpreter: what an import pulls in can only be seen before
anything else has imported it. No timing here; benchmarks/import_time.py measures it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from repo_paths import STAND_INS

ENTRY_MODULES = ("gdskit", "gdskit.safetensors", "gdskit.torch", "gdskit.data")

# Nothing of these is needed by a first load, save or read: the CUDA bindings load with the
# first GPU call, the rest belongs to the CLI, the checks, benchmarks and live statistics.
FORBIDDEN = ("cuda.bindings.driver", "cuda.bindings.runtime", "cuda.bindings.cufile", "pynvml", "rich", "typer",
             "click", "gdskit.cli", "gdskit.probe", "gdskit.bench", "gdskit.accept", "gdskit.telemetry",
             "gdskit.telemetry.render", "gdskit.dcp", "gdskit.transformers")

# Records, for every forbidden module, whether torch's own import asked for it (torch 2.13
# imports cuda.bindings.runtime, which is torch's cost and not gdskit's).
_RECORDER = """
import importlib.abc, json, os, sys, traceback
FORBIDDEN = {forbidden!r}
TORCH_DIR = os.sep + "torch" + os.sep
by_torch = set()

class Recorder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in FORBIDDEN and any(TORCH_DIR in f.filename for f in traceback.extract_stack()):
            by_torch.add(name)
        return None

sys.meta_path.insert(0, Recorder())
"""


def _env_without_stats(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GDSKIT_STATS"}
    env.update(extra)
    return env


def _run(code: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_entry_modules_import_nothing_a_first_call_does_not_need():
    pytest.importorskip("torch")
    code = _RECORDER.format(forbidden=FORBIDDEN) + (
        f"import {', '.join(ENTRY_MODULES)}\n"
        "print(json.dumps(sorted(m for m in FORBIDDEN if m in sys.modules and m not in by_torch)))\n")
    assert json.loads(_run(code, _env_without_stats())) == []


_NO_TORCH = """
import importlib.abc, json, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch here")
sys.meta_path.insert(0, NoTorch())
"""


def test_without_torch_no_cuda_bindings_and_no_numpy_are_imported():
    # Without torch (which imports cuda.bindings itself) every module counts, numpy too; the
    # torch-facing modules fail at import (tests/package/test_import_without_torch.py), and pull in
    # nothing on the way.
    code = _NO_TORCH + (
        "import gdskit\n"
        "from gdskit.errors import MissingDependencyError\n"
        "for name in ('gdskit.safetensors', 'gdskit.torch'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except MissingDependencyError:\n"
        "        pass\n"
        f"print(json.dumps(sorted(m for m in {FORBIDDEN + ('numpy', 'cuda.bindings')!r} if m in sys.modules)))\n")
    assert json.loads(_run(code, _env_without_stats())) == []


def test_the_public_names_resolve_to_the_engine_after_a_lazy_import():
    code = ("import gdskit, sys\n"
            "assert 'gdskit.engine.file' not in sys.modules\n"
            "from gdskit import *\n"
            "import gdskit.engine.file, gdskit.engine.ledger, gdskit.engine.pool, gdskit.engine.cuda, gdskit.settings\n"
            "assert gdskit.File is gdskit.engine.file.File and gdskit.open is gdskit.engine.file.open\n"
            "assert gdskit.stats is gdskit.engine.ledger.stats and gdskit.Stats is gdskit.engine.ledger.Stats\n"
            "assert gdskit.ResourceUsage is gdskit.engine.pool.ResourceUsage and gdskit.engine.cuda is sys.modules['gdskit.engine.cuda']\n"
            "assert isinstance(gdskit.settings, gdskit.Settings)\n"  # the object, never the submodule
            "assert set(gdskit.__all__) <= set(dir(gdskit))\n"
            "print(sorted(n for n in gdskit.__all__ if not hasattr(gdskit, n)))\n")
    assert _run(code, _env_without_stats()).strip() == "[]"
    with pytest.raises(AttributeError):
        import gdskit

        gdskit.no_such_name  # noqa: B018


def test_safetensors_names_of_load_into_resolve_lazily():
    pytest.importorskip("torch")
    code = ("import sys, gdskit.safetensors as gs\n"
            "assert 'gdskit.formats.into_plan' not in sys.modules\n"
            "from gdskit.formats import into_plan\n"
            "assert gs.KeyMismatchError is into_plan.KeyMismatchError\n"
            "assert set(gs.__all__) <= set(dir(gs))\n"
            "print(sorted(n for n in gs.__all__ if not hasattr(gs, n)))\n")
    assert _run(code, _env_without_stats()).strip() == "[]"


def test_data_names_resolve_lazily_and_preload_stays_the_function():
    pytest.importorskip("torch")
    code = ("import sys, gdskit.data as gd\n"
            "assert [m for m in sys.modules if m.startswith('gdskit.data.')] == []\n"
            "from gdskit.data.preload import read_files  # the submodule of the same name, imported first\n"
            "import gdskit.data.preload\n"
            "assert callable(gd.preload) and gd.preload is sys.modules['gdskit.data.preload'].preload\n"
            "from gdskit.data import Loader, TruncatedFileError\n"
            "from gdskit.formats.safetensors_format import TruncatedFileError as base\n"
            "assert Loader is sys.modules['gdskit.data.loader'].Loader and TruncatedFileError is base\n"
            "assert set(gd.__all__) <= set(dir(gd))\n"
            "print(sorted(n for n in gd.__all__ if not hasattr(gd, n)))\n")
    assert _run(code, _env_without_stats()).strip() == "[]"


def test_preload_resolved_imports_no_driver_layer_parser_or_checks_before_its_first_call():
    """What a first ``gdskit.data.preload`` served by the resident loader never uses stays
    unimported until a read in the process (or a verified preload) needs it."""
    pytest.importorskip("torch")
    code = ("import sys, gdskit.data as gd\n"
            "gd.preload\n"
            "heavy = ('gdskit.engine.buffers', 'gdskit.engine.cuda', 'gdskit.formats.safetensors_format',\n"
            "         'gdskit.formats.verified', 'gdskit.verify.manifest', 'gdskit.verify.expect')\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n")
    assert _run(code, _env_without_stats()).strip() == "[]"


def test_first_host_read_load_and_batch_after_a_lazy_import(tmp_path):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    data = os.urandom((1 << 20) + 12345)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(data)
    ckpt = tmp_path / "m.safetensors"
    ref = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    safetensors_torch.save_file(ref, str(ckpt))
    out = tmp_path / "out.bin"
    tokens = np.arange(1000, dtype=np.uint16)
    tokens_file = tmp_path / "tokens.bin"
    tokens.tofile(tokens_file)
    code = (f"import gdskit\n"
            f"buf = bytearray({len(data)})\n"
            f"with gdskit.open({str(raw)!r}) as f:\n"
            f"    assert f.read(buf) == {len(data)}\n"
            f"open({str(out)!r}, 'wb').write(buf)\n"
            f"assert gdskit.stats().bytes_read == {len(data)}\n"
            f"import gdskit.safetensors, torch\n"
            f"t = gdskit.safetensors.load_file({str(ckpt)!r}, device='cpu')\n"
            f"torch.save(t, {str(tmp_path / 'loaded.pt')!r})\n"
            f"import gdskit.data as gd\n"
            f"ds = gd.TokenDataset({str(tokens_file)!r}, dtype='uint16', seq_len=8)\n"
            f"torch.save(next(iter(gd.Loader(ds, 2, device='cpu'))), {str(tmp_path / 'batch.pt')!r})\n")
    _run(code, _env_without_stats())
    assert out.read_bytes() == data
    loaded = torch.load(tmp_path / "loaded.pt")
    assert loaded.keys() == ref.keys() and all(torch.equal(loaded[k], ref[k]) for k in ref)
    batch = torch.load(tmp_path / "batch.pt")
    assert np.array_equal(batch.numpy(), np.stack([tokens[0:9], tokens[8:17]]))


def test_routing_and_numa_get_the_machine_facts_when_the_engine_loads(tmp_path):
    # Through the formats' door (gdskit.engine.file directly), not through the package's names.
    (tmp_path / "f.bin").write_bytes(b"x" * 4096)
    code = ("import os, sys, gdskit\n"
            "assert 'gdskit.engine.gpu_routing' not in sys.modules and 'gdskit.engine.numa' not in sys.modules\n"
            "from gdskit.engine import open_file\n"
            f"open_file({str(tmp_path / 'f.bin')!r}).close()\n"
            "from gdskit.engine import numa, gpu_routing\n"
            f"facts = gpu_routing.fact_source()(os.stat({str(tmp_path)!r}).st_dev, ())\n"
            "print(isinstance(facts, gpu_routing.StorageFacts), callable(numa._source))\n")
    assert _run(code, _env_without_stats()).split() == ["True", "True"]


@pytest.mark.stand_in_gpu
def test_first_gpu_read_after_a_lazy_import_on_the_stand_in_driver(tmp_path):
    data = os.urandom((3 << 20) + 4097)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(data)
    code = (_NO_TORCH +
            f"sys.path.insert(0, {str(STAND_INS)!r})\n"
            "import gdskit\n"
            "from gdskit.engine import cuda\n"
            "from fake_cuda import FakeDriver\n"
            "fake = FakeDriver()\n"
            "with cuda.use_driver(fake), gdskit.settings.set(mode='bounce', chunk_size='256KiB', threads=3):\n"
            f"    buf = cuda.DeviceArray({len(data)})\n"
            f"    with gdskit.open({str(raw)!r}) as f:\n"
            f"        assert f.read(buf) == {len(data)}\n"
            f"    open({str(tmp_path / 'out.bin')!r}, 'wb').write(buf.to_numpy().tobytes())\n"
            "    buf.free()\n"
            "print(json.dumps({'paths': sorted(gdskit.stats().paths), 'violations': list(fake.violations),\n"
            "                  'bindings': 'cuda.bindings.driver' in sys.modules}))\n")
    result = json.loads(_run(code, _env_without_stats()))
    assert (tmp_path / "out.bin").read_bytes() == data
    assert result == {"paths": result["paths"], "violations": [], "bindings": False}
    assert result["paths"] and set(result["paths"]) <= {"bounce-cached", "bounce-direct"}


@pytest.mark.parametrize("entry", ["gdskit", "gdskit.safetensors"])
def test_gdskit_stats_set_at_start_up_still_publishes_from_import(tmp_path, entry):
    if entry != "gdskit":
        pytest.importorskip("torch")
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir(mode=0o700)
    code = (f"import os, sys, threading, {entry}\n"
            "print('gdskit.telemetry.publish' in sys.modules, 'gdskit-stats' in [t.name for t in threading.enumerate()],\n"
            f"      len(os.listdir({str(stats_dir)!r})) > 0)\n")  # published at once, from import on
    out = _run(code, _env_without_stats(GDSKIT_STATS="1", GDSKIT_STATS_DIR=str(stats_dir)))
    assert out.split() == ["True", "True", "True"]


_COUNTING_DRIVER = """
import importlib.abc, importlib.machinery, json, sys, threading, time, types
calls = {"imports": 0, "cuInit": 0}

class Driver(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # A stand-in cuda.bindings.driver that counts its imports and initialisations; cuInit is slow,
    # so first calls from several threads overlap.
    def find_spec(self, name, path=None, target=None):
        if name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
            return importlib.machinery.ModuleSpec(name, self, is_package=name != "cuda.bindings.driver")
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        if module.__name__ == "cuda.bindings.driver":
            calls["imports"] += 1
            def cuInit(flags):
                calls["cuInit"] += 1
                time.sleep(0.2)
                return (0,)
            module.cuInit = cuInit
            module.cuDeviceGetCount = lambda: (0, 1)

sys.meta_path.insert(0, Driver())
"""


def test_the_driver_bindings_are_imported_and_initialised_once_by_concurrent_first_calls():
    code = _NO_TORCH + _COUNTING_DRIVER + (
        "import gdskit\n"
        "from gdskit.engine import cuda\n"
        "assert 'cuda.bindings.driver' not in sys.modules\n"
        "start = threading.Barrier(8)\n"
        "got = []\n"
        "def first_call():\n"
        "    start.wait()\n"
        "    got.append(cuda.driver_or_none())\n"
        "threads = [threading.Thread(target=first_call) for _ in range(8)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "assert len(got) == 8 and all(d is sys.modules['cuda.bindings.driver'] for d in got)\n"
        "assert cuda.device_count() == 1\n"
        "print(json.dumps(calls))\n")
    assert json.loads(_run(code, _env_without_stats())) == {"imports": 1, "cuInit": 1}


def test_unverified_loads_leave_the_manifests_and_checks_unimported(tmp_path):
    torch = pytest.importorskip("torch")
    ckpt = tmp_path / "m.safetensors"
    pt = tmp_path / "m.pt"
    ref = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    code = ("import sys, torch, gdskit.safetensors as gs, gdskit.torch as gt\n"
            "heavy = ('gdskit.verify.manifest', 'gdskit.verify.expect', 'gdskit.verify.check')\n"
            f"ref = {{'a': torch.arange(1000, dtype=torch.float32), 'b': torch.ones(3, 5, dtype=torch.bfloat16)}}\n"
            f"gs.save_file(ref, {str(ckpt)!r})\n"
            f"gt.save(ref, {str(pt)!r})\n"
            f"assert all(torch.equal(gs.load_file({str(ckpt)!r})[k], ref[k]) for k in ref)\n"
            f"assert all(torch.equal(gt.load({str(pt)!r})[k], ref[k]) for k in ref)\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n"
            f"gs.save_file(ref, {str(tmp_path / 'd.safetensors')!r}, digests=True)\n"
            f"assert all(torch.equal(gs.load_file({str(tmp_path / 'd.safetensors')!r}, verify=True)[k], ref[k]) "
            "for k in ref)\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n")
    before, after = _run(code, _env_without_stats()).splitlines()
    assert before == "[]" and after == repr(["gdskit.verify.check", "gdskit.verify.expect", "gdskit.verify.manifest"])
