"""gdskit.torch.load decides every checkpoint as ``torch.load(weights_only=True)`` does, and a
load, accepted or refused, leaves torch as it found it.

The corpus: pickles written by hand (opcode by opcode) and wrapped into torch.save zip
archives — BUILD / setattr on globals and classes, SETITEM and APPEND on the wrong objects,
calls of objects torch does not allow, INST / OBJ / NEWOBJ / NEWOBJ_EX, extension codes,
persistent-id variants, memo tricks, opcodes torch's unpickler does not know — and real
state dicts saved by torch.save and gdskit.torch.save. Each hostile file runs in a worker
process (a side effect could poison the process that loads it); the worker checks, after
every load, a fingerprint of what a pickle could change (rebuild functions, storage
classes, the objects of torch's allowed list) and loads a known file again, and it stops
at the first case that changed anything, so that no later case runs in a poisoned process.

Run as a script (``python test_weights_pickle_differential.py worker DIR``) it is that worker.
"""

from __future__ import annotations

import collections
import copyreg
import dataclasses
import functools
import json
import math
import os
import pickle
import struct
import subprocess
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from memory_cap import cap_address_space
from repo_paths import child_pythonpath

torch = pytest.importorskip("torch")

import gdskit.torch as gt  # noqa: E402

pytestmark = pytest.mark.torch

HERE = Path(__file__).resolve().parent

# -- a pickle assembler (protocol 2, as torch.save writes) ------------------------------

PROTO2 = b"\x80\x02"
MARK, STOP, TUPLE, TUPLE1, TUPLE2, TUPLE3 = b"(", b".", b"t", b"\x85", b"\x86", b"\x87"
EMPTY_TUPLE, EMPTY_LIST, EMPTY_DICT, NONE, TRUE, FALSE = b")", b"]", b"}", b"N", b"\x88", b"\x89"
REDUCE, BUILD, SETITEM, SETITEMS, APPEND, APPENDS, BINPERSID = b"R", b"b", b"s", b"u", b"a", b"e", b"Q"
NEWOBJ, NEWOBJ_EX, INST, OBJ, EMPTY_SET = b"\x81", b"\x92", b"i", b"o", b"\x8f"
DUP, POP, POP_MARK = b"2", b"0", b"1"


