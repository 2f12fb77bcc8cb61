"""gdskit.safetensors.load_into and gdskit.torch.load_into: checkpoints into tensors that already exist.

Values are compared with safetensors.torch.load_file and torch.load; key reports with
Module.load_state_dict. GPU variants are marked.
"""

from __future__ import annotations

import copy
import os
import struct

import pytest

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
from hypothesis import given, settings, strategies as st  # noqa: E402

import gdskit.safetensors as gs  # noqa: E402
import gdskit.torch as gt  # noqa: E402
from gdskit.errors import FormatError, GdskitError  # noqa: E402
from gdskit.formats import into_plan as ip  # noqa: E402
from gdskit.formats.safetensors_format import TruncatedFileError  # noqa: E402
from leak_helpers import fd_count  # noqa: E402

pytestmark = pytest.mark.torch

MiB = 1 << 20


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and raw_bytes(a) == raw_bytes(b)


class Net(torch.nn.Module):
    """Large and small parameters, a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(640, 512)        # 1.25 MiB weight: read straight into its memory
        self.norm = torch.nn.LayerNorm(512)
        self.small = torch.nn.Linear(512, 7)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)


def random_state(module: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in module.state_dict().items():
        if v.dtype.is_floating_point:
            out[k] = torch.randn(v.shape, generator=g, dtype=v.dtype)
        else:
            out[k] = torch.randint(0, 1000, v.shape, generator=g, dtype=v.dtype)
    return out


def pointers(module: torch.nn.Module) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in module.state_dict().items()}


def snapshot(module: torch.nn.Module) -> dict[str, bytes]:
    return {k: raw_bytes(v) for k, v in module.state_dict().items()}


@pytest.fixture
def net_files(tmp_path):
    sd = random_state(Net())
    st_path = tmp_path / "net.safetensors"
    pt_path = tmp_path / "net.pt"
    st_torch.save_file(sd, str(st_path))
    torch.save(sd, pt_path)
    return st_path, pt_path


# -- in place, exact values ---------------------------------------------------------

@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_module_filled_in_place_with_the_reference_values(net_files, fmt) -> None:
    st_path, pt_path = net_files
    net = Net()
    before = pointers(net)
    if fmt == "safetensors":
        result = gs.load_into(net, st_path)
        ref = st_torch.load_file(str(st_path))
    else:
        result = gt.load_into(net, pt_path)
        ref = torch.load(pt_path, weights_only=True)
    assert result == ([], [])
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert pointers(net) == before
    for k, v in net.state_dict().items():
        assert same(v, ref[k]), k
    assert isinstance(net.big.weight, torch.nn.Parameter) and net.big.weight.requires_grad


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dt in gs._dtype_table(torch).items():
        if name == "F4":
            out[name] = torch.randint(0, 256, (3, 4), dtype=torch.uint8, generator=g).view(dt)
        elif dt == torch.bool:
            out[name] = torch.randint(0, 2, (5, 3), generator=g).bool()
        else:
            nbytes = 7 * 3 * torch.tensor([], dtype=dt).element_size()
            out[name] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dt).reshape(7, 3)
    out["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    out["empty"] = torch.empty(0, 5)
    return out


def test_dict_of_every_dtype_filled_in_place(tmp_path) -> None:
    tensors = every_dtype()
    path = tmp_path / "all.safetensors"
    gs.save_file(tensors, path)
    target = {k: torch.zeros_like(v) if v.dtype.is_floating_point or v.dtype == torch.bool
              else torch.empty_like(v) for k, v in tensors.items()}
    ptrs = {k: v.data_ptr() for k, v in target.items()}
    assert gs.load_into(target, path) == ([], [])
    ref = st_torch.load_file(str(path))
    for k in tensors:
        assert same(target[k], ref[k]), k
        assert target[k].data_ptr() == ptrs[k]


def test_sharded_checkpoint_through_its_index(tmp_path) -> None:
    import json
    net = Net()
    sd = random_state(net, seed=5)
    names = list(sd)
    weight_map = {}
    for i, part in enumerate((names[:3], names[3:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        st_torch.save_file({k: sd[k] for k in part}, str(tmp_path / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert gs.load_into(net, tmp_path) == ([], [])
    for k, v in net.state_dict().items():
        assert same(v, sd[k]), k


# -- key reports ------------------------------------------------------------------

def test_strict_refuses_before_reading_and_lists_the_names(tmp_path) -> None:
    sd = random_state(Net())
    del sd["small.bias"]
    sd["extra.weight"] = torch.ones(2)
    path = tmp_path / "mismatch.safetensors"
    st_torch.save_file(sd, str(path))
    net = Net()
    untouched = snapshot(net)
    with pytest.raises(gs.KeyMismatchError) as info:
        gs.load_into(net, path)
    assert isinstance(info.value, KeyError) and isinstance(info.value, GdskitError)
    assert info.value.missing_keys == ["small.bias"]
    assert info.value.unexpected_keys == ["extra.weight"]
    assert snapshot(net) == untouched


@pytest.mark.parametrize("drop,add", [((), ()), (("norm.weight",), ()), ((), ("other",)),
                                      (("big.weight", "steps"), ("a.b", "c")), (tuple(Net().state_dict()), ("z",))])
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_non_strict_reports_what_load_state_dict_reports(tmp_path, drop, add, fmt) -> None:
    sd = random_state(Net())
    for k in drop:
        del sd[k]
    for k in add:
        sd[k] = torch.arange(3.0)
    path = tmp_path / f"ckpt.{fmt}"
    (st_torch.save_file(sd, str(path)) if fmt == "safetensors" else torch.save(sd, path))
    ours, theirs = Net(), Net()
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    load = gs.load_into if fmt == "safetensors" else gt.load_into
    got = load(ours, path, strict=False)
    want = theirs.load_state_dict(sd, strict=False)
    assert got.missing_keys == list(want.missing_keys)
    assert sorted(got.unexpected_keys) == sorted(want.unexpected_keys)
    for k, v in theirs.state_dict().items():
        assert same(ours.state_dict()[k], v), k


def test_torch_entries_that_are_not_tensors_are_unexpected(tmp_path) -> None:
    sd = random_state(Net())
    sd["epoch"] = 3
    path = tmp_path / "with_epoch.pt"
    torch.save(sd, path)
    with pytest.raises(gs.KeyMismatchError) as info:
        gt.load_into(Net(), path)
    assert info.value.unexpected_keys == ["epoch"]
    net = Net()
    assert gt.load_into(net, path, strict=False) == ([], ["epoch"])
    assert same(net.big.weight, sd["big.weight"])


# -- shapes, dtypes, conversion ------------------------------------------------------

@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_shape_mismatch_refused_before_any_byte_moves(tmp_path, fmt) -> None:
    sd = random_state(Net())
    sd["small.weight"] = torch.randn(7, 511)
    path = tmp_path / f"shape.{fmt}"
    (st_torch.save_file(sd, str(path)) if fmt == "safetensors" else torch.save(sd, path))
    net = Net()
    untouched = snapshot(net)
    with pytest.raises(gs.ShapeMismatchError) as info:
        (gs.load_into if fmt == "safetensors" else gt.load_into)(net, path, strict=False)
    assert isinstance(info.value, ValueError)
    assert snapshot(net) == untouched


def test_dtype_mismatch_refused_unless_cast(net_files) -> None:
    st_path, _ = net_files
    net = Net().double()
    untouched = snapshot(net)
    with pytest.raises(gs.DtypeMismatchError) as info:
        gs.load_into(net, st_path)
    assert isinstance(info.value, TypeError)
    assert snapshot(net) == untouched

    before = pointers(net)
    assert gs.load_into(net, st_path, cast=True) == ([], [])
    assert pointers(net) == before
    ref = st_torch.load_file(str(st_path))
    for k, v in net.state_dict().items():
        assert v.dtype == (torch.float64 if ref[k].dtype.is_floating_point else ref[k].dtype)
        assert torch.equal(v, ref[k].to(v.dtype)), k


def test_cast_to_half_precision_from_torch_file(net_files) -> None:
    _, pt_path = net_files
    net = Net().to(torch.bfloat16)
    gt.load_into(net, pt_path, cast=True)
    ref = torch.load(pt_path, weights_only=True)
    for k, v in net.state_dict().items():
        assert torch.equal(v, ref[k].to(v.dtype)), k


def test_a_conversion_torch_cannot_make_is_refused_first(tmp_path) -> None:
    path = tmp_path / "f4.safetensors"
    f4 = torch.randint(0, 256, (3, 2), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    gs.save_file({"w": f4, "v": torch.ones(5)}, path)
    target = {"w": torch.full((3, 2), 7.0), "v": torch.zeros(5)}
    with pytest.raises(gs.DtypeMismatchError):  # torch has no float4 -> float32 copy
        gs.load_into(target, path, cast=True)
    assert torch.equal(target["w"], torch.full((3, 2), 7.0)) and torch.equal(target["v"], torch.zeros(5))


# -- tied and non-contiguous targets -----------------------------------------------------

class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(600, 512)     # 1.2 MiB: a direct read
        self.head = torch.nn.Linear(512, 600, bias=False)
        self.head.weight = self.embed.weight
        self.bias = torch.nn.Parameter(torch.zeros(600))


def _bytes_read(load, *args, **kw) -> int:
    seen = []
    load(*args, progress=lambda done, total: seen.append(total), **kw)
    return seen[-1] if seen else 0


def test_tied_weights_filled_once_from_a_file_with_one_name(tmp_path) -> None:
    g = torch.Generator().manual_seed(3)
    embed = torch.randn(600, 512, generator=g)
    bias = torch.randn(600, generator=g)
    path = tmp_path / "tied.safetensors"
    st_torch.save_file({"embed.weight": embed, "bias": bias}, str(path))
    model = Tied()
    ptr = model.embed.weight.data_ptr()
    result = gs.load_into(model, path)
    assert result == ([], [])  # head.weight is the same tensor: filled, so not missing
    assert model.head.weight is model.embed.weight and model.embed.weight.data_ptr() == ptr
    assert torch.equal(model.head.weight, embed) and torch.equal(model.bias, bias)
    assert _bytes_read(gs.load_into, Tied(), path) == embed.nbytes + bias.nbytes


def test_tied_weights_filled_once_from_a_torch_file_with_both_names(tmp_path) -> None:
    src = Tied()
    with torch.no_grad():
        src.embed.weight.normal_()
        src.bias.normal_()
    path = tmp_path / "tied.pt"
    torch.save(src.state_dict(), path)  # both names, one storage
    model = Tied()
    assert gt.load_into(model, path) == ([], [])
    assert torch.equal(model.head.weight, src.embed.weight)
    assert model.head.weight is model.embed.weight
    assert _bytes_read(gt.load_into, Tied(), path) == src.embed.weight.nbytes + src.bias.nbytes


def test_untied_target_filled_twice_from_one_tied_torch_storage(tmp_path) -> None:
    src = Tied()
    with torch.no_grad():
        src.embed.weight.normal_()
    path = tmp_path / "tied.pt"
    torch.save(src.state_dict(), path)
    target = {k: torch.zeros_like(v) for k, v in src.state_dict().items()}  # three separate tensors
    gt.load_into(target, path)
    assert torch.equal(target["embed.weight"], src.embed.weight)
    assert torch.equal(target["head.weight"], src.embed.weight)
    assert target["embed.weight"].data_ptr() != target["head.weight"].data_ptr()


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_non_contiguous_targets_filled_through_a_staging_copy(tmp_path, fmt) -> None:
    g = torch.Generator().manual_seed(4)
    values = {"t": torch.randn(300, 200, generator=g), "s": torch.randn(40, 30, generator=g),
              "c": torch.randn(900, 300, generator=g)}
    path = tmp_path / f"nc.{fmt}"
    (st_torch.save_file(values, str(path)) if fmt == "safetensors" else torch.save(values, path))
    base_t = torch.zeros(200, 300)
    base_s = torch.zeros(40, 60)
    target = {"t": base_t.t(), "s": base_s[:, ::2], "c": torch.zeros(900, 300)}
    assert not target["t"].is_contiguous() and not target["s"].is_contiguous()
    ptrs = {k: v.data_ptr() for k, v in target.items()}
    (gs.load_into if fmt == "safetensors" else gt.load_into)(target, path)
    for k in values:
        assert torch.equal(target[k], values[k]), k
        assert target[k].data_ptr() == ptrs[k]
    assert torch.equal(base_t, values["t"].t())
    assert torch.equal(base_s[:, 1::2], torch.zeros(40, 30))  # the elements between stay as they were


def test_strided_records_of_a_torch_file(tmp_path) -> None:
    g = torch.Generator().manual_seed(6)
    base = torch.randn(50, 40, generator=g)
    sd = {"whole": base, "rows": base[10:20], "transposed": base.t(), "column": base[:, 3]}
    path = tmp_path / "views.pt"
    torch.save(sd, path)  # one storage, four views of it
    target = {k: torch.zeros(v.shape) for k, v in sd.items()}
    assert gt.load_into(target, path) == ([], [])
    ref = torch.load(path, weights_only=True)
    for k in sd:
        assert torch.equal(target[k], ref[k]), k


def test_expanded_target_refused(tmp_path) -> None:
    path = tmp_path / "e.safetensors"
    st_torch.save_file({"e": torch.ones(4, 3)}, str(path))
    with pytest.raises(gs.UnsupportedTargetError):
        gs.load_into({"e": torch.zeros(3).expand(4, 3)}, path)


def test_targets_sharing_memory_without_being_one_tensor_refused(tmp_path) -> None:
    path = tmp_path / "o.safetensors"
    st_torch.save_file({"a": torch.ones(10), "b": torch.full((3,), 2.0)}, str(path))
    base = torch.zeros(10)
    with pytest.raises(gs.OverlappingTargetsError) as info:
        gs.load_into({"a": base, "b": base[4:7]}, path)
    assert isinstance(info.value, ValueError)
    assert torch.equal(base, torch.zeros(10))


@pytest.mark.parametrize("bad", [{"w": torch.empty(3, device="meta")}, {"w": [1, 2]}, {3: torch.zeros(1)},
                                 [torch.zeros(1)], {"w": torch.zeros(2, 2).to_sparse()}])
def test_targets_that_cannot_be_filled_in_place_refused(tmp_path, bad) -> None:
    path = tmp_path / "w.safetensors"
    st_torch.save_file({"w": torch.ones(3)}, str(path))
    with pytest.raises(gs.UnsupportedTargetError) as info:
        gs.load_into(bad, path)
    assert isinstance(info.value, TypeError)


# -- a file that is bad half way -----------------------------------------------------

def _two_shards(tmp_path):
    g = torch.Generator().manual_seed(7)
    first = {f"a{i}": torch.randn(1000, generator=g) for i in range(5)}
    second = {f"b{i}": torch.randn(1000, generator=g) for i in range(5)}
    p1, p2 = tmp_path / "s1.safetensors", tmp_path / "s2.safetensors"
    st_torch.save_file(first, str(p1))
    st_torch.save_file(second, str(p2))
    target = {k: torch.zeros(1000) for k in [*first, *second]}
    return first, second, [str(p1), str(p2)], target


def test_truncated_second_shard_refused_before_anything_is_filled(tmp_path) -> None:
    _first, _second, paths, target = _two_shards(tmp_path)
    os.truncate(paths[1], os.path.getsize(paths[1]) - 100)
    fds = fd_count()
    with pytest.raises(TruncatedFileError):
        gs.load_into(target, paths)
    assert all(torch.equal(v, torch.zeros(1000)) for v in target.values())  # the first shard was not read
    assert fd_count() == fds


def test_bad_header_in_second_shard_refused_before_anything_is_filled(tmp_path) -> None:
    _first, _second, paths, target = _two_shards(tmp_path)
    with open(paths[1], "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        fh.seek(8)
        fh.write(b"{" * 4)
    with pytest.raises(FormatError):
        gs.load_into(target, paths)
    assert all(torch.equal(v, torch.zeros(1000)) for v in target.values())


def test_shard_that_shrinks_during_the_load_names_what_was_filled(tmp_path) -> None:
    first, second, paths, target = _two_shards(tmp_path)
    first_bytes = sum(t.nbytes for t in first.values())

    def shrink_second(done: int, _total: int) -> None:
        if done >= first_bytes and os.path.getsize(paths[1]) > 100:
            os.truncate(paths[1], 100)  # after the first shard's reads, before the second opens

    fds = fd_count()
    with pytest.raises(gs.PartialLoadError) as info:
        gs.load_into(target, paths, progress=shrink_second)
    err = info.value
    assert isinstance(err.__cause__, TruncatedFileError)
    assert sorted(err.filled) == sorted(first) and sorted(err.unfilled) == sorted(second)
    for k in err.filled:
        assert torch.equal(target[k], first[k])
    assert fd_count() == fds


def test_torch_files_of_the_old_format_refused(tmp_path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(FormatError):
        gt.load_into({"w": torch.zeros(3)}, path)


def test_truncated_torch_archive_refused_before_anything_is_filled(net_files) -> None:
    _, pt_path = net_files
    os.truncate(pt_path, os.path.getsize(pt_path) - 5000)
    net = Net()
    untouched = snapshot(net)
    with pytest.raises(FormatError):
        gt.load_into(net, pt_path)
    assert snapshot(net) == untouched


class _NotAWeight:
    pass


def test_weights_only_refuses_a_pickle_that_needs_other_objects(tmp_path) -> None:
    path = tmp_path / "unsafe.pt"
    torch.save({"w": torch.ones(3), "obj": _NotAWeight()}, path)
    target = {"w": torch.zeros(3)}
    with pytest.raises(gt.UnsafeCheckpointError):
        gt.load_into(target, path)
    assert torch.equal(target["w"], torch.zeros(3))
    assert gt.load_into(target, path, weights_only=False, strict=False) == ([], ["obj"])
    assert torch.equal(target["w"], torch.ones(3))


def test_return_stats_counts_the_bytes_read(net_files) -> None:
    st_path, _ = net_files
    result, stats = gs.load_into(Net(), st_path, return_stats=True)
    assert result == ([], [])
    payload = sum(t.nbytes for t in st_torch.load_file(str(st_path)).values())
    assert sum(p.bytes_read for p in stats.paths.values()) == payload


# -- the module's tensors, as state_dict hands them out --------------------------------------

class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3, bias=False)      # a None parameter (bias) is skipped
        self.register_buffer("count", torch.zeros(2))
        self.register_buffer("cache", torch.zeros(2), persistent=False)
        self.register_buffer("unset", None)


class _Extra(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def get_extra_state(self):
        return {"step": 3}

    def set_extra_state(self, state) -> None:
        pass


class _Renamed(torch.nn.Module):
    """A module that saves its tensor under another name."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Parameter(torch.ones(2))

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "outer"] = self.inner


