#!/usr/bin/env bash
# Install Horovod (scripts/versions.env: 0.28.1; PyTorch, Gloo and — where OpenMPI is installed — MPI; CPU,
# or NCCL on GPUs with HOROVOD_GPU_OPERATIONS=NCCL) into the active Python environment. With MPI, one wheel runs both launch paths laneflow uses:
# `horovodrun --gloo` locally and `horovodrun --hostfile` (mpirun) as the MPI operator's launcher does.
#
# Why a script: Horovod's last release does not build against current torch out of the box
# (C++17 is required by torch headers, CMake >= 4 rejects its old policy). Building takes
# ~12 minutes on 2 cores, so the wheel is built once into a cache outside the checkout and
# reused by every later install (fresh clones and CI on the same machine included).
#
# Usage: scripts/install_horovod.sh [PYTHON]      (default: python from PATH)
#        scripts/install_horovod.sh --cache-dir    (print the wheel cache folder these settings use, and exit)
# Env:   LANEFLOW_WHEEL_CACHE  wheel cache dir     (default: ~/.cache/laneflow/wheels)
#        HOROVOD_GPU_OPERATIONS=NCCL               (GPU images; default CPU only). Needs nvcc and NCCL:
#                                                  HOROVOD_CUDA_HOME, HOROVOD_NCCL_* as scripts/cuda_from_wheels.sh
#                                                  prints them; HOROVOD_BUILD_CUDA_CC_LIST (e.g. 80,90) the GPU
#                                                  architectures (Horovod's default: every one nvcc knows)
#        LANEFLOW_HOROVOD_MPI=0|1                  (default: 1 when mpicc is on PATH — Debian's libopenmpi-dev)
set -euo pipefail

