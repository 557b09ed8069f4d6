# Sourced by every device step after the install: the carried vLLM, hpkv from this tree, GLIDE + valkey.
export PYTHONPATH=/root/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /root/site . >/dev/null 2>&1
# A call stopped at its time limit leaves its vLLM servers holding the GPU, and the next call's first start
# then fails ("Engine core initialization failed"): stop any left over.
pkill -9 -f "[v]llm.entrypoints" 2>/dev/null; pkill -9 -f "[E]ngineCore" 2>/dev/null; true
# A machine released between two calls (30 s idle) comes back bare: stop here rather than run a bench
# whose every server start fails. Not for the install itself, which sources this file
# after putting vLLM in place.
[ -d /root/site/vllm ] || { echo "no vLLM in /root/site: a fresh machine; run the two carry calls and \
scripts/gpu/suites.sh (or source scripts/gpu/install.sh) first"; exit 1; }
