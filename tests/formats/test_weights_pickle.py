"""The C-speed weights-only unpickler (gdskit.formats.weights_pickle) and how gdskit.torch uses it."""

from __future__ import annotations

import collections
import io
import pickle
import pickletools
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import gdskit.torch as gt  # noqa: E402
from gdskit.errors import FormatError, GdskitError  # noqa: E402
from gdskit.formats import weights_pickle  # noqa: E402
import test_weights_pickle_differential as d  # noqa: E402
from torch_checkpoints import checkpoint, same  # noqa: E402
from test_weights_pickle_differential import Snapshot, same_value  # noqa: E402

pytestmark = pytest.mark.torch

CALLED: list[str] = []


def record_call(*args):
    """A global no checkpoint may call: it records that it ran."""
    CALLED.append("called")
    return 0


class Boom:
    def __reduce__(self):
        return (record_call, ("payload",))


@pytest.fixture
def count_torch_unpickler(monkeypatch):
    """How many times torch's own weights-only unpickler was asked to load."""
    from torch import _weights_only_unpickler as wo

    calls = []

    class Counting(wo.Unpickler):
        def load(self):
            calls.append(1)
            return super().load()

    monkeypatch.setattr(wo, "Unpickler", Counting)
    return calls


def _storage_loader():
    """persistent_load for pickles made by _dumps: ids are ("storage", type, key, "cpu", numel)."""
    made = {}

    def load(pid):
        _tag, storage_type, key, _loc, numel = pid
        if not 0 <= numel <= 1 << 16:
            raise ValueError("a damaged size")
        if key not in made:
            nbytes = numel * torch._utils._element_size(storage_type.dtype)
            made[key] = torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(nbytes),
                                                   dtype=storage_type.dtype, _internal=True)
        return made[key]
    return load


def _dumps(obj, protocol=2) -> bytes:
    """A pickle as torch.save writes its data.pkl (storages as persistent ids)."""
    buf = io.BytesIO()

    class P(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, torch.storage.TypedStorage):
                st_type = getattr(torch, o._pickle_storage_type())
                return ("storage", st_type, str(id(o._untyped_storage)), "cpu", o._size())
            return None
    P(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


# -- through gdskit.torch.load -----------------------------------------------------

def test_plain_checkpoint_loads_without_torchs_unpickler(tmp_path, count_torch_unpickler) -> None:
    sd = checkpoint()
    path = tmp_path / "c.pt"
    gt.save(sd, path)
    out = gt.load(path)
    assert same(out, sd) and same(out, torch.load(path, weights_only=True))
    assert out["w_t"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    assert isinstance(out["param"], torch.nn.Parameter)
    assert count_torch_unpickler == [1], "torch.load above ran torch's unpickler once; gdskit.torch none"


def test_state_dict_metadata_survives(tmp_path, count_torch_unpickler) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    sd = model.state_dict()
    path = tmp_path / "m.pt"
    torch.save(sd, path)
    out = gt.load(path)
    assert out._metadata == sd._metadata and same(dict(out), dict(sd))
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    fresh.load_state_dict(out)
    assert not count_torch_unpickler


def test_other_allowed_objects_go_to_torchs_unpickler(tmp_path, count_torch_unpickler) -> None:
    obj = {"dev": torch.device("cpu"), "tags": {"a", "b"}, "t": torch.arange(4)}
    path = tmp_path / "o.pt"
    torch.save(obj, path)
    out = gt.load(path)
    assert out["dev"] == obj["dev"] and out["tags"] == obj["tags"] and torch.equal(out["t"], obj["t"])
    assert len(count_torch_unpickler) == 1


def test_user_allowed_globals_are_honoured(tmp_path) -> None:
    path = tmp_path / "u.pt"
    torch.save({"obj": collections.Counter("aab"), "p": Point(1, 2)}, path)
    with pytest.raises(gt.UnsafeCheckpointError):
        gt.load(path)
    with torch.serialization.safe_globals([Point]):
        out = gt.load(path)
    assert out["p"] == Point(1, 2) and out["obj"] == collections.Counter("aab")


class Point:
    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def __eq__(self, other) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)


def test_refused_checkpoint_calls_nothing(tmp_path) -> None:
    CALLED.clear()
    path = tmp_path / "b.pt"
    torch.save({"t": torch.ones(3), "boom": Boom()}, path)
    with pytest.raises(gt.UnsafeCheckpointError):
        gt.load(path)
    assert CALLED == []


class BadTensor:
    """Pickles as a call of an allowed rebuild function with values that do not fit it."""

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, (123, 0, (2,), (1,), False, collections.OrderedDict()))


