"""gdskit.safetensors as a drop-in for safetensors.torch and safetensors.safe_open, checked against
the reference library itself: signatures and defaults, the built-in class of every refusal, bytes
written and read both ways, and slices. The one difference allowed is the aligned layout of
files save_file writes (docs/checkpoints.md lists every difference)."""

from __future__ import annotations

import inspect
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
import safetensors  # noqa: E402

import gdskit  # noqa: E402
import gdskit.safetensors as gs  # noqa: E402
from gdskit.errors import ClosedFileError, GdskitError  # noqa: E402

SafetensorError = safetensors.SafetensorError


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, device type and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return a.detach().cpu().contiguous().view(-1).view(torch.uint8).tolist() == \
        b.detach().cpu().contiguous().view(-1).view(torch.uint8).tolist()


# -- signatures and defaults --------------------------------------------------------------

@pytest.mark.parametrize("name", ["load_file", "save_file", "load", "save", "save_model", "load_model"])
def test_every_parameter_of_the_reference_is_there_with_its_default(name: str) -> None:
    ours = inspect.signature(getattr(gs, name)).parameters
    for p in inspect.signature(getattr(st_torch, name)).parameters.values():
        mine = list(ours).index(p.name) if p.name in ours else None
        assert mine is not None, p.name
        assert ours[p.name].kind == p.kind, p.name
        assert ours[p.name].default == p.default, p.name
    positional = [p.name for p in inspect.signature(getattr(st_torch, name)).parameters.values()
                  if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [n for n in ours if ours[n].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD] == positional


def test_load_file_and_safe_open_default_to_the_cpu(tmp_path) -> None:
    path = str(tmp_path / "a.safetensors")
    st_torch.save_file({"a": torch.arange(6.0)}, path)
    got = gs.load_file(path)
    assert got["a"].device == torch.device("cpu") and same(got["a"], st_torch.load_file(path)["a"])
    with gs.safe_open(path, framework="pt") as f:
        assert f.get_tensor("a").device == torch.device("cpu")


# -- refusals: the reference's built-in exception class, as a GdskitError -------------------

def _shared() -> dict:
    base = torch.zeros(6)
    return {"a": base, "b": base[2:]}


REFUSED = {
    "not a dict": lambda: ["a"],
    "not a tensor": lambda: {"a": {"some": "thing"}},
    "sparse": lambda: {"a": torch.zeros(3).to_sparse()},
    "meta": lambda: {"a": torch.zeros(2, device="meta")},
    "overlapping": _shared,
    "non-contiguous": lambda: {"a": torch.zeros(3, 4).t()},
    "expanded": lambda: {"a": torch.zeros(1).expand(4)},
    "complex128": lambda: {"a": torch.zeros(2, dtype=torch.complex128)},
    "name not a str": lambda: {1: torch.zeros(2)},
}
BAD_METADATA = {"value not a str": {"k": 1}, "not a dict": [("k", "v")]}


def _reference_refusal(fn) -> BaseException:
    with pytest.raises(Exception) as info:  # noqa: PT011 - the class is what is compared
        fn()
    return info.value


def _same_builtin(ours: BaseException, ref: BaseException) -> None:
    assert isinstance(ours, GdskitError), repr(ours)
    assert isinstance(ours, type(ref)), (repr(ours), repr(ref))


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_save_refuses_what_the_reference_refuses_with_its_exception_class(tmp_path, case: str) -> None:
    ref = _reference_refusal(lambda: st_torch.save(REFUSED[case]()))
    with pytest.raises(GdskitError) as info:
        gs.save(REFUSED[case]())
    _same_builtin(info.value, ref)
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(GdskitError) as info:
        gs.save_file(REFUSED[case](), path)
    _same_builtin(info.value, ref)
    assert path.read_bytes() == b"old"


@pytest.mark.parametrize("case", sorted(BAD_METADATA))
def test_bad_metadata_is_refused_with_the_reference_exception_class(tmp_path, case: str) -> None:
    tensors = {"a": torch.zeros(2)}
    ref = _reference_refusal(lambda: st_torch.save(tensors, metadata=BAD_METADATA[case]))
    for save in (lambda: gs.save(tensors, metadata=BAD_METADATA[case]),
                 lambda: gs.save_file(tensors, tmp_path / "x.safetensors", metadata=BAD_METADATA[case])):
        with pytest.raises(GdskitError) as info:
            save()
        _same_builtin(info.value, ref)


def test_disjoint_views_of_one_storage_are_saved_as_the_reference_saves_them(tmp_path) -> None:
    base = torch.arange(10.0)
    tensors = {"head": base[:4], "tail": base[4:]}
    assert gs.save(tensors) == st_torch.save(tensors)


def test_load_refuses_what_is_not_bytes_with_the_reference_exception_class() -> None:
    data = st_torch.save({"a": torch.zeros(2)})
    for odd in (bytearray(data), memoryview(data), "text"):
        ref = _reference_refusal(lambda: st_torch.load(odd))
        with pytest.raises(GdskitError) as info:
            gs.load(odd)
        _same_builtin(info.value, ref)


def test_load_file_of_a_missing_file_is_a_file_not_found_error(tmp_path) -> None:
    ref = _reference_refusal(lambda: st_torch.load_file(str(tmp_path / "gone.safetensors")))
    for load in (lambda: gs.load_file(tmp_path / "gone.safetensors"),
                 lambda: gs.safe_open(tmp_path / "gone.safetensors", framework="pt")):
        with pytest.raises(GdskitError) as info:
            load()
        _same_builtin(info.value, ref)


# -- bytes both ways ------------------------------------------------------------------------

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.uint16, torch.uint32, torch.uint64]


