"""gdskit.torch.load on hostile files: views past their storage, damaged archives, mutation fuzz.

The rule throughout: gdskit either raises a GdskitError or returns exactly what
``torch.load(weights_only=True)`` returns for the same bytes; where torch.load refuses
the bytes, gdskit refuses them too; nothing crashes or hangs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import gdskit.torch as gt  # noqa: E402
from gdskit.errors import FormatError  # noqa: E402
from leak_helpers import fd_count  # noqa: E402
from repo_paths import child_pythonpath  # noqa: E402
from torch_checkpoints import same  # noqa: E402

pytestmark = pytest.mark.torch

HERE = Path(__file__).resolve().parent
#: Every way a load can place its storages: after the unpickle (the saved device), read
#: ahead of it (one device named), and one by one through a callable.
MAP_LOCATIONS = [None, "cpu", lambda storage, location: storage]
MAP_IDS = ["saved-device", "read-ahead", "callable"]


class View:
    """Pickles as torch's own tensor rebuild call, with the view (offset, size, stride) chosen
    by the test: what a damaged or hostile pickle can say of a storage."""

    def __init__(self, storage, offset, size, stride, rebuild: str = "v2") -> None:
        self.args = (storage, offset, tuple(size), tuple(stride))
        self.rebuild = rebuild

    def __reduce__(self):
        storage, offset, size, stride = self.args
        if self.rebuild == "v3":
            return (torch._utils._rebuild_tensor_v3,
                    (storage, offset, size, stride, False, collections.OrderedDict(), storage.dtype))
        return (torch._utils._rebuild_tensor_v2, (storage, offset, size, stride, False, collections.OrderedDict()))


def write_view(path: Path, numel: int, offset: int, size, stride, rebuild: str = "v2") -> Path:
    """A torch.save archive of ``{"t": view, "whole": the storage's tensor}`` over one float32 storage."""
    whole = torch.arange(numel, dtype=torch.float32)
    typed = torch.storage.TypedStorage(wrap_storage=whole.untyped_storage(), dtype=torch.float32, _internal=True)
    torch.save({"whole": whole, "t": View(typed, offset, size, stride, rebuild)}, path)
    return path


def torch_refuses(path: Path) -> bool:
    try:
        torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal
        return True
    return False


# -- views past the end of their storage ---------------------------------------------

# (storage elements, storage offset, size, stride): each reaches past its storage.
PAST_THE_END = {
    "one element past": (10, 1, (10,), (1,)),
    "one element past, 2-D": (12, 0, (3, 5), (4, 1)),
    "far past": (10, 0, (1_000_000,), (1,)),
    "offset at the end": (10, 10, (1,), (1,)),
    "offset far past the end": (10, 1 << 40, (1,), (1,)),
    "negative offset": (10, -1, (1,), (1,)),
    "negative size": (10, 0, (-1,), (1,)),
    "negative stride": (10, 9, (10,), (-1,)),
    "huge stride": (10, 0, (2,), (1 << 62,)),
    "largest stride": (10, 0, (2,), ((1 << 63) - 1,)),
    "size product overflows": (10, 0, (1 << 32, 1 << 32), (1 << 32, 1 << 32)),
    "offset beyond int64": (10, 1 << 63, (1,), (1,)),
    "large storage, one element past": (400_000, 1, (400_000,), (1,)),  # read ahead, straight into it
    "large storage, far past": (400_000, 0, (1 << 30,), (1,)),
}

# Views torch.load accepts although they look odd: gdskit must load them identically.
ODD_BUT_VALID = {
    "exact fit": (10, 0, (10,), (1,)),
    "last element at the end": (10, 5, (5,), (1,)),
    "empty, offset past the end": (10, 1000, (0,), (1,)),
    "empty, huge strides": (10, 0, (0, 5), (1 << 62, 1 << 62)),
    "empty with a negative size": (10, 0, (0, -1), (1, 1)),
    "broadcast far": (10, 9, (1 << 40,), (0,)),
    "size-1 dimension with a negative stride": (10, 3, (1, 4), (-7, 1)),
    "scalar at the last element": (10, 9, (), ()),
    "large storage, exact fit": (400_000, 399_990, (10,), (1,)),
}


@pytest.mark.parametrize("rebuild", ["v2", "v3"])
@pytest.mark.parametrize("case", list(PAST_THE_END))
@pytest.mark.parametrize("map_location", MAP_LOCATIONS, ids=MAP_IDS)
def test_view_past_its_storage_is_refused(tmp_path, case, map_location, rebuild) -> None:
    path = write_view(tmp_path / "v.pt", *PAST_THE_END[case], rebuild=rebuild)
    assert torch_refuses(path)
    before = fd_count()
    with pytest.raises(FormatError):
        gt.load(path, map_location=map_location)
    assert fd_count() == before


@pytest.mark.parametrize("case", list(ODD_BUT_VALID))
@pytest.mark.parametrize("map_location", MAP_LOCATIONS, ids=MAP_IDS)
def test_odd_but_valid_views_load_as_torch_loads_them(tmp_path, case, map_location) -> None:
    path = write_view(tmp_path / "v.pt", *ODD_BUT_VALID[case])
    ref = torch.load(path, weights_only=True)
    out = gt.load(path, map_location=map_location)
    assert same(out, ref)
    assert out["t"].untyped_storage().data_ptr() == out["whole"].untyped_storage().data_ptr()


@pytest.mark.parametrize("map_location", MAP_LOCATIONS, ids=MAP_IDS)
def test_loaded_storages_cannot_grow(tmp_path, map_location) -> None:
    path = tmp_path / "s.pt"
    torch.save({"small": torch.ones(10), "large": torch.ones(400_000)}, path)
    out = gt.load(path, map_location=map_location)
    for t in out.values():
        assert not t.untyped_storage().resizable()
        with pytest.raises(RuntimeError):
            torch.empty(0).set_(t.untyped_storage(), 0, (t.numel() + 1,), (1,))


@pytest.mark.parametrize("case", ["one element past", "large storage, one element past", "negative stride"])
def test_view_past_its_storage_is_refused_by_the_full_unpickler(tmp_path, case) -> None:
    path = write_view(tmp_path / "v.pt", *PAST_THE_END[case])
    for ml in MAP_LOCATIONS:
        with pytest.raises(FormatError):
            gt.load(path, map_location=ml, weights_only=False)


def _numel_overflows(size) -> bool:
    """torch multiplies the sizes as unsigned 64-bit numbers (a negative one is huge) and
    refuses a product that overflowed on the way, even where a later size is 0."""
    product, overflowed = 1, False
    for s in size:
        product *= s % (1 << 64)
        if product >> 64:
            overflowed, product = True, product % (1 << 64)
    return overflowed


def fits(nbytes: int, itemsize: int, offset: int, size, stride) -> bool:
    """torch's rule for a strided view of a storage (exact for values far from 2**63):
    a view with a zero-length dimension reads nothing; else a negative offset, size or
    (where the dimension has more than one element) stride is refused, and the furthest
    element must lie inside the storage."""
    if offset < 0 or _numel_overflows(size):
        return False
    if 0 in size:
        return True
    if any(s < 0 for s in size) or any(st < 0 and s > 1 for s, st in zip(size, stride)):
        return False
    last = offset + sum(st * (s - 1) for s, st in zip(size, stride))
    return (last + 1) * itemsize <= nbytes


_dim = st.integers(-3, 13) | st.sampled_from([-64, 64, 1000])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(numel=st.integers(0, 24), offset=st.integers(-4, 30),
       dims=st.lists(st.tuples(_dim, _dim), max_size=3))
def test_views_accepted_exactly_as_torch_accepts_them(tmp_path, numel, offset, dims) -> None:
    size, stride = [d[0] for d in dims], [d[1] for d in dims]
    path = write_view(tmp_path / "h.pt", numel, offset, size, stride)
    expected = fits(4 * numel, 4, offset, size, stride)
    assert torch_refuses(path) is not expected  # the rule above is torch's
    for ml in (None, "cpu"):
        if expected:
            assert same(gt.load(path, map_location=ml), torch.load(path, weights_only=True))
        else:
            with pytest.raises(FormatError):
                gt.load(path, map_location=ml)


# -- damaged archives --------------------------------------------------------------------

def rewrite_zip(src: Path, dst: Path, *, compress=(), replace=None) -> Path:
    """``src`` rewritten record by record: records whose name ends with one of ``compress``
    deflated, ``replace`` {name ending: bytes} swapped in."""
    replace = replace or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            for ending, new in replace.items():
                if info.filename.endswith(ending):
                    data = new
            method = zipfile.ZIP_DEFLATED if info.filename.endswith(tuple(compress)) else zipfile.ZIP_STORED
            zout.writestr(info.filename, data, compress_type=method)
    return dst


@pytest.mark.parametrize("map_location", MAP_LOCATIONS, ids=MAP_IDS)
def test_deflated_storage_records_are_inflated(tmp_path, map_location) -> None:
    sd = {"zeros": torch.zeros(5000), "ramp": torch.arange(300.0), "big": torch.zeros(400_000),
          "view": None}
    sd["view"] = sd["ramp"][10:20]
    plain = tmp_path / "plain.pt"
    torch.save(sd, plain)
    names = zipfile.ZipFile(plain).namelist()
    storages = [n.split("/", 1)[1] for n in names if "/data/" in n]
    deflated = rewrite_zip(plain, tmp_path / "deflated.pt", compress=storages)
    sizes = {i.filename: (i.compress_size, i.file_size) for i in zipfile.ZipFile(deflated).infolist()}
    assert any(c < n for c, n in sizes.values())  # the zeros did shrink
    ref = torch.load(deflated, weights_only=True)
    assert same(ref, sd)
    out = gt.load(deflated, map_location=map_location)
    assert same(out, ref)


def _central_entry_of(data: bytes, ending: bytes) -> int:
    """Where the central directory entry of the record whose name ends with ``ending`` starts."""
    pos = data.find(b"PK\x01\x02")
    while pos >= 0:
        name_len = int.from_bytes(data[pos + 28:pos + 30], "little")
        if data[pos + 46:pos + 46 + name_len].endswith(ending):
            return pos
        pos = data.find(b"PK\x01\x02", pos + 4)
    raise AssertionError(ending)


# (central directory field, value, whether torch.load refuses the result): torch's reader hands
# back memory it never filled for a record that does not inflate, or is marked as a directory.
UNREADABLE = {"bzip2": ("method", 12, True), "marked deflated": ("method", 8, False),
              "encrypted": ("flags", 1, True), "a directory": ("external", 0x10, False)}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_storage_record_torch_cannot_read_is_refused(tmp_path, case) -> None:
    """gdskit never hands back a record's raw bytes, or memory nothing was read into, as data."""
    field, value, torch_refuses_it = UNREADABLE[case]
    plain = tmp_path / "plain.pt"
    torch.save({"a": torch.arange(100.0), "big": torch.arange(400_000.0)}, plain)
    data = bytearray(plain.read_bytes())
    for ending in (b"/data/0", b"/data/1"):
        at = _central_entry_of(bytes(data), ending)
        offset, width = {"method": (10, 2), "flags": (8, 2), "external": (38, 4)}[field]
        data[at + offset:at + offset + width] = value.to_bytes(width, "little")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(data))
    assert torch_refuses(bad) is torch_refuses_it
    for ml in MAP_LOCATIONS:
        with pytest.raises(FormatError):
            gt.load(bad, map_location=ml)


