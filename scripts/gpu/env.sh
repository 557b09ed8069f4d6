# Sourced by every device step after the install: the carried vLLM, hpkv from this tree, GLIDE + valkey.
export PYTHONPATH=/root/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /root/site . >/dev/null 2>&1