def test_damaged_pickle_is_a_format_error(tmp_path) -> None:
    path = tmp_path / "d.pt"
    torch.save({"t": BadTensor()}, path)
    with pytest.raises(AttributeError):
        torch.load(path, weights_only=True)  # what torch itself raises
    with pytest.raises(FormatError):
        gt.load(path)


# -- the unpickler itself ------------------------------------------------------------

@pytest.fixture
def untouched():
    """Fails the test if it changed anything torch's rebuild functions, storage classes or the
    fast unpickler's globals hold, and puts it back (the pickles here are hostile)."""
    snap = Snapshot()
    yield
    assert snap.restore() == []


def torch_unpickle(data: bytes, persistent_load):
    """What torch's own weights-only unpickler makes of ``data``."""
    from torch import _weights_only_unpickler as wo

    up = wo.Unpickler(io.BytesIO(data), encoding="utf-8")
    up.persistent_load = persistent_load
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return up.load()


def test_unknown_global_stops_before_it_is_called(untouched) -> None:
    CALLED.clear()
    with pytest.raises(weights_pickle.NotPlain):
        weights_pickle.load(pickle.dumps(Boom(), protocol=2), _storage_loader())
    assert CALLED == []


def test_plain_values_as_torchs_unpickler_builds_them() -> None:
    g = torch.Generator().manual_seed(3)
    obj = collections.OrderedDict(w=torch.randn(3, 4, generator=g), n=None, f=1.5, s="x" * 300, b=True,
                                  i=[1, -70000, 2**70], t=(torch.arange(5)[1:],), size=torch.Size([2]),
                                  d=torch.int8, c=torch.randn(2, dtype=torch.complex64).conj())
    obj._metadata = {"": {"version": 1}}
    data = _dumps(obj)
    loader = _storage_loader()
    out = weights_pickle.load(data, loader)
    assert same_value(out, torch_unpickle(data, loader)) and out._metadata == obj._metadata
    assert out["t"][0].storage_offset() == 1 and out["c"].is_conj()


@pytest.mark.parametrize("protocol", [0, 1, 3, 4, 5])
def test_other_protocols_are_not_plain(protocol) -> None:
    """torch's unpickler reads protocol 2 (it refuses the opcodes of 4 and 5): the fast one
    takes no other."""
    data = _dumps(collections.OrderedDict(w=torch.ones(2), s="x"), protocol)
    with pytest.raises(weights_pickle.NotPlain):
        weights_pickle.load(data, _storage_loader())


def plain_globals() -> list[tuple[str, str]]:
    return sorted(weights_pickle._vocabulary().plain)


@pytest.mark.parametrize("module,name", plain_globals())
@pytest.mark.parametrize("state", ["setattr", "dict", "none"])
def test_build_on_a_global_is_not_plain(module, name, state, untouched) -> None:
    """The C unpickler would set attributes of the global itself (torch refuses BUILD on it)."""
    attrs = d.dct((d.s("__defaults__"), d.negating_defaults()), (d.s("nbytes"), d.g("torch", "Size")),
                  (d.s("_dtype"), d.g("torch", "float64")))
    body = {"setattr": d.tup(d.NONE, attrs), "dict": attrs, "none": d.NONE}[state]
    data = d.pkl(d.dct((d.s("t"), d.tensor()), (d.s("x"), d.g(module, name) + body + d.BUILD)))
    with pytest.raises(weights_pickle.NotPlain):
        weights_pickle.load(data, _storage_loader())