@pytest.mark.parametrize("record", [b"/.data/serialization_id", b"/byteorder", b"/data.pkl"])
def test_small_record_marked_as_a_directory_is_refused(tmp_path, record) -> None:
    """torch's reader answers such a record with memory it never wrote (torch.load then fails
    or not, by chance): gdskit refuses it every time."""
    plain = tmp_path / "plain.pt"
    torch.save({"a": torch.arange(10.0)}, plain)
    data = bytearray(plain.read_bytes())
    at = _central_entry_of(bytes(data), record)
    data[at + 38:at + 42] = (0x10).to_bytes(4, "little")
    bad = tmp_path / "dir.pt"
    bad.write_bytes(bytes(data))
    for _ in range(3):
        with pytest.raises(FormatError):
            gt.load(bad)


@pytest.mark.parametrize("order", [b"\xff\xfe", b"middle"])
def test_unknown_byteorder_record_is_a_format_error(tmp_path, order) -> None:
    plain = tmp_path / "plain.pt"
    torch.save({"a": torch.ones(3)}, plain)
    bad = rewrite_zip(plain, tmp_path / "order.pt", replace={"/byteorder": order})
    assert torch_refuses(bad)
    with pytest.raises(FormatError):
        gt.load(bad)


def _local_header_of(data: bytes, ending: bytes) -> int:
    with zipfile.ZipFile(__import__("io").BytesIO(data)) as zf:
        for info in zf.infolist():
            if info.filename.encode().endswith(ending):
                return info.header_offset
    raise AssertionError(ending)


