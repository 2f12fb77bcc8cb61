#!/usr/bin/env bash
# Run the whole test suite (GPU tests included) on a GPU machine with its own python3,
# or any other command given as arguments, in the test environment described below.
#
#   bash scripts/gpu_test.sh                  # pytest over tests/
#   bash scripts/gpu_test.sh python3 bench.py # any command, same environment
#
# Test-environment step (never something gdskit does on a user's machine): in a VM or
# container without a udev database, libcufile cannot tell which filesystem a file lives
# on and cuFileHandleRegister fails ("udev property not found: ID_FS_USAGE"). So that the
# cuFile backend can be exercised here, this script writes the two udev properties
# libcufile asks for, for the block device under the working directory, and removes
# them again on exit. `gdskit check` diagnoses the real problem (mount /run/udev).
set -uo pipefail
cd "$(dirname "$0")/.."
# src/, the stand-ins and the shared test helpers (as pyproject.toml gives pytest), for any command.
export PYTHONPATH="$PWD/src:$PWD/tests/stand_ins:$PWD/tests/support${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

created=()
cleanup() { for f in "${created[@]}"; do rm -f "$f"; done; [ -n "${made_dir:-}" ] && rmdir -p --ignore-fail-on-non-empty /run/udev/data 2>/dev/null; true; }
trap cleanup EXIT

if [ ! -d /run/udev/data ] && [ "$(id -u)" = 0 ]; then
    read -r majmin fstype < <($PY - <<'PYEOF'
import os
st = os.stat(".")
best = None
for line in open("/proc/self/mountinfo"):
    left, right = line.split(" - ", 1)
    f = left.split()
    if os.path.realpath(".").startswith(f[4]) and (best is None or len(f[4]) > len(best[1])):
        best = (f[2], f[4], right.split()[0])
print(best[0] if best else f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}", best[2] if best else "ext4")
PYEOF
)
    mkdir -p /run/udev/data && made_dir=1
    devs=("$majmin")
    # A partition's parent disk too (libcufile may look at either).
    sysdev=$(readlink -f "/sys/dev/block/$majmin" 2>/dev/null || true)
    if [ -n "$sysdev" ] && [ -f "$sysdev/partition" ]; then devs+=("$(cat "$(dirname "$sysdev")/dev")"); fi
    for d in "${devs[@]}"; do
        f="/run/udev/data/b$d"
        printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$fstype" > "$f" && created+=("$f")
    done
    echo "test environment: wrote udev properties for ${devs[*]} ($fstype)" >&2
fi

if [ $# -eq 0 ]; then
    $PY -m pytest -q -p no:cacheprovider tests
else
    "$@"
fi