HOSTILE_BODIES = {
    "setitem_list": d.lst(d.i(1)) + d.i(0) + d.i(7) + d.SETITEM,
    "setitems_tensor": d.tensor() + d.MARK + d.i(0) + d.f(9.0) + d.SETITEMS,
    "setitem_storage": d.pid() + d.i(0) + d.f(9.0) + d.SETITEM,
    "append_dict": d.dct() + d.i(1) + d.APPEND,
    "appends_ordered_dict": d.od() + d.MARK + d.i(1) + d.APPENDS,
    "build_list": d.lst() + d.NONE + d.BUILD,
    "build_tensor": d.tensor() + d.tup(d.pid(), d.i(0), d.tup(d.i(2)), d.tup(d.i(1))) + d.BUILD,
    "build_ordered_dict_slots": d.od() + d.setattr_state(a=d.i(1)) + d.BUILD,
    "build_ordered_dict_none": d.od() + d.NONE + d.BUILD,
    "build_global_from_memo": d.REBUILD_V2 + d.put(0) + d.dct() + d.get(0) + d.dct() + d.BUILD,
    "inst": d.MARK + b"icollections\nOrderedDict\n",
    "obj": d.MARK + d.g("collections", "OrderedDict") + d.OBJ,
    "newobj": d.g("collections", "OrderedDict") + d.tup() + d.NEWOBJ,
    "newobj_ex": d.g("collections", "OrderedDict") + d.tup() + d.dct() + d.NEWOBJ_EX,
    "ext1": b"\x82\x01",
    "stack_global": d.s("collections") + d.s("OrderedDict") + b"\x93",
    "persid": b"P0\n",
    "pid_not_a_storage": d.tup(d.s("module"), d.i(1), d.s("0"), d.s("cpu"), d.i(4)) + d.BINPERSID,
    "pid_int": d.i(3) + d.BINPERSID,
    "dup": d.dct() + d.DUP,
    "pop": d.dct() + d.i(1) + d.POP,
    "memoize": d.dct() + b"\x94",
    "short_binstring": b"U\x01a",
    "binbytes": b"B\x01\x00\x00\x00a",
    "marker_named_by_the_file": d.od() + d.dct() + d.g("gdskit.formats.weights_pickle", "BUILD") + d.TUPLE3
    + d.BINPERSID,
    "reduce_not_allowed": d.g("builtins", "print") + d.tup(d.s("x")) + d.REDUCE,
    "reduce_list_args": d.g("collections", "OrderedDict") + d.lst() + d.REDUCE,
}


@pytest.mark.parametrize("name", sorted(HOSTILE_BODIES))
def test_hostile_pickles_are_not_plain(name, untouched) -> None:
    with pytest.raises(weights_pickle.NotPlain):
        weights_pickle.load(d.pkl(HOSTILE_BODIES[name]), _storage_loader())


def test_a_huge_memo_index_allocates_nothing() -> None:
    """The C unpickler sizes its memo by the largest index a PUT names: the scan bounds it by
    the pickle's size (torch's unpickler, a dict, takes any)."""
    import tracemalloc

    data = d.pkl(d.lst() + d.put(0xf00000) + d.dct((d.s("a"), d.get(0xf00000))))
    assert torch_unpickle(data, _storage_loader())["a"] == []
    tracemalloc.start()
    try:
        with pytest.raises(weights_pickle.NotPlain):
            weights_pickle.load(data, _storage_loader())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes"


def test_memo_indices_as_large_as_a_real_pickle_needs() -> None:
    names = [f"n{k}" for k in range(70000)]  # 70,000 memo entries: LONG_BINPUT up to 0x011170
    data = _dumps({"names": names, "t": torch.ones(2)})
    assert b"r\x00\x00\x01\x00" in data
    assert weights_pickle.load(data, _storage_loader())["names"] == names


def test_objects_outside_the_vocabulary_are_not_built() -> None:
    # BUILD on a list: torch refuses it, and so the pickle goes to torch's unpickler.
    data = b"\x80\x02]}X\x01\x00\x00\x00aK\x01sb."
    pickletools.dis(data, out=io.StringIO())  # a well-formed pickle
    with pytest.raises(weights_pickle.NotPlain):
        weights_pickle.load(data, _storage_loader())