@pytest.mark.parametrize("record", [b"/data.pkl", b"/data/0", b"/data/1"])
@pytest.mark.parametrize("map_location", MAP_LOCATIONS, ids=MAP_IDS)
def test_damaged_local_header_is_a_format_error(tmp_path, record, map_location) -> None:
    """torch's zip reader refuses the record (a RuntimeError); torch.load refuses the file."""
    plain = tmp_path / "plain.pt"
    torch.save({"a": torch.arange(10.0), "big": torch.ones(400_000)}, plain)
    data = bytearray(plain.read_bytes())
    at = _local_header_of(bytes(data), record)
    data[at:at + 4] = b"PK\x00\x00"
    bad = tmp_path / "header.pt"
    bad.write_bytes(bytes(data))
    assert torch_refuses(bad)
    before = fd_count()
    with pytest.raises(FormatError):
        gt.load(bad, map_location=map_location)
    assert fd_count() == before


def test_errors_leave_no_file_open_while_the_exception_lives(tmp_path) -> None:
    """The archive is closed when the error is raised, not when its traceback is collected."""
    path = write_view(tmp_path / "v.pt", *PAST_THE_END["one element past"])
    before = fd_count()
    try:
        gt.load(path)
    except FormatError as exc:
        kept = exc  # the traceback, and every frame of the load, stay alive
        assert fd_count() == before
        del kept


