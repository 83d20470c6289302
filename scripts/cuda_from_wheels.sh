#!/usr/bin/env bash
# Make the CUDA toolkit that Horovod's GPU build needs out of PyPI wheels, beside torch's CUDA build, in the
# active Python environment: no CUDA base image, no NVIDIA apt repository, no GPU and no driver.
#
# torch's PyPI wheel already depends on CUDA's runtime libraries, cuDNN and NCCL as nvidia-* wheels
# (site-packages/nvidia/cu13, site-packages/nvidia/nccl) and loads those. This script adds what compiling
# against them takes, at the CUDA release torch pins (its `cuda-toolkit==X` requirement, which must be
# scripts/versions.env TORCH_CUDA_VERSION): `cuda-toolkit[nvcc,cccl]==X` (nvcc, cicc, ptxas, the crt and
# runtime headers, libcudart_static.a, CCCL's headers), and the few names the wheels leave out that a
# toolkit install has:
#   <cuda>/lib64 -> lib                   nvcc.profile links from lib64 (cudart_static, cudadevrt): without it
#                                          even CMake's CUDA compiler check fails to link
#   <cuda>/lib/libcudart.so -> .so.13      torch's CUDAExtension names `cudart`; find_library needs the dev name
#   <nccl>/lib/libnccl.so -> .so.2         Horovod links torch's NCCL, shared (the wheel has no libnccl_static.a)
#   /usr/local/cuda -> <cuda>              the default CUDA home of torch.utils.cpp_extension and Horovod's
#                                          build (only where nothing is there yet and we may write)
# So Horovod compiles against exactly the CUDA and NCCL that torch loads: one of each in the process.
#
# Usage: scripts/cuda_from_wheels.sh [PYTHON]     (default: python from PATH; torch's CUDA build installed)
# Prints, on stdout, the environment Horovod's build reads (CUDA_HOME, HOROVOD_CUDA_HOME, HOROVOD_NCCL_*),
# as `export` lines for `eval`; everything else goes to stderr. Idempotent.
set -euo pipefail

PY=${1:-python}
# shellcheck source=versions.env
. "$(dirname "$0")/versions.env"

die() { echo "cuda_from_wheels: error: $*" >&2; exit 1; }
log() { echo "cuda_from_wheels: $*" >&2; }

command -v "$PY" >/dev/null 2>&1 || die "python interpreter '$PY' not found"

# torch's own pin of the toolkit, e.g. `cuda-toolkit[cublas,...]==13.0.3; platform_system == "Linux"`.
pin=$("$PY" - <<'EOF'
import re
from importlib.metadata import PackageNotFoundError, requires
try:
    reqs = requires("torch") or []
except PackageNotFoundError:
    raise SystemExit(0)
for req in reqs:
    found = re.match(r"cuda-toolkit\s*(\[[^\]]*\])?\s*==\s*([0-9][0-9.]*)", req)
    if found and "extra ==" not in req:
        print(found.group(2))
        break
EOF
) || die "could not read torch's requirements with '$PY'"
[ -n "$pin" ] || die "the installed torch does not require cuda-toolkit: install torch's CUDA build from PyPI first (pip install torch===$TORCH_VERSION)"
case "$pin" in
    "$TORCH_CUDA_VERSION" | "$TORCH_CUDA_VERSION".*) ;;
    *) die "torch requires cuda-toolkit $pin, but scripts/versions.env says TORCH_CUDA_VERSION=$TORCH_CUDA_VERSION" ;;
esac
major=${pin%%.*}

log "installing cuda-toolkit[nvcc,cccl]==$pin (torch's CUDA release) for compiling against it"
"$PY" -m pip install -q "cuda-toolkit[nvcc,cccl]==$pin" >&2 \
    || die "pip install 'cuda-toolkit[nvcc,cccl]==$pin' failed"

site=$("$PY" -c "import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))") \
    || die "no 'nvidia' package in '$PY' (torch's nvidia-* wheels are missing)"
cuda="$site/nvidia/cu$major"
nccl="$site/nvidia/nccl"
[ -x "$cuda/bin/nvcc" ] || die "no nvcc at $cuda/bin/nvcc after installing nvidia-cuda-nvcc"
[ -f "$cuda/lib/libcudart.so.$major" ] || die "no libcudart.so.$major in $cuda/lib (nvidia-cuda-runtime)"
[ -f "$nccl/include/nccl.h" ] && [ -f "$nccl/lib/libnccl.so.2" ] \
    || die "no NCCL in $nccl (torch's nvidia-nccl-cu$major wheel)"

[ -e "$cuda/lib64" ] || ln -s lib "$cuda/lib64"
ln -sfn "libcudart.so.$major" "$cuda/lib/libcudart.so"
ln -sfn libnccl.so.2 "$nccl/lib/libnccl.so"
if [ ! -e /usr/local/cuda ] && [ ! -L /usr/local/cuda ] && [ -w /usr/local ]; then
    ln -s "$cuda" /usr/local/cuda
fi
log "CUDA $("$cuda/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p') at $cuda, NCCL at $nccl"

cat <<EOF
export CUDA_HOME='$cuda' HOROVOD_CUDA_HOME='$cuda'
export HOROVOD_NCCL_HOME='$nccl' HOROVOD_NCCL_INCLUDE='$nccl/include' HOROVOD_NCCL_LIB='$nccl/lib' HOROVOD_NCCL_LINK=SHARED
EOF