class _Tree(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = _Block()
        self.shared = _Block()
        self.again = self.shared                     # one submodule under two names: saved under both
        self.extra = _Extra()
        self.renamed = _Renamed()
        self.deep = torch.nn.Sequential(_Block(), torch.nn.Sequential(_Block(), None))
        self.head = torch.nn.Linear(4, 3)
        self.head.weight = self.first.lin.weight     # tied
        self.register_buffer("top", torch.arange(3.0))


def _hooked_tree() -> torch.nn.Module:
    tree = _Tree()
    tree.first.register_state_dict_pre_hook(lambda module, prefix, keep_vars: None)
    tree.deep[1][0].register_state_dict_post_hook(lambda module, sd, prefix, meta: sd.__delitem__(prefix + "count"))
    tree.shared._register_state_dict_hook(lambda module, sd, prefix, meta: None)
    tree.register_state_dict_post_hook(lambda module, sd, prefix, meta: None)  # on the root too
    return tree


@pytest.mark.parametrize("make", [_Tree, _hooked_tree, lambda: torch.nn.Sequential(*[_Block() for _ in range(5)]),
                                  lambda: torch.nn.Linear(2, 2), torch.nn.Module])
def test_module_tensors_are_what_state_dict_hands_out(make) -> None:
    from gdskit.formats.into_exec import module_state

    module = make()
    want = module.state_dict(keep_vars=True)
    got = module_state(module)
    assert list(got) == list(want)
    for k, v in want.items():  # the same tensors; extra state is made anew by each call
        assert got[k] is v if isinstance(v, torch.Tensor) else got[k] == v, k


def test_state_dict_hooks_decide_what_is_filled(tmp_path) -> None:
    tree = _hooked_tree()
    sd = tree.state_dict()
    assert "deep.1.0.count" not in sd  # the post hook dropped it
    values = random_state(torch.nn.ParameterDict({k.replace(".", "_"): v for k, v in sd.items()
                                                 if isinstance(v, torch.Tensor)}), seed=11)
    values = {k: values[k.replace(".", "_")] for k, v in sd.items() if isinstance(v, torch.Tensor)}
    path = tmp_path / "tree.safetensors"
    gs.save_file({k: v for k, v in values.items() if k != "head.weight"}, path)  # tied: saved once
    target = _hooked_tree()
    assert gs.load_into(target, path) == ([], [])  # extra state is not a tensor: neither missing nor read
    assert torch.equal(target.head.weight, values["first.lin.weight"])
    assert torch.equal(target.renamed.inner, values["renamed.outer"])
    assert torch.equal(target.again.count, values["shared.count"])
    assert torch.equal(target.deep[1][0].count, torch.zeros(2))  # not in its state dict: left alone


def test_many_small_tensors_of_many_dtypes_filled_in_place(tmp_path) -> None:
    """A module of many submodules, as loaders.py's small set is built, into host memory."""
    g = torch.Generator().manual_seed(12)
    dtypes = [torch.bfloat16, torch.float32, torch.int8, torch.float16, torch.int64]
    values = {}
    for i, n in enumerate(torch.randint(1, 3000, (1500,), generator=g).tolist()):
        dt = dtypes[i % len(dtypes)]
        raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dt).element_size(),), dtype=torch.uint8, generator=g)
        values[f"blocks.{i}.param"] = raw.view(dt)
    values["blocks.7.big"] = torch.randn(300_000, generator=g)  # a direct read among them
    path = tmp_path / "many.safetensors"
    st_torch.save_file(values, str(path))
    root = torch.nn.Module()
    root.blocks = torch.nn.ModuleList(torch.nn.Module() for _ in range(1500))
    for k, v in values.items():
        _, i, leaf = k.split(".")
        root.blocks[int(i)].register_parameter(leaf, torch.nn.Parameter(torch.full_like(v, 0), requires_grad=False))
    ptrs = pointers(root)
    assert gs.load_into(root, path) == ([], [])
    ref = st_torch.load_file(str(path))
    assert pointers(root) == ptrs
    for k, v in root.state_dict().items():
        assert same(v, ref[k]), k