# -- on the GPU ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("map_location", ["cuda:0", {"cpu": "cuda:0"}], ids=["read-ahead", "lazy"])
def test_gpu_view_past_its_storage_is_refused(tmp_path, map_location) -> None:
    for case in ("one element past", "large storage, one element past", "large storage, far past"):
        path = write_view(tmp_path / "v.pt", *PAST_THE_END[case])
        with pytest.raises(FormatError):
            gt.load(path, map_location=map_location)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("map_location", ["cuda:0", {"cpu": "cuda:0"}], ids=["read-ahead", "lazy"])
def test_gpu_storages_cannot_grow_and_load_as_torch_loads_them(tmp_path, map_location) -> None:
    sd = {"small": torch.arange(10.0), "large": torch.arange(400_000.0), "zeros": torch.zeros(5000)}
    sd["view"] = sd["large"][5:15]
    plain = tmp_path / "plain.pt"
    torch.save(sd, plain)
    deflated = rewrite_zip(plain, tmp_path / "deflated.pt", compress=("/data/2",))
    for path in (plain, deflated):
        out = gt.load(path, map_location=map_location)
        torch.cuda.synchronize()
        ref = torch.load(path, map_location="cpu", weights_only=True)
        for k, t in out.items():
            assert t.device.type == "cuda" and not t.untyped_storage().resizable()
            assert torch.equal(t.cpu(), ref[k]) and t.stride() == ref[k].stride()
        assert out["view"].untyped_storage().data_ptr() == out["large"].untyped_storage().data_ptr()


# -- mutation fuzz -----------------------------------------------------------------------

