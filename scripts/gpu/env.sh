# Sourced by every script here. vLLM comes from the Python environment, or, on a machine without a package
# index, from /root/site where scripts/gpu/install.sh put the carried one (scripts/gpu/README.md); hpkv from
# this tree either way. Outputs go to $OUT (default out/gpu), the 7B-shaped model to $M7B (default /root/m7b).
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export OUT=${OUT:-$(pwd)/out/gpu} M7B=${M7B:-/root/m7b}
mkdir -p "$OUT"
if [ -d /root/site/vllm ]; then
  export PYTHONPATH=/root/site
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /root/site . >/dev/null 2>&1
  # A call stopped at its time limit leaves its vLLM servers holding the GPU, and the next call's first
  # start then fails ("Engine core initialization failed"): stop any left over (this machine runs only these).
  pkill -9 -f "[v]llm.entrypoints" 2>/dev/null; pkill -9 -f "[E]ngineCore" 2>/dev/null; true
elif python3 -c "import vllm" 2>/dev/null; then
  python3 -c "import hpkv" 2>/dev/null || { echo "hpkv is not installed here: pip install . (docs/gpu.md)"; exit 1; }
else
  # A carried machine released between two calls comes back bare: stop rather than run a bench whose
  # every server start fails.
  echo "no vLLM here: pip install vllm==0.26.0, or carry it (scripts/gpu/README.md: the two carry calls, \
then scripts/gpu/suites.sh or source scripts/gpu/install.sh)"; exit 1
fi