def test_version_counters_of_filled_tensors_are_bumped(net_files) -> None:
    st_path, _ = net_files
    net = Net()
    with torch.inference_mode():
        frozen = torch.zeros(3, dtype=torch.int64)  # an inference tensor has no version counter
    net.steps = frozen
    before = {k: v._version for k, v in net.state_dict(keep_vars=True).items() if not v.is_inference()}
    gs.load_into(net, st_path)
    after = {k: v._version for k, v in net.state_dict(keep_vars=True).items() if not v.is_inference()}
    assert all(after[k] > before[k] for k in before)
    assert torch.equal(net.steps, st_torch.load_file(str(st_path))["steps"])


# -- the plan, pure -------------------------------------------------------------------

def _info(name, ptr, nbytes, *, dtype="f32", shape=None, stride=None, span=None, device="cpu"):
    return ip.TargetInfo(name, dtype, shape or (nbytes // 4,), device, ptr, nbytes,
                         nbytes if span is None else span, stride)


def test_plan_decides_direct_staged_and_cast() -> None:
    targets = [_info("a", 0, 400), _info("b", 1000, 400, stride=(2,), span=796),
               _info("c", 2000, 400, dtype="f64", shape=(100,)), _info("d", 4000, 400)]
    records = {"a": ip.SourceInfo("a", "f32", (100,)), "b": ip.SourceInfo("b", "f32", (100,)),
               "c": ip.SourceInfo("c", "f32", (100,)), "d": ip.SourceInfo("d", "f32", (100,), contiguous=False)}
    plan = ip.plan_into(targets, records, cast=True)
    how = {f.target: (f.staged, f.cast) for f in plan.fills}
    assert how == {"a": (False, False), "b": (True, False), "c": (True, True), "d": (True, False)}
    with pytest.raises(ip.DtypeMismatchError):
        ip.plan_into(targets, records, cast=False)


def test_plan_aliases_and_empty_tensors() -> None:
    targets = [_info("x", 0, 400), _info("y", 0, 400), _info("e1", 0, 0, shape=(0,)),
               _info("e2", 0, 0, shape=(0,))]
    records = {"y": ip.SourceInfo("y", "f32", (100,)), "e1": ip.SourceInfo("e1", "f32", (0,))}
    plan = ip.plan_into(targets, records, cast=False)
    assert [(f.target, f.aliases) for f in plan.fills] == [("y", ("x",)), ("e1", ())]
    assert plan.missing_keys == ("e2",)  # tensors without bytes are never aliases
    assert plan.filled_names() == ["y", "x", "e1"]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), min_size=1, max_size=8),
       st.sampled_from([0, 1 << 40, 2**64 - 150, 2**64]))