#: Mutated files judged in CI; set GDSKIT_TORCH_FUZZ_CASES for a longer run.
FUZZ_CASES = int(os.environ.get("GDSKIT_TORCH_FUZZ_CASES", "2000"))
FUZZ_SEED = int(os.environ.get("GDSKIT_TORCH_FUZZ_SEED", "20261201"))
#: A worker that takes this long over a batch has hung on some case (a case takes milliseconds).
BATCH_TIMEOUT_S = 300
CASE_TIMEOUT_S = 60


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = child_pythonpath(HERE)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run_batch(workdir: Path, cases: list[tuple[str, int]], timeout: float,
               mode: str = "load") -> tuple[list[dict], str]:
    """Judge ``cases`` in one worker; the rows it reported and, if it did not finish, why."""
    proc = subprocess.Popen([sys.executable, str(HERE / "torch_fuzz.py"), str(workdir), mode], env=_worker_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate("".join(json.dumps(c) + "\n" for c in cases), timeout=timeout)
        ended = f"exit status {proc.returncode}" if proc.returncode else ""
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        ended = f"hung (no answer within {timeout:.0f} s)"
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if proc.returncode and proc.returncode < 0 and not ended.startswith("hung"):
        ended = f"killed by signal {-proc.returncode}"
    return rows, (ended + ": " + err[-2000:]) if ended else ""


def judge_all(workdir: Path, cases: list[tuple[str, int]], mode: str = "load") -> list[dict]:
    """Every case's verdict (``mode``: as tests/api/torch_fuzz.py takes it); a worker that dies or
    hangs has its current case judged again alone (a crash or hang there is that case's
    verdict) and the rest go to a new worker."""
    verdicts: list[dict] = []
    todo = list(cases)
    while todo:
        rows, ended = _run_batch(workdir, todo, BATCH_TIMEOUT_S, mode)
        for row in rows:
            verdicts.append({**row, "case": todo[row["case"]]})
        todo = todo[len(rows):]
        if not ended:
            assert not todo
            break
        suspect, todo = todo[0], todo[1:]
        alone, why = _run_batch(workdir, [suspect], CASE_TIMEOUT_S, mode)
        if alone:
            verdicts.append({**alone[0], "case": suspect})
        else:
            verdicts.append({"case": suspect, "verdict": "crash-or-hang", "detail": why})
    return verdicts


def test_mutated_checkpoints_never_crash_and_never_disagree_with_torch(tmp_path) -> None:
    import random

    import torch_fuzz
    torch_fuzz.make_bases(tmp_path)
    rng = random.Random(FUZZ_SEED)
    cases = [(torch_fuzz.BASES[i % len(torch_fuzz.BASES)], rng.randrange(1 << 30)) for i in range(FUZZ_CASES)]
    halves = [cases[0::2], cases[1::2]]  # two workers: the CI machine has two cores
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        verdicts = [v for part in pool.map(lambda c: judge_all(tmp_path, c), halves) for v in part]
    assert len(verdicts) == len(cases)
    bad = [v for v in verdicts if v["verdict"] != "ok"]
    assert not bad, "\n".join(json.dumps(v) for v in bad[:20])
    # The mutations exercise both outcomes: refusals, and loads compared value for value.
    outcomes = collections.Counter(v["detail"] for v in verdicts)
    assert outcomes["refused"] > 0 and outcomes["accepted"] > 0


def test_fuzz_harness_reports_a_crash(tmp_path, monkeypatch) -> None:
    """The harness itself: a worker killed by a signal is noticed, and its case named."""
    import torch_fuzz
    torch_fuzz.make_bases(tmp_path)
    monkeypatch.setenv("GDSKIT_TORCH_FUZZ_CRASH_ON", "state_dict:5")
    verdicts = judge_all(tmp_path, [("state_dict", 5), ("state_dict", 4)])
    by_case = {tuple(v["case"]): v["verdict"] for v in verdicts}
    assert by_case == {("state_dict", 5): "crash-or-hang", ("state_dict", 4): "ok"}
