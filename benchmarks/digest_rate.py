"""``gdskit digest`` of one large checkpoint against the blake3 package's own rates, hot page cache.

What the CPU side of ``gdskit digest`` is held to: the blake3 package hashing the same file with
every core (``update_mmap`` with ``max_threads=AUTO``: the library's own way of hashing a file), and
the same bytes already in memory (one pass, every core). gdskit hashes each byte three times (the
file's digest, its chunk's and its tensor's), reading the file with positional reads on
``--readers`` threads (``auto``: what ``gdskit digest`` picks for one file), in pieces of
``READ_PIECE`` (``--pieces``: other sizes too). ``--in-memory-pieces``: the package's threads over
the bytes in memory, three digests fed in pieces as gdskit feeds them (what bounds gdskit there).
Rows are interleaved, ``--rounds`` times, in one process (``gdskit digest`` is one process too).
``--gpu`` adds the GPU digest (``device=0``).

    python benchmarks/digest_rate.py --dir /tmp/dr --gib 8 --rounds 3 --readers auto,1,2,4,8 \
        [--pieces 64] [--in-memory-pieces 16,64] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from made_once import file_made_once  # noqa: E402
from page_cache import warm  # noqa: E402


def make_file(path: str, gib: int) -> None:
    """A safetensors file of 32 MiB uint8 tensors (random bytes), ``gib`` GiB of data."""
    import numpy as np

    from gdskit.formats import safetensors_format as fmt

    n, nbytes = gib * 32, 32 << 20
    block = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    layout = fmt.packed_layout(fmt.TensorSpec(f"t{i:04d}", "U8", (nbytes,)) for i in range(n))
    tmp = path + ".part"
    with open(tmp, "wb") as fh:
        fh.write(layout.header)
        for i in range(n):  # packed in name order, as the layout places them
            block[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)  # no two tensors alike
            fh.write(block.tobytes())
    os.replace(tmp, path)


def gdskit_cpu(path: str, readers: int | None, piece_mib: int | None = None) -> float:
    from gdskit.formats import digest_scan
    from gdskit.verify import DEFAULT_CHUNK_BYTES

    spans = digest_scan.tensor_spans(path, "safetensors")
    default_piece = digest_scan.READ_PIECE
    if piece_mib:
        digest_scan.READ_PIECE = piece_mib << 20  # a trial of another read size, put back below
    try:
        t0 = time.perf_counter()
        digest_scan.digest_file(path, DEFAULT_CHUNK_BYTES, spans, readers=readers)
        return time.perf_counter() - t0
    finally:
        digest_scan.READ_PIECE = default_piece


def gdskit_gpu(path: str) -> float:
    from gdskit.formats import digest_scan
    from gdskit.verify import DEFAULT_CHUNK_BYTES

    spans = digest_scan.tensor_spans(path, "safetensors")
    t0 = time.perf_counter()
    digest_scan.digest_file(path, DEFAULT_CHUNK_BYTES, spans, device=0)
    return time.perf_counter() - t0


def library_file(path: str) -> float:
    import blake3

    t0 = time.perf_counter()
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(path)
    h.digest()
    return time.perf_counter() - t0


def library_memory(data: bytes) -> float:
    import blake3

    t0 = time.perf_counter()
    blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()
    return time.perf_counter() - t0


def library_pieces(data: bytes, piece: int, digests: int) -> float:
    """``digests`` running digests (every core each) fed the bytes in memory ``piece`` bytes at a
    time, taking turns as ``gdskit digest``'s file, chunk and tensor digests do; seconds per pass
    over the bytes (rates are of file bytes)."""
    import blake3

    view = memoryview(data)
    hashers = [blake3.blake3(max_threads=blake3.blake3.AUTO) for _ in range(digests)]
    t0 = time.perf_counter()
    for at in range(0, len(view), piece):
        for h in hashers:
            h.update(view[at:at + piece])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/gdskit-digest-rate")
    ap.add_argument("--gib", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--readers", default="auto,1,4", help="comma-separated reading threads (auto: gdskit's pick)")
    ap.add_argument("--pieces", default="", help="comma-separated read sizes in MiB to try beside the default")
    ap.add_argument("--in-memory-pieces", default="",
                    help="comma-separated MiB: also the bytes in memory fed to three digests in pieces of that size")
    ap.add_argument("--gpu", action="store_true", help="also the GPU digest (device 0)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    from gdskit.formats.digest_scan import readers_for

    path = file_made_once(args.dir, f"digest-{args.gib}g.safetensors", lambda p: make_file(p, args.gib))
    size = os.path.getsize(path)
    warm([path])
    with open(path, "rb") as fh:
        data = fh.read()
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds):
        runs = [("blake3 update_mmap, one pass", lambda: library_file(path)),
                ("blake3 in memory, one pass", lambda: library_memory(data))]
        for spec in args.readers.split(","):
            readers = readers_for(1) if spec == "auto" else int(spec)
            label = f"gdskit digest, {readers} readers" + (" (auto)" if spec == "auto" else "")
            runs.append((label, lambda readers=readers: gdskit_cpu(path, readers)))
            for mib in filter(None, args.pieces.split(",")):
                runs.append((f"{label}, {mib} MiB reads",
                             lambda readers=readers, mib=int(mib): gdskit_cpu(path, readers, mib)))
        for mib in filter(None, args.in_memory_pieces.split(",")):
            runs.append((f"blake3 in memory, three digests in {mib} MiB pieces",
                         lambda mib=int(mib): library_pieces(data, mib << 20, 3)))
        if args.gpu:
            runs.append(("gdskit digest on the GPU", lambda: gdskit_gpu(path)))
        for label, fn in (runs if r % 2 == 0 else runs[::-1]):
            rows.setdefault(label, []).append(size / fn() / 1e9)
    ceiling = statistics.median(rows["blake3 update_mmap, one pass"])
    print(f"{size / 1e9:.2f} GB, {os.cpu_count()} CPUs, {args.rounds} rounds (GB/s)")
    print(f"| {'what':<40} | median | min-max | of update_mmap |")
    for label, rates in rows.items():
        med = statistics.median(rates)
        print(f"| {label:<40} | {med:6.2f} | {min(rates):.2f}-{max(rates):.2f} | {med / ceiling:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"bytes": size, "cpus": os.cpu_count(), "rounds": args.rounds, "gbps": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
