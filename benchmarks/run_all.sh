#!/usr/bin/env bash
# Every GPU benchmark of benchmarks/RESULTS.md in one go, each step under its own time limit,
# logs and JSON into OUTDIR (fio, KvikIO and the peer loaders are used when installed).
#
#   bash benchmarks/run_all.sh OUTDIR [WORKDIR]
#
# WORKDIR (default /tmp/gdskit-bench) holds the data files on the filesystem under test; it
# needs about 40 GiB free. Run on the GPU machine through scripts/gpu_test.sh, e.g.
#   bash scripts/gpu_test.sh bash benchmarks/run_all.sh /tmp/results /data/bench
# All steps take about 20 minutes; STEPS="first_call dcp" runs only those (names below).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: run_all.sh OUTDIR [WORKDIR]}
work=${2:-/tmp/gdskit-bench}
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2; shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
    echo "== $name (limit ${limit}s)" >&2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "   exit $rc ($(tail -n 1 "$out/$name.log"))" >&2
    [ "$rc" = 0 ] || failed="${failed:-} $name"
}

step first_call 120 $PY benchmarks/first_call.py --file "$work/fc.bin" --size 8GiB --repeats 1 --json "$out/first_call.json"
rm -f "$work/fc.bin"
step loaders_large 300 $PY benchmarks/loaders.py --dir "$work/ld" --size 8 --files large --cold --breakdown \
    --json "$out/loaders_large.json"
step loaders_small 200 $PY benchmarks/loaders.py --dir "$work/ld" --size 8 --files small --cold --breakdown \
    --loaders gdskit,gdskit-torch,safetensors,fastsafetensors-nogds,torch-mmap --json "$out/loaders_small.json"
rm -rf "$work/ld"
step dcp 300 $PY benchmarks/dcp.py --dir "$work/dcp" --size 8GiB --threads 1,8,16 --cold --cold-pairs 3 \
    --json "$out/dcp.json"
rm -rf "$work/dcp"
ngpu=$($PY -c "from gdskit import cuda; print(cuda.device_count())" 2>/dev/null || echo 0)
if [ "${ngpu:-0}" -ge 2 ]; then  # one rank per GPU
    step dcp_ranks 400 $PY benchmarks/dcp.py --dir "$work/dcp2" --size 8GiB --ranks "$ngpu" --threads 8,16 --cold \
        --cold-pairs 1 --json "$out/dcp_ranks.json"
    rm -rf "$work/dcp2"
fi
if command -v fio > /dev/null; then
    step fio_4 200 $PY benchmarks/bench_vs_fio.py --file "$work/fio.bin" --size 2G --workers 4 --reps 4 --runtime 3 --keep
    step fio_1 150 $PY benchmarks/bench_vs_fio.py --file "$work/fio.bin" --size 2G --workers 1 --reps 4 --runtime 3
    rm -f "$work"/fio.bin.*  # four files, kept by the first step for the second
fi
if [ -n "${failed:-}" ]; then echo "failed:$failed" >&2; exit 1; fi