@st.composite
def _tensor_dicts(draw) -> tuple[dict, dict | None]:
    text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)  # no lone surrogates: no UTF-8 form
    names = draw(st.lists(text.filter(lambda n: n != "__metadata__"), max_size=6, unique=True))
    tensors = {}
    for n in names:
        dt = draw(st.sampled_from(_DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        raw = torch.randint(0, 256, (max(1, int(torch.tensor(shape).prod())) * torch.empty(0, dtype=dt).element_size(),),
                            dtype=torch.uint8)
        tensors[n] = raw.view(dt)[:int(torch.tensor(shape).prod()) if shape else 1].reshape(shape)
    metadata = draw(st.none() | st.dictionaries(text, text, max_size=3))
    return tensors, metadata


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(case=_tensor_dicts())
def test_hypothesis_save_writes_the_reference_bytes_and_both_read_each_other(tmp_path_factory, case) -> None:
    tensors, metadata = case
    data = gs.save(tensors, metadata)
    ref = st_torch.save(tensors, metadata)
    if metadata is not None and len(metadata) > 1:  # the reference writes metadata in hash order
        def data_section(raw: bytes) -> bytes:
            return raw[8 + int.from_bytes(raw[:8], "little"):]

        assert len(data) == len(ref) and data_section(data) == data_section(ref)
    elif tensors or metadata != {}:  # no tensors and an empty metadata: the reference writes broken JSON
        assert data == ref
    for name, t in gs.load(data).items():
        assert same(t, tensors[name]), name
    path = tmp_path_factory.mktemp("rt") / "g.safetensors"
    gs.save_file(tensors, path, metadata)
    ref = st_torch.load_file(str(path))                            # the reference reads gdskit's file
    assert set(ref) == set(tensors) and all(same(ref[k], tensors[k]) for k in tensors)
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata() == metadata
    if not tensors and metadata == {}:
        return
    path.write_bytes(st_torch.save(tensors, metadata))              # gdskit reads the reference's
    got = gs.load_file(path)
    assert set(got) == set(tensors) and all(same(got[k], tensors[k]) for k in tensors)


# -- safe_open and slices ------------------------------------------------------------------

INDICES = [(), 1, -1, slice(0, 1), (slice(None), 1), (Ellipsis, 1), (1, Ellipsis), slice(None, None, 2),
           None, slice(0, 10), slice(-5, None), slice(2, 1), (1, 2, 3), (slice(None), slice(None), slice(None, -1)),
           (0, Ellipsis, 1), (Ellipsis, Ellipsis), [0, 1], torch.tensor(1), True, (slice(1, 3), slice(None, None, 3)),
           (0, slice(1, 2), slice(1, 3)), 5, -3, (1, 2, 3, 0), slice(None, None, -1), "a", 1.5]


@pytest.fixture()
def sliced(tmp_path):
    path = str(tmp_path / "s.safetensors")
    st_torch.save_file({"t": torch.arange(24.0).reshape(2, 3, 4), "s": torch.tensor(5.0),
                        "b": torch.arange(60, dtype=torch.bfloat16).reshape(3, 4, 5), "e": torch.zeros(0, 3),
                        "z": torch.arange(4, dtype=torch.uint8)}, path, metadata={"k": "v"})
    return path


@pytest.mark.parametrize("index", INDICES, ids=repr)
@pytest.mark.parametrize("name", ["t", "b", "s", "e"])
def test_slices_are_what_the_reference_slices_give_or_refused_alike(sliced, name: str, index) -> None:
    with safetensors.safe_open(sliced, "pt") as ref_file:
        try:
            want: object = ref_file.get_slice(name)[index]
        except Exception as exc:  # noqa: BLE001 - the class is what is compared
            want = exc
    with gs.safe_open(sliced, framework="pt") as f:
        part = f.get_slice(name)
        assert part.get_shape() == list(st_torch.load_file(sliced)[name].shape)
        if isinstance(want, BaseException):
            with pytest.raises(GdskitError) as info:
                part[index]
            _same_builtin(info.value, want)
        else:
            got = part[index]
            assert same(got, want) and got.is_contiguous()
            assert got.untyped_storage().nbytes() == got.nbytes  # its own memory, not a view on more


def test_safe_open_answers_as_the_reference_does(sliced) -> None:
    with safetensors.safe_open(sliced, "pt") as ref, gs.safe_open(sliced, framework="pt") as f:
        assert f.keys() == ref.keys()
        assert f.offset_keys() == ref.offset_keys()
        assert f.metadata() == ref.metadata()
        for name in ref.keys():
            assert f.get_slice(name).get_dtype() == ref.get_slice(name).get_dtype()
            assert f.get_slice(name).get_shape() == ref.get_slice(name).get_shape()
            assert same(f.get_tensor(name), ref.get_tensor(name))
        with pytest.raises(gs.MissingTensorError):
            f.get_tensor("nope")
        with pytest.raises(TypeError):
            f.get_tensor(1)
    with pytest.raises(ClosedFileError):
        f.keys()
    with pytest.raises(GdskitError):
        gs.safe_open(sliced, framework="tf")


def test_a_slice_reads_only_its_rows(tmp_path) -> None:
    path = tmp_path / "big.safetensors"
    big = torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024)
    st_torch.save_file({"w": big}, str(path))
    with gs.safe_open(path, framework="pt") as f:
        before = gdskit.stats()
        part = f.get_slice("w")[10:12, 100:200]
        read = gdskit.stats_delta(before, gdskit.stats()).bytes_read
    assert torch.equal(part, big[10:12, 100:200])
    assert read == 2 * 100 * 4


# -- whole models --------------------------------------------------------------------------

class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = self.a


def test_save_model_and_load_model_pair_with_the_reference(tmp_path) -> None:
    model = _Tied()
    ours, theirs = str(tmp_path / "g.safetensors"), str(tmp_path / "r.safetensors")
    gs.save_model(model, ours)
    st_torch.save_model(model, theirs)
    with gs.safe_open(ours, framework="pt") as f, safetensors.safe_open(theirs, "pt") as r:
        assert f.metadata() == r.metadata() and f.keys() == r.keys()
    for load, path in ((gs.load_model, theirs), (st_torch.load_model, ours)):
        other = _Tied()
        assert load(other, path) == st_torch.load_model(_Tied(), theirs)
        for k, v in other.state_dict().items():
            assert torch.equal(v, model.state_dict()[k])


def test_load_model_refuses_a_file_that_does_not_fit_as_the_reference(tmp_path) -> None:
    path = str(tmp_path / "m.safetensors")
    st_torch.save_file({"a.weight": torch.zeros(8, 8)}, path)
    ref = _reference_refusal(lambda: st_torch.load_model(_Tied(), path))
    with pytest.raises(GdskitError) as info:
        gs.load_model(_Tied(), path)
    _same_builtin(info.value, ref)
    assert gs.load_model(_Tied(), path, strict=False) == st_torch.load_model(_Tied(), path, strict=False)
