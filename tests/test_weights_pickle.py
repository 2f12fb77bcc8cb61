"""The C-speed weights-only unpickler (gdskit.formats.weights_pickle) and how gdskit.torch uses it."""

from __future__ import annotations

import collections
import io
import pickle
import pickletools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import gdskit.torch as gt  # noqa: E402
from gdskit.errors import FormatError, GdskitError  # noqa: E402
from gdskit.formats import weights_pickle  # noqa: E402
from test_torch_ckpt import checkpoint, same  # noqa: E402

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
    with pytest.raises(FormatError, match="damaged"):
        gt.load(path)


# -- the unpickler itself ------------------------------------------------------------

def test_unknown_global_stops_before_it_is_called() -> None:
    CALLED.clear()
    with pytest.raises(weights_pickle.NotPlain, match="record_call"):
        weights_pickle.load(pickle.dumps(Boom(), protocol=2), _storage_loader())
    assert CALLED == []


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_plain_values_at_every_protocol(protocol) -> None:
    g = torch.Generator().manual_seed(3)
    obj = collections.OrderedDict(w=torch.randn(3, 4, generator=g), n=None, f=1.5, s="x", b=True,
                                  i=[1, -70000, 2**70], t=(torch.arange(5)[1:],))
    out = weights_pickle.load(_dumps(obj, protocol), _storage_loader())
    assert list(out) == list(obj) and out["i"] == obj["i"] and out["f"] == 1.5 and out["n"] is None
    assert out["w"].shape == (3, 4) and out["t"][0].storage_offset() == 1


def test_objects_outside_the_vocabulary_are_not_built() -> None:
    # BUILD on a list: the C unpickler cannot, and the pickle goes to torch's unpickler.
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


def test_a_torch_without_the_allowed_list_uses_its_own_unpickler(tmp_path, monkeypatch) -> None:
    from torch import _weights_only_unpickler as wo

    weights_pickle._plain_globals.cache_clear()
    monkeypatch.delattr(wo, "_get_allowed_globals")
    try:
        with pytest.raises(weights_pickle.NotPlain):
            weights_pickle.load(_dumps({"t": torch.ones(2)}), _storage_loader())
    finally:
        monkeypatch.undo()
        weights_pickle._plain_globals.cache_clear()
    assert weights_pickle._plain_globals()