def s(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw


def i(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if 0 <= value < 65536:
        return b"M" + struct.pack("<H", value)
    if -(1 << 31) <= value < (1 << 31):
        return b"J" + struct.pack("<i", value)
    raw = pickle.encode_long(value)
    return b"\x8a" + bytes([len(raw)]) + raw


def f(value: float) -> bytes:
    return b"G" + struct.pack(">d", value)


def g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def put(idx: int) -> bytes:
    return b"q" + bytes([idx]) if idx < 256 else b"r" + struct.pack("<I", idx)


def get(idx: int) -> bytes:
    return b"h" + bytes([idx]) if idx < 256 else b"j" + struct.pack("<I", idx)


def tup(*items: bytes) -> bytes:
    if not items:
        return EMPTY_TUPLE
    if len(items) <= 3:
        return b"".join(items) + (TUPLE1, TUPLE2, TUPLE3)[len(items) - 1]
    return MARK + b"".join(items) + TUPLE


def dct(*pairs: tuple[bytes, bytes]) -> bytes:
    return EMPTY_DICT + (MARK + b"".join(k + v for k, v in pairs) + SETITEMS if pairs else b"")


def lst(*items: bytes) -> bytes:
    return EMPTY_LIST + (MARK + b"".join(items) + APPENDS if items else b"")


def od(*pairs: tuple[bytes, bytes]) -> bytes:
    return g("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE + (
        MARK + b"".join(k + v for k, v in pairs) + SETITEMS if pairs else b"")


def pid(key: str = "0", storage_type: str = "FloatStorage", location: str = "cpu", numel: int = 4) -> bytes:
    return tup(s("storage"), g("torch", storage_type), s(key), s(location), i(numel)) + BINPERSID


def tensor(key: str = "0", offset: int = 0, size: tuple[int, ...] = (4,), stride: tuple[int, ...] = (1,),
           storage_type: str = "FloatStorage", numel: int = 4, requires_grad: bool = False) -> bytes:
    return g("torch._utils", "_rebuild_tensor_v2") + MARK + pid(key, storage_type, "cpu", numel) + i(offset) + \
        tup(*map(i, size)) + tup(*map(i, stride)) + (TRUE if requires_grad else FALSE) + od() + TUPLE + REDUCE


def pkl(body: bytes) -> bytes:
    return PROTO2 + body + STOP


FLOATS = struct.pack("<4f", 1.0, -2.0, 3.5, 0.25)
REBUILD_V2 = g("torch._utils", "_rebuild_tensor_v2")
UNTYPED = g("torch.storage", "UntypedStorage")


def setattr_state(**attrs: bytes) -> bytes:
    """A BUILD state ``(None, {name: value})``: the C unpickler sets each name with setattr."""
    return tup(NONE, dct(*[(s(k), v) for k, v in attrs.items()]))


def negating_defaults() -> bytes:
    """``({'neg': True},)``: as ``_rebuild_tensor_v2.__defaults__``, every later tensor without
    metadata would come back negated."""
    return tup(dct((s("neg"), TRUE)))


# -- the corpus -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One archive: its data.pkl and its storage records (key -> bytes)."""

    pickle: bytes
    storages: dict[str, bytes] = dataclasses.field(default_factory=lambda: {"0": FLOATS})


def _hostile() -> dict[str, Case]:
    t = tensor()
    c: dict[str, Case] = {}
    # BUILD (setattr, __setstate__, __dict__ update) on globals: torch refuses every one
    c["build_setattr_rebuild_defaults_then_refused"] = Case(pkl(
        dct((s("t"), t), (s("x"), REBUILD_V2 + setattr_state(__defaults__=negating_defaults()) + BUILD),
            (s("bad"), g("os", "system")))))
    c["build_setattr_rebuild_defaults_accepted_shape"] = Case(pkl(
        dct((s("x"), REBUILD_V2 + setattr_state(__defaults__=negating_defaults()) + BUILD), (s("t"), t))))
    c["build_setattr_untyped_storage_nbytes"] = Case(pkl(
        dct((s("t"), t), (s("cls"), UNTYPED + setattr_state(nbytes=g("torch", "Size")) + BUILD))))
    c["build_dict_update_untyped_storage"] = Case(pkl(
        dct((s("cls"), UNTYPED + dct((s("nbytes"), g("torch", "Size"))) + BUILD), (s("t"), t))))
    c["build_dict_rebuild_function"] = Case(pkl(
        dct((s("f"), REBUILD_V2 + dct((s("__kwdefaults__"), dct())) + BUILD), (s("t"), t))))
    c["build_setattr_legacy_storage_type_dtype"] = Case(pkl(
        dct((s("st"), g("torch", "FloatStorage") + setattr_state(_dtype=g("torch", "float64")) + BUILD),
            (s("t"), t))))
    c["build_dict_legacy_storage_type"] = Case(pkl(
        dct((s("st"), g("torch", "FloatStorage") + dct((s("_dtype"), g("torch", "int8"))) + BUILD),
            (s("t"), t))))
    c["build_setattr_rebuild_parameter"] = Case(pkl(
        dct((s("f"), g("torch._utils", "_rebuild_parameter") + setattr_state(__defaults__=tup(NONE)) + BUILD),)))
    c["build_setattr_ordered_dict_class"] = Case(pkl(
        dct((s("c"), g("collections", "OrderedDict") + setattr_state(update=g("torch", "Size")) + BUILD),)))
    c["build_setattr_size_class"] = Case(pkl(
        dct((s("c"), g("torch", "Size") + setattr_state(count=g("torch", "Size")) + BUILD),)))
    c["build_setattr_dtype"] = Case(pkl(
        dct((s("d"), g("torch", "float32") + setattr_state(is_floating_point=NONE) + BUILD),)))
    c["build_none_state_on_global"] = Case(pkl(dct((s("f"), REBUILD_V2 + NONE + BUILD),)))
    c["build_on_global_from_the_memo"] = Case(pkl(
        REBUILD_V2 + put(0) + b"0" + dct((s("t"), t), (s("x"), get(0) + setattr_state(
            __defaults__=negating_defaults()) + BUILD))))
    c["build_on_global_memo_overwritten"] = Case(pkl(
        od() + put(0) + b"0" + REBUILD_V2 + put(0) + b"0" + dct((s("x"), get(0) + dct((s("a"), i(1))) + BUILD),)))
    c["build_on_global_after_put_keeps_it"] = Case(pkl(
        dct((s("x"), REBUILD_V2 + put(0) + setattr_state(__defaults__=negating_defaults()) + BUILD),
            (s("again"), get(0)))))
    # BUILD on objects: torch allows OrderedDict (dict update), Tensor (set_), Parameter
    c["build_ordered_dict_metadata"] = Case(pkl(
        od((s("w"), t)) + dct((s("_metadata"), od((s(""), dct((s("version"), i(1))))))) + BUILD))
    c["build_ordered_dict_twice"] = Case(pkl(
        od((s("w"), t)) + dct((s("a"), i(1))) + BUILD + dct((s("b"), i(2))) + BUILD))
    c["build_ordered_dict_setstate_attribute"] = Case(pkl(
        od() + dct((s("__setstate__"), g("torch", "Size"))) + BUILD + dct((s("a"), lst(i(1), i(2)))) + BUILD))
    c["build_ordered_dict_slot_state"] = Case(pkl(od() + setattr_state(a=i(1)) + BUILD))
    c["build_ordered_dict_none_state"] = Case(pkl(od() + NONE + BUILD))
    c["build_ordered_dict_list_state"] = Case(pkl(od() + lst(tup(s("a"), i(1))) + BUILD))
    c["build_ordered_dict_nested"] = Case(pkl(
        od((s("inner"), od() + dct((s("x"), i(1))) + BUILD)) + dct((s("y"), i(2))) + BUILD))
    c["build_list"] = Case(pkl(lst(i(1)) + NONE + BUILD))
    c["build_dict"] = Case(pkl(dct() + dct((s("a"), i(1))) + BUILD))
    c["build_tuple"] = Case(pkl(tup(i(1)) + NONE + BUILD))
    c["build_tensor_set"] = Case(pkl(
        dct((s("t"), t + tup(pid(), i(1), tup(i(2)), tup(i(1))) + BUILD),)))
    c["build_tensor_bad_state"] = Case(pkl(dct((s("t"), t + NONE + BUILD),)))
    c["build_size_none"] = Case(pkl(g("torch", "Size") + tup(tup(i(2))) + REDUCE + NONE + BUILD))
    c["build_storage"] = Case(pkl(dct((s("p"), pid() + setattr_state(dtype=g("torch", "int8")) + BUILD),)))
    # SETITEM / SETITEMS: torch allows dict, OrderedDict and Counter only
    c["setitem_list"] = Case(pkl(lst(i(1), i(2)) + i(0) + i(7) + SETITEM))
    c["setitems_list"] = Case(pkl(lst(i(1), i(2)) + MARK + i(0) + i(7) + SETITEMS))
    c["setitem_tensor"] = Case(pkl(dct((s("t"), t + i(0) + f(9.0) + SETITEM),)))
    c["setitems_storage"] = Case(pkl(dct((s("p"), pid() + MARK + i(0) + f(9.0) + SETITEMS),)))
    c["setitem_ordered_dict_class"] = Case(pkl(g("collections", "OrderedDict") + s("k") + i(1) + SETITEM))
    c["setitem_size"] = Case(pkl(g("torch", "Size") + tup(tup(i(2))) + REDUCE + i(0) + i(5) + SETITEM))
    c["setitem_ordered_dict"] = Case(pkl(od() + s("k") + t + SETITEM))
    c["setitems_odd"] = Case(pkl(dct() + MARK + s("a") + i(1) + s("b") + SETITEMS))
    c["setitem_unhashable_key"] = Case(pkl(dct() + lst() + i(1) + SETITEM))
    c["setitem_tensor_key"] = Case(pkl(dct() + t + i(1) + SETITEM))
    c["setitems_empty_mark"] = Case(pkl(dct() + MARK + SETITEMS))
    c["setitem_underflow"] = Case(pkl(dct() + MARK + s("a") + i(1) + SETITEM))
    # APPEND / APPENDS: lists only
    c["append_dict"] = Case(pkl(dct() + i(1) + APPEND))
    c["appends_tuple"] = Case(pkl(tup(i(1)) + MARK + i(1) + APPENDS))
    c["appends_ordered_dict"] = Case(pkl(od() + MARK + i(1) + APPENDS))
    c["append_list"] = Case(pkl(lst() + t + APPEND + t + APPEND))
    c["appends_nested"] = Case(pkl(lst(lst(t, i(3)), tup(s("x"), NONE))))
    # REDUCE / NEWOBJ of callables torch does not allow, or of objects that are not callables
    c["reduce_blocked_global"] = Case(pkl(g("os", "system") + tup(s("true")) + REDUCE))
    c["reduce_unlisted_global"] = Case(pkl(g("builtins", "print") + tup(s("called")) + REDUCE))
    c["reduce_dtype"] = Case(pkl(g("torch", "float32") + tup() + REDUCE))
    c["reduce_storage_type"] = Case(pkl(g("torch", "FloatStorage") + tup(i(2)) + REDUCE))
    c["reduce_tensor"] = Case(pkl(t + tup() + REDUCE))
    c["reduce_ordered_dict_instance"] = Case(pkl(od() + tup() + REDUCE))
    c["reduce_list_args"] = Case(pkl(g("collections", "OrderedDict") + lst() + REDUCE))
    c["reduce_dict_args"] = Case(pkl(g("torch", "Size") + dct((tup(i(1), i(2)), NONE)) + REDUCE))
    c["reduce_size_of_list"] = Case(pkl(g("torch", "Size") + tup(lst(i(3), i(4))) + REDUCE))
    c["reduce_rebuild_bad_args"] = Case(pkl(REBUILD_V2 + tup(i(1), i(2)) + REDUCE))
    c["reduce_rebuild_storage_not_a_storage"] = Case(pkl(
        REBUILD_V2 + MARK + g("torch", "FloatStorage") + i(0) + tup(i(1)) + tup(i(1)) + FALSE + od() + TUPLE
        + REDUCE))
    c["reduce_untyped_storage_empty"] = Case(pkl(dct((s("u"), UNTYPED + tup(i(0)) + REDUCE),)))
    c["reduce_ordered_dict_from_pairs"] = Case(pkl(
        g("collections", "OrderedDict") + tup(lst(tup(s("a"), t))) + REDUCE))
    c["reduce_rebuild_with_hooks_global"] = Case(pkl(
        REBUILD_V2 + MARK + pid() + i(0) + tup(i(4)) + tup(i(1)) + FALSE + g("torch", "Size") + TUPLE + REDUCE))
    c["reduce_rebuild_with_metadata"] = Case(pkl(
        REBUILD_V2 + MARK + pid() + i(0) + tup(i(4)) + tup(i(1)) + FALSE + od() + dct((s("neg"), TRUE))
        + TUPLE + REDUCE))
    c["reduce_rebuild_bad_metadata"] = Case(pkl(
        REBUILD_V2 + MARK + pid() + i(0) + tup(i(4)) + tup(i(1)) + FALSE + od() + lst(i(1)) + TUPLE + REDUCE))
    c["newobj_ordered_dict"] = Case(pkl(g("collections", "OrderedDict") + tup() + NEWOBJ))
    c["newobj_parameter"] = Case(pkl(g("torch.nn.parameter", "Parameter") + tup(t) + NEWOBJ))
    c["newobj_unlisted"] = Case(pkl(g("builtins", "object") + tup() + NEWOBJ))
    c["newobj_ex"] = Case(pkl(g("collections", "OrderedDict") + tup() + dct() + NEWOBJ_EX))
    c["inst"] = Case(pkl(MARK + b"icollections\nOrderedDict\n"))
    c["inst_rebuild"] = Case(pkl(
        MARK + pid() + i(0) + tup(i(4)) + tup(i(1)) + FALSE + od() + b"itorch._utils\n_rebuild_tensor_v2\n"))
    c["obj"] = Case(pkl(MARK + g("collections", "OrderedDict") + OBJ))
    # extension codes (registered in the worker: 240-242 name OrderedDict, Size, _rebuild_tensor_v2)
    c["ext1"] = Case(pkl(b"\x82\xf0" + tup() + REDUCE))
    c["ext2"] = Case(pkl(b"\x83\xf1\x00" + tup(tup(i(2))) + REDUCE))
    c["ext4"] = Case(pkl(b"\x84\xf2\x00\x00\x00" + MARK + pid() + i(0) + tup(i(4)) + tup(i(1)) + FALSE + od()
                         + TUPLE + REDUCE))
    c["ext1_unregistered"] = Case(pkl(b"\x82\x07"))
    # persistent ids
    c["persid_text"] = Case(pkl(b"P0\n"))
    c["binpersid_int"] = Case(pkl(i(0) + BINPERSID))
    c["binpersid_str"] = Case(pkl(s("0") + BINPERSID))
    c["binpersid_list"] = Case(pkl(lst(s("storage")) + BINPERSID))
    c["binpersid_wrong_tag"] = Case(pkl(
        tup(s("module"), g("torch", "FloatStorage"), s("0"), s("cpu"), i(4)) + BINPERSID))
    c["binpersid_short_tuple"] = Case(pkl(tup(s("storage"), g("torch", "FloatStorage"), s("0")) + BINPERSID))
    c["binpersid_three_tuple_with_global"] = Case(pkl(
        tup(od(), dct(), g("collections", "OrderedDict")) + BINPERSID))
    c["binpersid_empty_tuple"] = Case(pkl(tup() + BINPERSID))
    c["binpersid_bytes_tag"] = Case(pkl(
        tup(b"U\x07storage", g("torch", "FloatStorage"), s("0"), s("cpu"), i(4)) + BINPERSID))
    c["binpersid_not_a_storage_type"] = Case(pkl(
        tup(s("storage"), g("collections", "OrderedDict"), s("0"), s("cpu"), i(4)) + BINPERSID))
    c["binpersid_missing_record"] = Case(pkl(dct((s("t"), tensor(key="9")),)))
    c["binpersid_wrong_size"] = Case(pkl(dct((s("t"), tensor(numel=3, size=(3,))),)))
    c["binpersid_untyped"] = Case(pkl(
        g("torch._utils", "_rebuild_tensor_v3") + MARK
        + tup(s("storage"), UNTYPED, s("0"), s("cpu"), i(16)) + BINPERSID
        + i(0) + tup(i(8)) + tup(i(1)) + FALSE + od() + g("torch", "uint16") + TUPLE + REDUCE))
    c["binpersid_same_key_two_dtypes"] = Case(pkl(lst(tensor(), tensor(storage_type="IntStorage"))))
    # the memo
    c["memo_large_long_binput"] = Case(pkl(lst() + put(0xf00000) + dct((s("a"), get(0xf00000)))))
    c["memo_get_missing"] = Case(pkl(get(3)))
    c["memo_long_get_missing"] = Case(pkl(get(70000)))
    c["memo_put_empty_stack"] = Case(pkl(put(0) + i(1)))
    c["memo_put_after_mark"] = Case(pkl(i(1) + MARK + put(0) + i(2) + TUPLE))
    c["memo_shared_list"] = Case(pkl(lst(t) + put(0) + b"" + dct((s("a"), get(0)))))
    c["memo_list_mutated_after_use"] = Case(pkl(
        dct((s("a"), lst() + put(0)), (s("b"), get(0) + t + APPEND))))
    c["memo_dict_as_state_then_changed"] = Case(pkl(
        od() + dct() + put(1) + BUILD + put(2) + b"0" + get(1) + s("late") + i(1) + SETITEM + b"0" + get(2)))
    # opcodes torch's unpickler does not know, or not as the C unpickler does
    c["protocol_4"] = Case(pickle.dumps({"a": 1, "b": [1.5, "x"]}, protocol=4))
    c["protocol_5_frame"] = Case(pickle.dumps(collections.OrderedDict(a=(1, 2)), protocol=5))
    c["protocol_3"] = Case(b"\x80\x03" + dct((s("a"), i(1))) + STOP)
    c["protocol_2_twice"] = Case(PROTO2 + PROTO2 + dct((s("a"), i(1))) + STOP)
    c["protocol_in_the_middle"] = Case(PROTO2 + dct((s("a"), b"\x80\x04" + i(1))) + STOP)
    c["no_protocol"] = Case(dct((s("a"), i(1))) + STOP)
    c["stack_global"] = Case(pkl(s("collections") + s("OrderedDict") + b"\x93" + tup() + REDUCE))
    c["memoize"] = Case(pkl(lst() + b"\x94" + get(0)))
    c["frame"] = Case(pkl(b"\x95" + struct.pack("<Q", 3) + dct()))
    c["dup"] = Case(pkl(dct() + DUP + TUPLE2))
    c["pop"] = Case(pkl(dct() + i(1) + POP))
    c["pop_mark"] = Case(pkl(dct() + MARK + i(1) + POP_MARK))
    c["text_int"] = Case(pkl(b"I5\n"))
    c["text_long"] = Case(pkl(b"L5L\n"))
    c["text_float"] = Case(pkl(b"F1.5\n"))
    c["text_string"] = Case(pkl(b"S'abc'\n"))
    c["text_unicode"] = Case(pkl(b"Vabc\n"))
    c["text_get_put"] = Case(pkl(dct() + b"p0\n" + b"0" + b"g0\n"))
    c["text_list_dict"] = Case(pkl(MARK + b"l" + MARK + b"d" + TUPLE2))
    c["short_binstring"] = Case(pkl(dct((b"U\x01a", i(1)),)))
    c["binstring"] = Case(pkl(b"T\x01\x00\x00\x00a"))
    c["short_binbytes"] = Case(pkl(b"C\x01a"))
    c["binbytes"] = Case(pkl(b"B\x01\x00\x00\x00a"))
    c["short_binunicode"] = Case(pkl(b"\x8c\x01a"))
    c["binunicode8"] = Case(pkl(b"\x8d" + struct.pack("<Q", 1) + b"a"))
    c["bytearray8"] = Case(pkl(b"\x96" + struct.pack("<Q", 1) + b"a"))
    c["long4"] = Case(pkl(b"\x8b\x01\x00\x00\x00\x05"))
    c["empty_set"] = Case(pkl(EMPTY_SET))
    c["additems"] = Case(pkl(EMPTY_SET + MARK + i(1) + b"\x90"))
    c["frozenset"] = Case(pkl(MARK + i(1) + b"\x91"))
    c["next_buffer"] = Case(pkl(b"\x97"))
    c["unknown_opcode"] = Case(pkl(b"\xff"))
    c["set_via_builtins"] = Case(pkl(g("builtins", "set") + tup(lst(i(1), i(2))) + REDUCE))
    c["set_via_python2_name"] = Case(pkl(g("__builtin__", "set") + tup(lst(i(1))) + REDUCE))
    c["global_crlf"] = Case(pkl(b"ccollections\r\nOrderedDict\r\n" + tup() + REDUCE))
    c["global_no_newline"] = Case(PROTO2 + b"ccollections\nOrderedDict")
    c["global_not_utf8"] = Case(pkl(b"c\xff\xfe\nOrderedDict\n"))
    c["global_allowed_not_plain"] = Case(pkl(
        g("torch._utils", "_rebuild_tensor") + MARK + pid() + i(0) + tup(i(4)) + tup(i(1)) + TUPLE + REDUCE))
    c["global_device"] = Case(pkl(g("torch", "device") + tup(s("cpu")) + REDUCE))
    c["global_bytes_via_codecs"] = Case(pkl(g("_codecs", "encode") + tup(s("abc"), s("latin1")) + REDUCE))
    # framing of the stream
    c["stop_with_open_mark"] = Case(pkl(MARK + t))
    c["stop_on_empty_mark"] = Case(pkl(t + MARK))
    c["stop_with_leftovers"] = Case(pkl(i(1) + i(2) + t))
    c["stop_on_empty_stack"] = Case(pkl(b""))
    c["trailing_bytes"] = Case(pkl(dct((s("t"), t),)) + b"garbage\xff")
    c["no_stop"] = Case(PROTO2 + dct((s("t"), t),))
    c["truncated_string"] = Case(PROTO2 + b"X\x10\x00\x00\x00abc")
    c["truncated_int"] = Case(PROTO2 + b"J\x01")
    c["string_past_the_end"] = Case(pkl(b"X\xff\xff\xff\x7fabc"))
    c["string_not_utf8"] = Case(pkl(b"X\x02\x00\x00\x00\xff\xfe"))
    c["string_surrogate"] = Case(pkl(dct((s("a"), b"X\x03\x00\x00\x00\xed\xa0\x80"),)))
    c["long_string"] = Case(pkl(dct((s("k" * 300), s("v" * 70000)), (s("t"), t))))
    c["long1_wide"] = Case(pkl(lst(i(1 << 2000), i(-(1 << 900)), b"\x8a\x00")))
    c["tuple_underflow"] = Case(pkl(i(1) + MARK + TUPLE2))
    c["tuple_no_mark"] = Case(pkl(i(1) + TUPLE))
    c["deep_nesting"] = Case(pkl(EMPTY_LIST + (MARK + EMPTY_LIST) * 300 + APPENDS * 300))
    c["deep_tuples"] = Case(pkl(i(1) + TUPLE1 * 300))
    c["many_marks"] = Case(pkl(MARK * 300 + i(1) + TUPLE * 300))
    return c


# -- archives -------------------------------------------------------------------------------

def write_archive(path: Path, data_pkl: bytes, storages: dict[str, bytes]) -> None:
    """A torch.save zip archive holding ``data_pkl`` and the storage records, as torch.save lays it out."""
    w = torch._C.PyTorchFileWriter(str(path))
    w.write_record("data.pkl", data_pkl, len(data_pkl))
    w.write_record(".format_version", "1", 1)
    w.write_record(".storage_alignment", "64", 2)
    w.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    for key, blob in storages.items():
        w.write_record(f"data/{key}", blob, len(blob))
    w.write_end_of_file()
    del w


# -- what a pickle could change, and how to tell ----------------------------------------------

@functools.lru_cache(maxsize=2)
def _watched(everything: bool = True) -> dict[str, Any]:
    """Everything torch's weights-only list hands out, the rebuild functions and storage classes;
    without ``everything``, only what gdskit's fast unpickler hands out and what they use
    (the legacy tensor type objects, slow to look at, left out)."""
    from torch import _weights_only_unpickler as wo
    from gdskit.formats import weights_pickle
    if everything:
        out: dict[str, Any] = {f"allowed:{k}": v for k, v in wo._get_allowed_globals().items()}
    else:
        out = {f"plain:{m}.{n}": v for (m, n), v in weights_pickle._vocabulary().lookup.items()}
    for name in dir(torch._utils):
        obj = getattr(torch._utils, name)
        if callable(obj) and ("rebuild" in name or "metadata" in name):
            out[f"torch._utils.{name}"] = obj
    for cls in (*torch._storage_classes, torch.storage.TypedStorage, torch.storage.UntypedStorage,
                torch.storage._LegacyStorage, torch._C.StorageBase, torch.serialization.StorageType,
                torch.Tensor, torch._C.TensorBase, torch.nn.Parameter, torch.Size, torch.dtype,
                collections.OrderedDict, dict, list, tuple, set):
        out[f"class:{cls.__module__}.{cls.__qualname__}"] = cls
    for name in ("_rebuild_from_type_v2",):
        out[f"torch._tensor.{name}"] = getattr(torch._tensor, name)
    for name in ("default_restore_location", "_get_restore_location", "_maybe_decode_ascii", "StorageType"):
        out[f"torch.serialization.{name}"] = getattr(torch.serialization, name)
    return out


def _ids(mapping: Any) -> Any:
    if mapping is None:
        return None
    return tuple((k, id(v)) for k, v in mapping.items())  # an entry changed, added, removed or moved


def _state_of(obj: Any) -> Any:
    if isinstance(obj, types.FunctionType):
        defaults = None if obj.__defaults__ is None else tuple((id(v), repr(v)) for v in obj.__defaults__)
        return ("function", id(obj.__code__), defaults, _ids(obj.__kwdefaults__), _ids(obj.__dict__))
    if isinstance(obj, type):
        return ("class", _ids(vars(obj)))
    state = getattr(obj, "__dict__", None)
    return ("object", type(obj).__qualname__, _ids(state))


def fingerprint(everything: bool = True) -> dict[str, Any]:
    """A comparable picture of everything a pickle might try to change in torch (see :func:`_watched`)."""
    from torch import _weights_only_unpickler as wo
    from gdskit.formats import weights_pickle
    out = {name: _state_of(obj) for name, obj in _watched(everything).items()}
    out["allowed-list"] = _ids(wo._get_allowed_globals())
    out["safe-globals"] = repr(sorted(map(repr, wo._get_safe_globals())))
    out["copyreg"] = (_ids(copyreg.dispatch_table), _ids(copyreg._extension_registry))
    out["weights_pickle"] = _ids(vars(weights_pickle))
    return out


class Snapshot:
    """What :func:`_watched` holds, kept so that a test that changed it can put it back
    (for tests that run hostile pickles in the test process itself)."""

    def __init__(self, everything: bool = False) -> None:
        self.everything = everything
        self.before = fingerprint(everything)
        self.saved = {name: self._save(obj) for name, obj in _watched(everything).items()}

    @staticmethod
    def _save(obj: Any) -> Any:
        if isinstance(obj, types.FunctionType):
            return obj.__defaults__, obj.__kwdefaults__, dict(obj.__dict__)
        if isinstance(obj, type):
            return dict(vars(obj))
        state = getattr(obj, "__dict__", None)
        return None if state is None else dict(state)

    def restore(self) -> list[str]:
        """Put back what changed; the names of what had changed."""
        after = fingerprint(self.everything)
        changed = sorted(k for k in after if after[k] != self.before.get(k))
        for name, obj in _watched(self.everything).items():
            if name not in changed:
                continue
            saved = self.saved[name]
            if isinstance(obj, types.FunctionType):
                obj.__defaults__, obj.__kwdefaults__ = saved[0], saved[1]
                obj.__dict__.clear()
                obj.__dict__.update(saved[2])
            elif isinstance(obj, type):
                for key in [k for k in vars(obj) if k not in saved]:
                    delattr(obj, key)
                for key, value in saved.items():
                    if vars(obj).get(key) is not value:
                        setattr(obj, key, value)
            elif saved is not None:
                obj.__dict__.clear()
                obj.__dict__.update(saved)
        return changed

# -- comparing what two loads returned ------------------------------------------------------

def same_value(a: Any, b: Any, storages: tuple[dict[int, int], dict[int, int]] | None = None) -> bool:
    """Equal structure, types and values; tensors equal in dtype, shape, stride, storage offset,
    bytes, requires_grad and flags, and storages shared alike on both sides."""
    storages = storages if storages is not None else ({}, {})
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        if (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad, a.is_conj(), a.is_neg()) != \
                (b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad, b.is_conj(), b.is_neg()):
            return False
        return _same_storage(a.untyped_storage(), b.untyped_storage(), storages)  # the same bytes, seen alike
    if isinstance(a, torch.UntypedStorage):
        return _same_storage(a, b, storages)
    if isinstance(a, torch.storage.TypedStorage):
        return a.dtype == b.dtype and _same_storage(a._untyped_storage, b._untyped_storage, storages)
    if isinstance(a, dict):
        if len(a) != len(b) or not all(same_value(ka, kb, storages) and same_value(va, vb, storages)
                                       for (ka, va), (kb, vb) in zip(a.items(), b.items())):
            return False
        return type(a) is dict or same_value(dict(vars(a)), dict(vars(b)), storages)  # OrderedDict._metadata
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y, storages) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def _same_storage(a: Any, b: Any, seen: tuple[dict[int, int], dict[int, int]]) -> bool:
    """Same bytes, and the n-th distinct storage on one side is the n-th on the other."""
    ka, kb = a.data_ptr() if a.nbytes() else id(a), b.data_ptr() if b.nbytes() else id(b)
    na, nb = seen[0].setdefault(ka, len(seen[0])), seen[1].setdefault(kb, len(seen[1]))
    if na != nb or a.nbytes() != b.nbytes() or a.device != b.device:
        return False
    u8 = torch.uint8
    return torch.equal(torch.empty(0, dtype=u8).set_(a.cpu()), torch.empty(0, dtype=u8).set_(b.cpu()))


# -- one case, as the worker runs it ------------------------------------------------------

def decide(load: Callable[[], Any]) -> tuple[str, Any]:
    """``("accept", value)``, ``("unsafe", name)`` (pickle.UnpicklingError: gdskit's
    UnsafeCheckpointError is one) or ``("damaged", name)`` (any other exception)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return "accept", load()
    except pickle.UnpicklingError as exc:
        return "unsafe", type(exc).__name__
    except Exception as exc:
        return "damaged", type(exc).__name__


def canary_archive(path: Path) -> Any:
    """A small checkpoint whose loads show whether a poisoned torch changes what it returns."""
    sd = collections.OrderedDict(w=torch.arange(6, dtype=torch.float32).reshape(2, 3) - 2.5,
                                 i=torch.arange(4, dtype=torch.int64), p=torch.nn.Parameter(torch.ones(2)))
    sd._metadata = collections.OrderedDict({"": {"version": 1}})
    torch.save(sd, path)
    return sd


def run_case(path: Path, canary: Path, expected: Any) -> dict[str, Any]:
    before = fingerprint()
    ref_kind, ref = decide(lambda: torch.load(path, weights_only=True))
    after_torch = fingerprint()
    got_kind, got = decide(lambda: gt.load(path))
    after_gdskit = fingerprint()
    try:
        same = ref_kind == got_kind == "accept" and same_value(ref, got)
    except Exception as exc:  # e.g. a poisoned torch failing the comparison itself
        same = f"comparison failed: {type(exc).__name__}: {exc}"
    canary_ok = True
    for load in (lambda: torch.load(canary, weights_only=True), lambda: gt.load(canary)):
        kind, value = decide(load)
        try:
            canary_ok = canary_ok and kind == "accept" and same_value(value, expected)
        except Exception:
            canary_ok = False
    return {"torch": ref_kind, "gdskit": got_kind,
            "torch_detail": ref if ref_kind != "accept" else None,
            "gdskit_detail": got if got_kind != "accept" else None,
            "same": same,
            "torch_changed": sorted(k for k in after_torch if after_torch[k] != before.get(k)),
            "gdskit_changed": sorted(k for k in after_gdskit if after_gdskit[k] != after_torch.get(k)),
            "canary_ok": canary_ok}


def worker(directory: Path) -> None:
    """Runs every case archive of ``directory`` (sorted); one JSON line each; stops after the
    first case that left the process changed."""
    canary = directory / "canary.ckpt"
    expected = canary_archive(canary)  # before the codes below: torch.save would write them
    for code, (module, name) in {240: ("collections", "OrderedDict"), 241: ("torch", "Size"),
                                 242: ("torch._utils", "_rebuild_tensor_v2")}.items():
        copyreg.add_extension(module, name, code)
    for path in sorted(directory.glob("*.pt")):
        try:
            result = run_case(path, canary, expected)
        except BaseException as exc:  # the harness itself failed: report it as the case's result
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["name"] = path.stem
        print(json.dumps(result), flush=True)
        if result.get("error") or result.get("gdskit_changed") or result.get("torch_changed") \
                or not result.get("canary_ok"):
            return


def _check(result: dict[str, Any]) -> None:
    assert "error" not in result, result
    assert result["torch_changed"] == [], f"torch.load itself changed {result['torch_changed']}"
    assert result["gdskit_changed"] == [], f"gdskit.torch.load changed {result['gdskit_changed']}"
    assert result["canary_ok"], "a known checkpoint loads differently after this one"
    assert result["gdskit"] == result["torch"], \
        f"torch.load: {result['torch']} ({result['torch_detail']}); gdskit: {result['gdskit']} " \
        f"({result['gdskit_detail']})"
    if result["torch"] == "accept":
        assert result["same"] is True, f"accepted by both, with different results ({result['same']})"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4, 5), torch.nn.LayerNorm(5),
                               torch.nn.Sequential(torch.nn.Embedding(7, 3), torch.nn.GRU(3, 2)))


def _every_dtype() -> dict[str, Any]:
    out = {}
    for dtype in (torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.complex64, torch.complex128,
                  torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
                  torch.uint64, torch.bool, torch.complex32, torch.float8_e4m3fn, torch.float8_e5m2,
                  torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu):
        base = torch.arange(-3, 9, dtype=torch.float32).reshape(3, 4)
        if dtype.is_complex:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
                t = torch.complex(base, -base).to(dtype)
        elif dtype == torch.bool:
            t = base > 1
        elif not dtype.is_floating_point and not dtype.is_signed:
            t = base.abs().to(dtype)
        else:
            t = base.to(dtype)
        out[str(dtype)] = t
        out[f"{dtype}_view"] = t[1:, ::2]
    return out


def _optimizer_state() -> dict[str, Any]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}


def _views() -> dict[str, Any]:
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    row = torch.arange(5.0)
    return collections.OrderedDict(
        base=base, t=base.transpose(0, 2), offset=base[1], strided=base[:, ::2, 1::2], expand=row.expand(3, 5),
        as_strided=base.as_strided((3, 3), (5, 2), 1), unsqueeze=row.unsqueeze(0), flat=base.view(-1),
        again=[base, base], zero_dim=torch.tensor(7.0), empty=torch.empty(0, 3), empty2=torch.empty(2, 0, 1),
        five_dims=torch.ones(1, 2, 1, 2, 1), requires_grad=torch.ones(3, requires_grad=True),
        conj=torch.complex(row, row).conj(), neg=row._neg_view(), conj_view=torch.complex(row, -row).conj()[1:])


def _python_values() -> dict[str, Any]:
    return {"ints": [0, 1, -1, 255, 256, 65535, 65536, -(1 << 31), (1 << 31) - 1, 1 << 40, -(1 << 100), 1 << 2000],
            "floats": (0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), 1e-300),
            "bools": [True, False, None], "strings": ["", "x", "ü€😀", "k" * 300, "\n\x00"],
            "nested": {"a": {"b": {"c": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)]}}, 1: "int key",
                       (1, "t"): "tuple key", None: "none key", 2.5: "float key"},
            "size": torch.Size([2, 3]), "dtypes": [torch.float32, torch.int8, torch.bfloat16],
            "empty": [{}, [], (), collections.OrderedDict()], "tensor": torch.ones(2)}


def _with_metadata_and_attribute() -> Any:
    sd = _model().state_dict()
    sd.note = "an extra attribute"  # the BUILD state then holds two entries
    return sd


def _real() -> dict[str, Callable[[Path], None]]:
    def saving(make: Callable[[], Any], save: Callable[[Any, Path], None] = torch.save) -> Callable[[Path], None]:
        return lambda path: save(make(), path)

    from torch_checkpoints import checkpoint
    return {
        "real_checkpoint": saving(checkpoint),
        "real_checkpoint_gdskit_save": saving(checkpoint, gt.save),
        "real_model_state_dict": saving(lambda: _model().state_dict()),
        "real_model_state_dict_gdskit_save": saving(lambda: _model().state_dict(), gt.save),
        "real_state_dict_with_attribute": saving(_with_metadata_and_attribute),
        "real_parameters_list": saving(lambda: list(_model().parameters())),
        "real_parameters_dict": saving(lambda: {n: torch.nn.Parameter(p.detach(), requires_grad=i % 2 == 0)
                                                for i, (n, p) in enumerate(_model().named_parameters())}),
        "real_parameter": saving(lambda: torch.nn.Parameter(torch.ones(3))),
        "real_tensor": saving(lambda: torch.arange(10, dtype=torch.int16)),
        "real_tuple_of_tensors": saving(lambda: (torch.ones(2), torch.zeros(3, dtype=torch.int64))),
        "real_every_dtype": saving(_every_dtype),
        "real_views_and_shared_storages": saving(_views),
        "real_python_values": saving(_python_values),
        "real_optimizer": saving(_optimizer_state),
        "real_many_memo_entries": saving(lambda: {"names": [f"n{k}" for k in range(70000)],
                                                  "t": torch.ones(3)}),
        "real_many_tensors": saving(lambda: collections.OrderedDict(
            (f"layer.{k}.weight", torch.full((2,), float(k))) for k in range(3000))),
        "real_counter": saving(lambda: {"c": collections.Counter("abca"), "t": torch.ones(1)}),
        "real_set_and_device": saving(lambda: {"s": {1, 2}, "d": torch.device("cpu"), "b": b"\x00bytes"}),
    }


REAL = _real()


# -- the tests ------------------------------------------------------------------------------

HOSTILE = _hostile()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Every case, hostile and real, run by workers."""
    directory = tmp_path_factory.mktemp("cases")
    for name, case in HOSTILE.items():
        write_archive(directory / f"{name}.pt", case.pickle, case.storages)
    for name, write in REAL.items():
        write(directory / f"{name}.pt")
    return run_workers(directory)


def run_workers(directory: Path) -> dict[str, dict[str, Any]]:
    """Results of every case archive of ``directory``, from as many workers as it takes."""
    results: dict[str, dict[str, Any]] = {}
    env = dict(os.environ, PYTHONPATH=child_pythonpath(HERE, inherit=False))
    while True:
        todo = sorted(p for p in directory.glob("*.pt") if p.stem not in results)
        if not todo:
            return results
        proc = subprocess.run([sys.executable, __file__, "worker", str(directory)], env=env,
                              capture_output=True, text=True, timeout=600, preexec_fn=cap_address_space)
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                results[json.loads(line)["name"]] = json.loads(line)
        unreported = [p for p in todo if p.stem not in results]
        if proc.returncode != 0 and unreported:  # it died in the first case it did not report
            results[unreported[0].stem] = {"name": unreported[0].stem,
                                           "error": f"worker exit {proc.returncode}: {proc.stderr[-2000:]}"}
        for path in todo:
            if path.stem in results:
                path.unlink()


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_pickle_decided_as_torch_decides(name, results) -> None:
    _check(results[name])


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_checkpoint_loads_as_torch_loads(name, results) -> None:
    _check(results[name])
    assert results[name]["torch"] == "accept"


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(Path(sys.argv[2]))
