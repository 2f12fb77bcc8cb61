"""Where a verified load's extra time goes: ``gdskit.safetensors.load_file`` of one safetensors
file (digests in its header), plain and verified alternating, in one process after a first load
of each (so every row is a second call: the kernels are ready, the header remembered), each load
timed whole and in parts:

- finding the expected digests (``gdskit.formats.verified.expectations``),
- the reads (``gdskit.formats.torch_io.execute``, every run of the file; on a GPU it includes
  queueing the first tensors' kernels while the last tensors are read),
- starting the digests (``start_tensor_digests``: kernels queued for GPU memory, not waited for),
- waiting for the digests (``StartedTensorDigests.result``),
- comparing the digests (``gdskit.verify.check_tensors``).

Each part is timed by wrapping the function the loader calls, with a device synchronize at its
end (so a part's time includes the GPU work it queued). Medians of ``--loads`` loads of each.

    python benchmarks/verify_parts.py --dir /tmp/vp --gib 8 --loads 6 [--device cuda:0] [--json parts.json]

With ``--device cpu`` the hashing overlaps the reads on worker threads (host memory), so the
parts there add up to more than the whole.
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
from verify_load import make_file  # noqa: E402

PARTS = {  # label: (module, attribute, synchronize at its end), wrapped where the loader finds it at call time
    "expected digests": ("gdskit.safetensors", "expectations", True),
    "reads": ("gdskit.formats.torch_io", "execute", True),
    # Kernels queued while the last reads run (not synchronized here: that would stop the overlap),
    # then read back at the end: the wait is what the load pays for them.
    "hashing started": ("gdskit.formats.verified", "start_tensor_digests", False),
    "hashing waited for": ("gdskit.formats.verified", "StartedTensorDigests.result", True),
    "comparing": ("gdskit.verify", "check_tensors", True),
}


def _wrap_parts(times: dict[str, float], sync) -> None:
    import importlib

    for label, (module_name, name, synchronize) in PARTS.items():
        owner = importlib.import_module(module_name)
        *classes, attr = name.split(".")
        for cls in classes:
            owner = getattr(owner, cls)
        inner = getattr(owner, attr)

        def timed(*args, _inner=inner, _label=label, _sync=synchronize, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                if _sync:
                    sync()
                times[_label] = times.get(_label, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/gdskit-verify-parts")
    ap.add_argument("--gib", type=int, default=2)
    ap.add_argument("--loads", type=int, default=6, help="timed loads of each (plain, verified), alternating")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--json", help="write every load's parts here")
    args = ap.parse_args()
    import torch

    import gdskit.safetensors as gs

    path = file_made_once(args.dir, f"parts-{args.gib}g.safetensors", lambda p: make_file(p, args.gib, args.device))
    on_gpu = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    if on_gpu:
        torch.zeros(1, device=args.device)  # the CUDA context, outside the timings
    times: dict[str, float] = {}
    _wrap_parts(times, sync)
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for i in range(args.loads + 1):
        for verify in ((False, True) if i % 2 == 0 else (True, False)):
            times.clear()
            sync()
            t0 = time.perf_counter()
            out = gs.load_file(path, device=args.device, verify=verify)
            sync()
            row = {"whole": time.perf_counter() - t0, **times}
            del out
            if i:  # the first of each readies kernels and caches: not a second call
                rows[verify].append(row)
    size = os.path.getsize(path)
    print(f"{size / 1e9:.2f} GB into {args.device}, {args.loads} loads of each, ms (median)")
    labels = ["whole", *PARTS]
    print("| | " + " | ".join(labels) + " |")
    for verify, mine in rows.items():
        cells = [f"{1e3 * statistics.median(r.get(k, 0.0) for r in mine):.1f}" for k in labels]
        print(f"| {'verified' if verify else 'plain'} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"bytes": size, "device": args.device, "loads": {str(k): v for k, v in rows.items()}}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
