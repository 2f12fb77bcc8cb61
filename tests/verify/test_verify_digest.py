"""gdskit's BLAKE3 digests on the CPU, and the GPU kernel's source run on the CPU: both equal the
blake3 package's digests and BLAKE3's published test vectors."""

from __future__ import annotations

import ctypes
import os
import random

import blake3
import pytest
from hypothesis import given, settings, strategies as st

from blake3_vectors import VECTORS, vector_input
from cpu_kernel import build_with_harness
from gdskit.errors import FormatError
from gdskit.verify import blake3_hex, chunk_ranges, tagged


@pytest.mark.parametrize("n", sorted(VECTORS))
def test_cpu_digest_matches_the_published_vectors(n):
    assert blake3_hex(vector_input(n)) == VECTORS[n]


@given(st.binary(max_size=5000))
@settings(max_examples=60, deadline=None)
def test_cpu_digest_matches_the_blake3_package(data):
    assert blake3_hex(data) == blake3.blake3(data).hexdigest()
    assert blake3_hex(bytearray(data)) == blake3.blake3(data).hexdigest()
    assert blake3_hex(memoryview(data)) == blake3.blake3(data).hexdigest()


def test_a_large_input_is_hashed_across_threads_to_the_same_digest():
    data = os.urandom(5 << 20)
    assert blake3_hex(data) == blake3.blake3(data).hexdigest()


def test_chunk_ranges_cover_the_file_in_order():
    assert list(chunk_ranges(0, 1024)) == []
    assert list(chunk_ranges(2500, 1024)) == [(0, 1024), (1024, 2048), (2048, 2500)]
    assert tagged("ab") == "blake3:ab"


# -- the kernel's C source, compiled as C++ and run on the CPU --------------------------

_HARNESS = r"""
#include <vector>
#define __device__
#define __forceinline__ inline
#define __global__
struct uint4 { unsigned x, y, z, w; };
#define BLAKE3_HOST_TEST
#include "kernel.cu"
/* The two kernels' sequence, thread by thread: each phase runs for every thread before the next
   (the __syncthreads between them on the GPU). */
extern "C" void digest(const u8** ptrs, const u64* lens, int n, u32* roots) {
    std::vector<Item> items(n);
    std::vector<u64> base(n + 1);
    base[0] = 0;
    for (int i = 0; i < n; ++i) {
        items[i].ptr = (u64)ptrs[i]; items[i].len = lens[i];
        base[i + 1] = base[i] + (chunks_of(lens[i]) + BLOCK_CHUNKS - 1) / BLOCK_CHUNKS;
    }
    std::vector<u32> cvs(8 * base[n]);
    std::vector<u32> nodes(8 * BLOCK_CHUNKS);
    for (u64 b = 0; b < base[n]; ++b) {
        int item = item_of(base.data(), n, b);
        u32 k = 0;
        for (u32 t = 0; t < BLOCK_CHUNKS; ++t) k = block_chunks(items.data(), base.data(), item, b, t, nodes.data());
        int single = base[item + 1] - base[item] == 1;
        for (u32 level = 0; level < 8; ++level)
            for (u32 t = 0; t < BLOCK_CHUNKS; ++t) block_level(k, level, t, single, nodes.data());
        for (u32 t = 0; t < 8; ++t) {
            cvs[8 * b + t] = nodes[t * BLOCK_CHUNKS];
            if (single) roots[8 * item + t] = nodes[t * BLOCK_CHUNKS];
        }
    }
    for (int item = 0; item < n; ++item) {
        u64 b0 = base[item], m = base[item + 1] - b0;
        if (m <= 1) continue;
        for (u64 stride = 1; stride < m; stride <<= 1) {
            u64 pairs = ((m + stride - 1) / stride) / 2;
            for (u64 p = 0; p < pairs; ++p) tree_pair(cvs.data(), b0, m, stride, p, roots + 8 * item);
        }
    }
}
"""


@pytest.fixture(scope="module")
def kernel_on_cpu(tmp_path_factory):
    dll = build_with_harness(tmp_path_factory.mktemp("kernel"), _HARNESS)

    def digest(buffers: list[bytes], shift: int = 0) -> list[str]:
        """Digests of ``buffers``, each placed ``shift`` bytes past an aligned address."""
        n = len(buffers)
        keep = [ctypes.create_string_buffer(b"\x00" * shift + b, shift + len(b) or 1) for b in buffers]
        ptrs = (ctypes.c_void_p * n)(*[ctypes.addressof(k) + shift for k in keep])
        lens = (ctypes.c_uint64 * n)(*[len(b) for b in buffers])
        roots = (ctypes.c_uint32 * (8 * n))()
        dll.digest(ptrs, lens, n, roots)
        raw = bytes(roots)
        return [raw[32 * i:32 * i + 32].hex() for i in range(n)]

    return digest


