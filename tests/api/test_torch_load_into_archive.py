"""gdskit.torch.load_into reads a torch.save archive as gdskit.torch.load does: the same
records, the same refusals, no descriptor left open (CPU tensors)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import gdskit.torch as gt  # noqa: E402
from gdskit.errors import FormatError, GdskitError  # noqa: E402
from gdskit.formats.into_plan import KeyMismatchError  # noqa: E402
from leak_helpers import fd_count  # noqa: E402
from repo_paths import SRC, child_pythonpath  # noqa: E402

pytestmark = pytest.mark.torch
HERE = Path(__file__).resolve().parent


def state() -> collections.OrderedDict:
    g = torch.Generator().manual_seed(3)
    sd = collections.OrderedDict()
    sd["w"] = torch.randn(16, 8, generator=g)
    sd["w_t"] = sd["w"].t()
    sd["b"] = torch.randn(8, generator=g).to(torch.bfloat16)
    sd["i"] = torch.arange(12, dtype=torch.int64)
    sd["empty"] = torch.empty(0, 3)
    return sd


def zeros_like(sd) -> dict:
    return {k: torch.zeros_like(v) if v.is_contiguous() else torch.zeros_like(v).t().contiguous().t()
            for k, v in sd.items()}


def deflate_records(src: Path, dst: Path, only=None) -> Path:
    """``src`` rewritten with its storage records (or those whose names end in ``only``) deflated."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            wanted = "/data/" in info.filename and (only is None or info.filename.endswith(only))
            zout.writestr(info.filename, zin.read(info),
                          compress_type=zipfile.ZIP_DEFLATED if wanted else zipfile.ZIP_STORED)
    return dst


# -- 1. deflated storage records ------------------------------------------------------

@pytest.mark.parametrize("only", [None, "/data/0"])
def test_deflated_storage_records_fill_the_targets_with_their_values(tmp_path, only) -> None:
    sd = state()
    plain = tmp_path / "plain.pt"
    torch.save(sd, plain)
    packed = deflate_records(plain, tmp_path / "packed.pt", only)
    ref = torch.load(packed, weights_only=True)
    target = zeros_like(sd)
    assert gt.load_into(target, packed) == ([], [])
    for k in sd:
        assert torch.equal(target[k], ref[k]), k


def test_one_deflated_record_alone(tmp_path) -> None:
    """The case that read the compressed bytes as data: one record, smaller packed than plain."""
    plain = tmp_path / "plain.pt"
    torch.save({"z": torch.zeros(4096)}, plain)
    packed = deflate_records(plain, tmp_path / "packed.pt")
    target = {"z": torch.full((4096,), 7.0)}
    gt.load_into(target, packed)
    assert torch.equal(target["z"], torch.zeros(4096))


def test_deflated_record_that_does_not_inflate_is_a_format_error_before_any_fill(tmp_path) -> None:
    plain = tmp_path / "plain.pt"
    torch.save({"a": torch.arange(64.0), "z": torch.zeros(4096)}, plain)
    packed = deflate_records(plain, tmp_path / "packed.pt", only="/data/1")
    data = bytearray(packed.read_bytes())
    with zipfile.ZipFile(packed) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data/1"))
    body = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data[body:body + 4] = b"\xff\xff\xff\xff"  # not a deflate stream
    packed.write_bytes(bytes(data))
    with pytest.raises(FormatError):
        gt.load(packed)
    target = {"a": torch.full((64,), -1.0), "z": torch.full((4096,), -1.0)}
    with pytest.raises(FormatError):
        gt.load_into(target, packed)
    assert bool((target["a"] == -1).all()) and bool((target["z"] == -1).all())  # nothing was filled


# -- 2. no descriptor left open -----------------------------------------------------------

def test_no_descriptor_left_open_by_many_calls_good_or_failing(tmp_path) -> None:
    sd = state()
    good = tmp_path / "good.pt"
    torch.save(sd, good)
    packed = deflate_records(good, tmp_path / "packed.pt")
    target = zeros_like(sd)
    wrong = {"other": torch.zeros(3)}
    bad = damaged(tmp_path)["header-data.pkl"]
    before = fd_count()
    for _ in range(40):
        gt.load_into(target, good)
        gt.load_into(target, packed)
        with pytest.raises(KeyMismatchError):
            gt.load_into(wrong, good)
        with pytest.raises(GdskitError):  # a shape that differs
            gt.load_into({"w": torch.zeros(3)}, good, strict=False)
        with pytest.raises(FormatError):  # a damaged archive
            gt.load_into(target, bad)
    assert fd_count() == before