def test_gdskit_errors_from_persistent_load_pass_through() -> None:
    def refuse(pid):
        raise FormatError("record missing")
    with pytest.raises(FormatError):
        weights_pickle.load(_dumps({"t": torch.ones(2)}), refuse)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_damaged_pickles_fail_cleanly(data) -> None:
    """Any byte of a plain pickle changed, or the pickle cut short: a value, NotPlain or a gdskit error."""
    CALLED.clear()
    good = bytearray(_dumps({"w": torch.ones(4), "n": [1, 2], "s": "x"}))
    if data.draw(st.booleans()):
        good = good[:data.draw(st.integers(0, len(good) - 1))]
    else:
        i = data.draw(st.integers(0, len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    try:
        weights_pickle.load(bytes(good), _storage_loader())
    except (weights_pickle.NotPlain, GdskitError):
        pass
    assert CALLED == []


VALUES = [d.EMPTY_TUPLE, d.EMPTY_LIST, d.EMPTY_DICT, d.NONE, d.TRUE, d.FALSE, d.i(1), d.i(300), d.i(-5),
          d.i(1 << 40), d.f(2.5), d.s("a"), d.s("_metadata"), d.s("__setstate__"), d.s("__defaults__"),
          d.s("nbytes"), d.s("storage"), d.s("0"), d.s("cpu"), d.pid(), d.tensor(), d.od(),
          d.get(0), d.get(1), b"j\x02\x00\x00\x00", d.g("builtins", "print")]
STATES = [d.dct((d.s("a"), d.i(1))), d.dct((d.s("__setstate__"), d.g("torch", "Size"))),
          d.setattr_state(__defaults__=d.negating_defaults()), d.setattr_state(nbytes=d.g("torch", "Size")),
          d.dct((d.s("_dtype"), d.g("torch", "float64"))), d.tup(d.pid(), d.i(0), d.tup(d.i(2)), d.tup(d.i(1)))]
OPS = [d.BUILD, d.BUILD, d.SETITEM, d.SETITEMS, d.APPEND, d.APPENDS, d.REDUCE, d.BINPERSID, d.MARK, d.TUPLE,
       d.TUPLE1, d.TUPLE2, d.TUPLE3, d.put(0), d.put(1), b"r\x02\x00\x00\x00",
       d.g("gdskit.formats.weights_pickle", "BUILD") + d.TUPLE3 + d.BINPERSID]
GLOBALS = st.sampled_from([d.g(m, n) for m, n in plain_globals()])
TARGETS = st.one_of(GLOBALS, st.sampled_from(VALUES), GLOBALS.map(lambda glob: glob + d.put(0) + d.get(0)))
PIECES = st.one_of(
    st.sampled_from(VALUES), st.sampled_from(STATES), st.sampled_from(OPS), GLOBALS,
    st.tuples(TARGETS, st.sampled_from(STATES + VALUES)).map(lambda ts: ts[0] + ts[1] + d.BUILD),
    st.tuples(TARGETS, st.sampled_from(VALUES), st.sampled_from(VALUES)).map(
        lambda tkv: tkv[0] + tkv[1] + tkv[2] + d.SETITEM),
    st.tuples(TARGETS, st.sampled_from(VALUES)).map(lambda ti: ti[0] + ti[1] + d.APPEND),
    st.binary(min_size=1, max_size=2))


@settings(max_examples=400, deadline=None)
@given(st.lists(PIECES, max_size=30))
def test_random_opcode_sequences(pieces) -> None:
    """Whatever the opcodes: a value torch's unpickler also builds, NotPlain, or a gdskit error;
    and nothing changed in torch (a BUILD on a global never gets through)."""
    data = d.PROTO2 + b"".join(pieces) + d.STOP
    loader = _storage_loader()
    snap = Snapshot()
    try:
        out = weights_pickle.load(data, loader)
    except (weights_pickle.NotPlain, GdskitError):
        out = NotImplemented
    finally:
        changed = snap.restore()
    assert changed == []
    if out is not NotImplemented:
        assert same_value(out, torch_unpickle(data, loader))


def test_a_torch_without_the_allowed_list_uses_its_own_unpickler(tmp_path, monkeypatch) -> None:
    from torch import _weights_only_unpickler as wo

    weights_pickle._vocabulary.cache_clear()
    monkeypatch.delattr(wo, "_get_allowed_globals")
    try:
        with pytest.raises(weights_pickle.NotPlain):
            weights_pickle.load(_dumps({"t": torch.ones(2)}), _storage_loader())
    finally:
        monkeypatch.undo()
        weights_pickle._vocabulary.cache_clear()
    assert weights_pickle._vocabulary() is not None


def test_only_the_rebuild_functions_and_classes_can_be_called() -> None:
    """REDUCE is left to the C unpickler: it must find nothing to call but the short list's
    callables (those torch allows too), nothing the file can build from them."""
    from torch import _weights_only_unpickler as wo

    plain = weights_pickle._vocabulary().plain
    callables = {f"{m}.{n}" for (m, n), obj in plain.items() if callable(obj)}
    assert callables == {"collections.OrderedDict", "torch.Size", "torch.storage.UntypedStorage",
                         "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
                         "torch._utils._rebuild_parameter"}
    assert all(wo._get_allowed_globals()[f"{m}.{n}"] is obj for (m, n), obj in plain.items())
    parameter = d.g("torch._utils", "_rebuild_parameter") + d.tup(d.tensor(), d.TRUE, d.od()) + d.REDUCE
    built = weights_pickle.load(d.pkl(d.lst(d.tensor(), parameter, d.od(),
                                            d.g("torch", "Size") + d.tup(d.tup(d.i(2))) + d.REDUCE, d.pid(),
                                            d.UNTYPED + d.tup(d.i(0)) + d.REDUCE)), _storage_loader())
    assert [type(x).__name__ for x in built] == ["Tensor", "Parameter", "OrderedDict", "Size", "TypedStorage",
                                                 "UntypedStorage"]
    assert not any(callable(x) for x in built)
