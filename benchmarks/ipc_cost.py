#!/usr/bin/env python3
"""What the resident loader pays per request for a client's memory: CUDA IPC handles of a fresh
process's tensors (256 of 32 MiB each, or one 8 GiB allocation viewed 256 times), opened and
closed in a warm process, with the copy rate into the mapped memory; and what importing
``cuda.bindings.driver`` costs a fresh process with torch's context made, against the five
ctypes declarations the resident client uses instead. Three rounds, each kind in a fresh client.

    python benchmarks/ipc_cost.py            # NT=64 for fewer tensors
"""
import json, os, subprocess, sys, time

N = int(os.environ.get("NT", "256")); MIB = 1 << 20; SZ = 32 * MIB

def client():
    import torch
    torch.cuda.init(); torch.empty(1, device="cuda"); torch.cuda.synchronize()
    t = time.perf_counter(); import cuda.bindings.driver as d; t_b = time.perf_counter() - t
    t = time.perf_counter()
    import ctypes
    lib = ctypes.CDLL("libcuda.so.1")
    for name in ["cuMemcpyHtoDAsync_v2", "cuMemHostRegister_v2", "cuEventRecord", "cuEventSynchronize",
                 "cuStreamCreate", "cuEventCreate", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuPointerGetAttribute",
                 "cuMemHostUnregister", "cuStreamSynchronize", "cuDevicePrimaryCtxRetain"]:
        f = getattr(lib, name); f.restype = ctypes.c_int
    t_c = time.perf_counter() - t
    single = os.environ.get("SINGLE") == "1"
    t = time.perf_counter()
    if single:
        blob = torch.empty(N * SZ, dtype=torch.uint8, device="cuda")
        ts = [blob[i * SZ:(i + 1) * SZ] for i in range(N)]
    else:
        ts = [torch.empty(SZ, dtype=torch.uint8, device="cuda") for _ in range(N)]
    torch.cuda.synchronize(); t_alloc = time.perf_counter() - t
    t = time.perf_counter()
    out, bases = [], {}
    for x in ts:
        err, base, size = d.cuMemGetAddressRange(x.data_ptr())
        b = int(base)
        if b not in bases:
            err2, h = d.cuIpcGetMemHandle(b)
            assert err2 == 0, err2
            bases[b] = (bytes(h.reserved).hex(), size)
        out.append([b, x.data_ptr() - b])
    t_h = time.perf_counter() - t
    print(json.dumps({"bindings_ms": 1e3 * t_b, "ctypes_ms": 1e3 * t_c, "alloc_ms": 1e3 * t_alloc,
                      "handles_ms": 1e3 * t_h, "segments": len(bases),
                      "bases": {str(k): v for k, v in bases.items()}, "tensors": out}), flush=True)
    sys.stdin.readline()  # the server has written
    ok = all(int(x[0].item()) == (i % 251) and int(x[-1].item()) == (i % 251) for i, x in enumerate(ts))
    print(json.dumps({"ok": ok}), flush=True)

def server():
    import ctypes
    from cuda.bindings import driver as d
    d.cuInit(0); _, dev = d.cuDeviceGet(0); _, ctx = d.cuDevicePrimaryCtxRetain(dev); d.cuCtxSetCurrent(ctx)
    _, stream = d.cuStreamCreate(0)
    host = [ctypes.create_string_buffer(SZ) for _ in range(2)]
    for h in host: d.cuMemHostRegister(ctypes.addressof(h), SZ, 0)
    res = []
    for rnd in range(3):
        for single in ("0", "1"):
            env = dict(os.environ, SINGLE=single)
            p = subprocess.Popen([sys.executable, __file__, "client"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            info = json.loads(p.stdout.readline())
            t = time.perf_counter(); opened = {}
            for b, (hx, size) in info["bases"].items():
                h = d.CUipcMemHandle(); h.reserved = bytes.fromhex(hx)
                err, ptr = d.cuIpcOpenMemHandle(h, d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                assert err == 0, err
                opened[int(b)] = int(ptr)
            t_open = time.perf_counter() - t
            for i, (b, off) in enumerate(info["tensors"]):
                ctypes.memset(ctypes.addressof(host[i % 2]), i % 251, SZ)
                # (two host stages, serialised per copy: this times the copies, not a ring)
                d.cuMemcpyHtoDAsync(opened[b] + off, ctypes.addressof(host[i % 2]), SZ, stream); d.cuStreamSynchronize(stream)
            t = time.perf_counter()
            for i, (b, off) in enumerate(info["tensors"]):
                d.cuMemcpyHtoDAsync(opened[b] + off, ctypes.addressof(host[i % 2]), SZ, stream)
            d.cuStreamSynchronize(stream); t_copy = time.perf_counter() - t
            for i, (b, off) in enumerate(info["tensors"]):  # put the pattern back
                ctypes.memset(ctypes.addressof(host[0]), i % 251, SZ)
                d.cuMemcpyHtoDAsync(opened[b] + off, ctypes.addressof(host[0]), SZ, stream); d.cuStreamSynchronize(stream)
            t = time.perf_counter()
            for ptr in opened.values(): d.cuIpcCloseMemHandle(ptr)
            t_close = time.perf_counter() - t
            p.stdin.write("go\n"); p.stdin.flush()
            ok = json.loads(p.stdout.readline())["ok"]; p.wait()
            row = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in info.items() if k not in ("bases", "tensors")}
            row.update(single=single, open_ms=round(1e3 * t_open, 2), close_ms=round(1e3 * t_close, 2),
                       copy_GBps=round(N * SZ / t_copy / 1e9, 1), data_ok=ok)
            print(json.dumps(row), flush=True); res.append(row)

if __name__ == "__main__":
    client() if sys.argv[1:] == ["client"] else server()
