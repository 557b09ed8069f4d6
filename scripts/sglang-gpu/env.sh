# Sourced on the H200 device after scripts/sglang-gpu/install.sh: SGLang's site first, then hpkv from this
# tree. SGLang compiles a few kernels at first use with nvcc (tvm-ffi), cached in TVM_FFI_CACHE_DIR.
SGL_SITE=${SGL_SITE:-/root/sgl-site}
[ -d "$SGL_SITE/sglang" ] || { echo "no SGLang in $SGL_SITE: run the two carry calls and \
scripts/sglang-gpu/install.sh first (scripts/sglang-gpu/prepare.sh's header)"; return 1 2>/dev/null || exit 1; }
if [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda
elif command -v nvcc >/dev/null; then CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); export CUDA_HOME
fi
export PATH="$PATH:${CUDA_HOME:-/usr/local/cuda}/bin:$SGL_SITE/bin"
export PYTHONPATH="$SGL_SITE:$(pwd)/src:$(pwd)"
export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/root/tvmffi} SGLANG_IS_FLASHINFER_AVAILABLE=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# A call stopped at its time limit leaves its servers holding the GPU: stop any left over.
pkill -9 -f "[s]glang.launch_server" 2>/dev/null || true; pkill -9 -f "[s]glang::" 2>/dev/null || true