def test_many_calls_under_a_small_descriptor_limit(tmp_path) -> None:
    """250 loads with 64 descriptors to spare (each call used to keep one)."""
    path = tmp_path / "one.pt"
    torch.save({"x": torch.arange(10.0)}, path)
    code = textwrap.dedent(f"""
        import os, resource, torch, gdskit.torch as gt
        spare = len(os.listdir("/proc/self/fd")) + 64
        resource.setrlimit(resource.RLIMIT_NOFILE, (spare, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        t = {{"x": torch.zeros(10)}}
        for _ in range(250):
            gt.load_into(t, {str(path)!r})
        assert torch.equal(t["x"], torch.arange(10.0))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), env_path()]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]


def env_path() -> str:
    return os.environ.get("PYTHONPATH", "")


# -- 3. damaged archives: the errors of gdskit.torch.load --------------------------------

def _local_header_of(data: bytes, ending: bytes) -> int:
    with zipfile.ZipFile(__import__("io").BytesIO(data)) as zf:
        info = next(i for i in zf.infolist() if i.filename.encode().endswith(ending))
    return info.header_offset


def damaged(tmp_path: Path) -> dict[str, Path]:
    """Archives torch's own reader chokes on where load_into asked it directly."""
    src = tmp_path / "src.pt"
    torch.save({"x": torch.arange(6.0)}, src)
    data = src.read_bytes()
    out = {}
    # a byteorder record whose bytes are not text
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp_path / "byteorder.pt", "w") as zout:
        for info in zin.infolist():
            body = b"\xff\xfe" if info.filename.endswith("/byteorder") else zin.read(info)
            zout.writestr(info.filename, body)
    out["byteorder"] = tmp_path / "byteorder.pt"
    # a record name that is not UTF-8
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp_path / "name.pt", "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
        zout.writestr(info.filename.split("/")[0] + "/x", b"")
    raw = bytearray((tmp_path / "name.pt").read_bytes())
    at = raw.rfind(b"/x")
    while at >= 0:
        raw[at + 1] = 0xFF
        at = raw.rfind(b"/x", 0, at)
    out["name"] = tmp_path / "name.pt"
    out["name"].write_bytes(bytes(raw))
    # damaged local headers of the pickle and of the byteorder record
    for ending in (b"data.pkl", b"byteorder"):
        bad = bytearray(data)
        at = _local_header_of(data, ending)
        bad[at:at + 4] = b"XXXX"
        p = tmp_path / f"header-{ending.decode()}.pt"
        p.write_bytes(bytes(bad))
        out[f"header-{ending.decode()}"] = p
    return out


@pytest.mark.parametrize("case", ["byteorder", "name", "header-data.pkl", "header-byteorder"])
def test_damaged_archive_is_refused_as_load_refuses_it(tmp_path, case) -> None:
    path = damaged(tmp_path)[case]
    with pytest.raises(FormatError) as by_load:
        gt.load(path)
    with pytest.raises(FormatError) as by_into:
        gt.load_into({"x": torch.zeros(6)}, path)
    assert type(by_into.value) is type(by_load.value)


# -- 3. differential: mutated real files, load and load_into decide alike -------------------

FUZZ_CASES = int(os.environ.get("GDSKIT_TORCH_INTO_FUZZ_CASES", "300"))


def test_mutated_checkpoints_load_into_agrees_with_load(tmp_path) -> None:
    """Each case in a worker process with capped memory and a timeout (tests/api/torch_fuzz.py,
    mode ``into``): a crash, a hang, a raw error or a disagreement fails the case."""
    import random

    import torch_fuzz
    from test_torch_hostile import FUZZ_SEED, judge_all

    torch_fuzz.make_bases(tmp_path)
    rng = random.Random(FUZZ_SEED + 1)
    bases = torch_fuzz.INTO_BASES
    cases = [(bases[i % len(bases)], rng.randrange(1 << 30)) for i in range(FUZZ_CASES)]
    verdicts = judge_all(tmp_path, cases, mode="into")
    assert len(verdicts) == len(cases)
    bad = [v for v in verdicts if v["verdict"] != "ok"]
    assert not bad, "\n".join(str(v) for v in bad[:20])
    outcomes = collections.Counter(v["detail"] for v in verdicts)
    assert outcomes["refused"] > 0 and outcomes["accepted"] > 0


def test_worker_memory_is_capped() -> None:
    """The fuzz worker's memory cap holds: an allocation past it fails there."""
    code = textwrap.dedent("""
        import resource, torch_fuzz
        torch_fuzz.cap_memory()
        soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
        assert soft != resource.RLIM_INFINITY
        try:
            bytearray(soft)
        except MemoryError:
            print("refused")
    """)
    env = dict(os.environ, PYTHONPATH=child_pythonpath(HERE))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "refused", proc.stderr[-2000:]