def test_plan_refuses_exactly_the_overlapping_targets(spans, base) -> None:
    # Bases at and past the top of 64 bits are no machine's addresses: the sort takes its other way.
    targets = [_info(f"t{i}", base + lo, 4, shape=(i + 1,), span=n) for i, (lo, n) in enumerate(spans)]
    records = {t.name: ip.SourceInfo(t.name, "f32", t.shape) for t in targets}
    overlap = any(a[0] < b[0] + b[1] and b[0] < a[0] + a[1]
                  for i, a in enumerate(spans) for b in spans[i + 1:])
    if overlap:
        with pytest.raises(ip.OverlappingTargetsError):
            ip.plan_into(targets, records, cast=False)
    else:
        assert len(ip.plan_into(targets, records, cast=False).fills) == len(targets)


def test_plan_same_addresses_on_two_devices_are_neither_tied_nor_overlapping() -> None:
    targets = [_info("a", 4096, 400), _info("b", 4096, 400, device="cuda:0"), _info("c", 4296, 400, device="cuda:0")]
    records = {t.name: ip.SourceInfo(t.name, "f32", (100,)) for t in targets}
    with pytest.raises(ip.OverlappingTargetsError):  # b and c share bytes on cuda:0
        ip.plan_into(targets, records, cast=False)
    plan = ip.plan_into(targets[:2], records, cast=False)
    assert [(f.target, f.aliases) for f in plan.fills] == [("a", ()), ("b", ())]