PY=${1:-python}
# shellcheck source=versions.env
. "$(dirname "$0")/versions.env"
CACHE=${LANEFLOW_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/laneflow/wheels}
# A GPU build must never be mistaken for the CPU one: keep them in separate cache folders. GPU wheels differ
# again by the CUDA release they were compiled against and the GPU architectures they carry code for.
GPU_OPS=${HOROVOD_GPU_OPERATIONS:-}
if [ -n "$GPU_OPS" ]; then
    ARCHS=${HOROVOD_BUILD_CUDA_CC_LIST:+sm${HOROVOD_BUILD_CUDA_CC_LIST//,/_}}
    FLAVOUR="gpu-${GPU_OPS,,}-cu${TORCH_CUDA_VERSION//./}-${ARCHS:-small}"
else
    FLAVOUR=cpu
fi
if [ -z "${LANEFLOW_HOROVOD_MPI:-}" ]; then
    if command -v mpicc >/dev/null 2>&1; then LANEFLOW_HOROVOD_MPI=1; else LANEFLOW_HOROVOD_MPI=0; fi
fi
# With and without MPI are different wheels: a wheel without MPI must never satisfy a machine with it.
[ "$LANEFLOW_HOROVOD_MPI" = 1 ] && FLAVOUR="$FLAVOUR-mpi"
CACHE="$CACHE/horovod-$FLAVOUR"
if [ "$PY" = --cache-dir ]; then
    echo "$CACHE"
    exit 0
fi

die() { echo "install_horovod: error: $*" >&2; exit 1; }
log() { echo "install_horovod: $*"; }

command -v "$PY" >/dev/null 2>&1 || die "python interpreter '$PY' not found; pass the venv's python as the first argument"

check_build() {
    local out
    out=$("$PY" -m horovod.runner.launch --check-build 2>&1) || return 1
    grep -q '\[X\] PyTorch' <<<"$out" && grep -q '\[X\] Gloo' <<<"$out" || return 1
    [ "$LANEFLOW_HOROVOD_MPI" != 1 ] || grep -q '\[X\] MPI' <<<"$out" || return 1
    [ "$GPU_OPS" != NCCL ] || grep -q '\[X\] NCCL' <<<"$out"
}
WANTED="PyTorch + Gloo"
[ "$LANEFLOW_HOROVOD_MPI" = 1 ] && WANTED="$WANTED + MPI"
[ "$GPU_OPS" = NCCL ] && WANTED="$WANTED + NCCL"

if "$PY" -c "import horovod, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" 2>/dev/null && check_build; then
    log "horovod $HOROVOD_VERSION with $WANTED already installed"
    exit 0
fi

"$PY" -c "import torch" 2>/dev/null || die "torch is not installed in '$PY'; install it first (pip install torch==2.13.0)"

mkdir -p "$CACHE"
wheel=$(ls "$CACHE"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -1 || true)

if [ -z "$wheel" ]; then
    log "no cached wheel in $CACHE; building horovod $HOROVOD_VERSION ($WANTED) from source (~6-12 min on 2 cores)"
    for tool in g++ make; do
        command -v "$tool" >/dev/null 2>&1 || die "'$tool' is required to build horovod; install it (Debian: apt-get install -y build-essential)"
    done
    if [ -n "$GPU_OPS" ]; then
        nvcc=${HOROVOD_CUDA_HOME:+$HOROVOD_CUDA_HOME/bin/}nvcc
        command -v "$nvcc" >/dev/null 2>&1 \
            || die "HOROVOD_GPU_OPERATIONS=$GPU_OPS needs nvcc ('$nvcc' not found); with torch's CUDA build from PyPI: eval \"\$(scripts/cuda_from_wheels.sh $PY)\" first"
        log "compiling for GPUs: $("$nvcc" --version | tail -1), architectures ${HOROVOD_BUILD_CUDA_CC_LIST:-all nvcc knows}, NCCL ${HOROVOD_NCCL_HOME:-from the CUDA home}"
    fi
    # Build-time Python packages (no build isolation: horovod must see the installed torch).
    "$PY" -m pip install -q numpy cloudpickle psutil pyyaml packaging cffi wheel setuptools \
        || die "could not install horovod's build requirements (numpy cloudpickle psutil pyyaml packaging cffi)"
    if ! command -v cmake >/dev/null 2>&1; then
        "$PY" -m pip install -q 'cmake<4' || die "cmake not found and 'pip install cmake<4' failed"
        PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"
    fi
    export CMAKE_POLICY_VERSION_MINIMUM=3.5

    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION" \
        || die "could not download the horovod $HOROVOD_VERSION sdist from the package index"
    tar -xzf "$work"/horovod-"$HOROVOD_VERSION".tar.gz -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"
    # torch >= 2.1 headers need C++17; horovod 0.28.1 pins C++14.
    for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
        [ -f "$f" ] || die "expected $f in the sdist; has the horovod sdist layout changed?"
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
        grep -q 'set(CMAKE_CXX_STANDARD 17)' "$f" || die "could not switch $f to C++17"
    done

    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    if [ "$LANEFLOW_HOROVOD_MPI" = 1 ]; then
        command -v mpicc >/dev/null 2>&1 || die "LANEFLOW_HOROVOD_MPI=1 needs OpenMPI's mpicc (Debian: apt-get install -y openmpi-bin libopenmpi-dev)"
        export HOROVOD_WITH_MPI=1
    else
        export HOROVOD_WITHOUT_MPI=1
    fi
    export HOROVOD_CPU_OPERATIONS=${HOROVOD_CPU_OPERATIONS:-GLOO}
    export MAKEFLAGS="-j$(nproc)"
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$src" \
        || die "horovod build failed (see the compiler output above)"
    wheel_built=$(ls "$work"/dist/horovod-*.whl | head -1)
    # Copy then rename so a half-written wheel is never taken from the cache.
    cp "$wheel_built" "$CACHE/.partial.whl"
    wheel="$CACHE/$(basename "$wheel_built")"
    mv "$CACHE/.partial.whl" "$wheel"
    log "cached $wheel"
else
    log "using cached wheel $wheel"
fi

"$PY" -m pip install -q cloudpickle psutil pyyaml packaging cffi || die "could not install horovod's runtime requirements"
"$PY" -m pip install -q --no-deps --force-reinstall "$wheel" || die "could not install $wheel"
check_build || die "horovod installed but 'horovodrun --check-build' does not list $WANTED; delete $wheel and rerun to rebuild"
log "horovod $HOROVOD_VERSION ready ($WANTED)"