def test_the_kernel_source_gives_the_published_vectors(kernel_on_cpu):
    lengths = sorted(VECTORS)
    assert kernel_on_cpu([vector_input(n) for n in lengths]) == [VECTORS[n] for n in lengths]


def test_the_kernel_source_matches_blake3_at_block_and_tree_boundaries(kernel_on_cpu):
    # 256 KiB is one thread block's subtree: around it and its multiples the tree kernel takes over.
    block = 256 << 10
    rng = random.Random(7)
    lengths = [block - 1, block, block + 1, 2 * block, 3 * block + 5, 7 * block - 1024, 9 * block + 1023,
               *(rng.randrange(0, 4 << 20) for _ in range(6))]
    data = [rng.randbytes(n) for n in lengths]
    assert kernel_on_cpu(data) == [blake3.blake3(d).hexdigest() for d in data]


def test_the_kernel_source_handles_unaligned_inputs(kernel_on_cpu):
    data = [os.urandom(n) for n in (70000, 1024, 64, 300000)]
    for shift in (1, 2, 3, 8):  # not 16-byte aligned: the kernel's byte loads
        assert kernel_on_cpu(data, shift) == [blake3.blake3(d).hexdigest() for d in data]


# -- digests of a file in one pass (gdskit digest) ------------------------------------------

from gdskit.formats.digest_scan import READ_PIECE, Span, digest_file  # noqa: E402


@given(data=st.binary(max_size=20_000), chunk_log=st.integers(min_value=10, max_value=15),
       raw_spans=st.lists(st.tuples(st.integers(min_value=0, max_value=20_000), st.integers(min_value=0, max_value=9_000)),
                          max_size=6))
@settings(max_examples=60, deadline=None)
def test_one_pass_digests_equal_the_blake3_package_on_each_slice(tmp_path_factory, data, chunk_log, raw_spans):
    path = tmp_path_factory.mktemp("f") / "data.bin"
    path.write_bytes(data)
    chunk = 1 << chunk_log
    spans = [Span(f"s{i}", min(o, len(data)), min(n, len(data) - min(o, len(data)))) for i, (o, n) in enumerate(raw_spans)]
    got = digest_file(str(path), chunk, spans)  # spans may overlap and be empty
    assert got.size == len(data) and got.digest == blake3.blake3(data).hexdigest()
    assert list(got.chunks) == [blake3.blake3(data[i:i + chunk]).hexdigest() for i in range(0, len(data), chunk)]
    for s in spans:
        assert got.tensors[s.name].digest == blake3.blake3(data[s.offset:s.offset + s.nbytes]).hexdigest()


def test_pieces_smaller_than_a_chunk_add_up(tmp_path):
    data = os.urandom(2 * READ_PIECE + 12345)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    spans = [Span("across", READ_PIECE - 100, READ_PIECE + 200)]
    got = digest_file(str(path), 4 * READ_PIECE, spans)  # one chunk, read in three pieces
    assert got.chunks == (blake3.blake3(data).hexdigest(),) and got.digest == got.chunks[0]
    assert got.tensors["across"].digest == blake3.blake3(data[READ_PIECE - 100:2 * READ_PIECE + 100]).hexdigest()


@pytest.mark.parametrize("readers", [1, 2, 3, 7])
def test_pieces_read_ahead_on_several_threads_are_hashed_in_file_order(tmp_path, readers):
    # 37 pieces of 1 KiB (chunk_bytes sets the piece) read by up to 7 threads into readers + 1
    # buffers: a buffer reused before its piece was hashed, or pieces fed out of order, changes
    # the file's, the chunks' and the span's digests.
    data = os.urandom(37 * 1024 - 5)
    path = tmp_path / "pieces.bin"
    path.write_bytes(data)
    spans = [Span("middle", 3000, 20000), Span("tail", len(data) - 1500, 1500)]
    got = digest_file(str(path), 1024, spans, readers=readers)
    assert got.digest == blake3.blake3(data).hexdigest()
    assert list(got.chunks) == [blake3.blake3(data[i:i + 1024]).hexdigest() for i in range(0, len(data), 1024)]
    assert got.tensors["middle"].digest == blake3.blake3(data[3000:23000]).hexdigest()
    assert got.tensors["tail"].digest == blake3.blake3(data[-1500:]).hexdigest()


def test_a_file_that_shrinks_while_pieces_are_read_ahead_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "shrinking.bin"
    path.write_bytes(os.urandom(64 * 1024))
    real_preadv = os.preadv
    calls = []

    def preadv_then_truncate(fd, buffers, offset):  # the file loses its second half after the first read
        calls.append(offset)
        if len(calls) == 1:
            os.truncate(path, 32 * 1024)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv_then_truncate)
    with pytest.raises(FormatError, match="shrank"):
        digest_file(str(path), 4096, [], readers=4)