def test_plan_reports_unexpected_names_in_the_checkpoints_order() -> None:
    targets = [_info("a", 0, 400), _info("b", 1000, 400)]
    records = {"b": ip.SourceInfo("b", "f32", (100,))}
    plan = ip.plan_into(targets, records, cast=False, record_names=["z", "b", "y"])
    assert plan.missing_keys == ("a",) and plan.unexpected_keys == ("z", "y")
    assert [f.target for f in plan.fills] == ["b"]


# -- GPU -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_gpu_module_filled_in_place_without_new_memory(net_files, fmt) -> None:
    st_path, pt_path = net_files
    net = Net().cuda()
    before = pointers(net)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    (gs.load_into(net, st_path) if fmt == "safetensors" else gt.load_into(net, pt_path))
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == base  # no allocation at all
    assert pointers(net) == before
    ref = st_torch.load_file(str(st_path))
    for k, v in net.state_dict().items():
        assert same(v, ref[k]), k


@pytest.mark.gpu
def test_gpu_many_small_tensors_scattered_into_their_targets(tmp_path) -> None:
    g = torch.Generator().manual_seed(8)
    values = {f"p{i}": torch.randn(int(n), generator=g) for i, n in enumerate(torch.randint(1, 30000, (300,),
                                                                                             generator=g))}
    path = tmp_path / "many.safetensors"
    st_torch.save_file(values, str(path))
    target = {k: torch.zeros_like(v, device="cuda") for k, v in values.items()}
    ptrs = {k: v.data_ptr() for k, v in target.items()}
    gs.load_into(target, path)
    for k in values:
        assert torch.equal(target[k].cpu(), values[k]) and target[k].data_ptr() == ptrs[k]


@pytest.mark.gpu
def test_gpu_mixed_devices_cast_and_non_contiguous(net_files) -> None:
    st_path, _ = net_files
    ref = st_torch.load_file(str(st_path))
    net = Net()
    net.big.cuda()
    net.small.to(torch.float16)  # on the CPU, converted there
    with torch.no_grad():
        net.norm.weight = torch.nn.Parameter(torch.zeros(1024, device="cuda")[::2])  # strided, on the GPU
    before = pointers(net)
    assert gs.load_into(net, st_path, cast=True) == ([], [])
    assert pointers(net) == before
    for k, v in net.state_dict().items():
        assert torch.equal(v.cpu(), ref[k].to(v.dtype)), k
    assert net.big.weight.is_cuda and not net.small.weight.is_cuda


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["scatter", "ring"])
def test_gpu_small_tensors_either_way_in_place_and_within_the_ring(tmp_path, monkeypatch, how) -> None:
    from gdskit.formats import into_exec

    monkeypatch.setattr(into_exec, "GPU_SMALL_READS", how)
    g = torch.Generator().manual_seed(9)
    dtypes = [torch.bfloat16, torch.float32, torch.int8]
    values = {f"p{i}": torch.randint(0, 256, (int(n),), dtype=torch.uint8, generator=g).view(dtypes[i % 3])
              for i, n in enumerate(torch.randint(1, 20000, (2000,), generator=g) * 4)}
    path = tmp_path / "many.safetensors"
    st_torch.save_file(values, str(path))
    target = {k: torch.zeros_like(v, device="cuda") for k, v in values.items()}
    ptrs = {k: v.data_ptr() for k, v in target.items()}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert gs.load_into(target, path) == ([], [])
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= (into_exec.SMALL_RING_BYTES if how == "ring" else 0)
    for k in values:
        assert same(target[k], values[k]) and target[k].data_ptr() == ptrs[k], k
