# The seed table on the 7B shape (eager), hpkv beside vLLM's native OffloadingConnector. Arguments
# replace the defaults after --model, e.g.
#   bash scripts/gpu/ttft.sh --compare hpkv,native --scenarios prefill,gpu,memory,storage \
#     --prompt-kind random --prompts 48 --pool-size 24G
# (letters repeat after 26 prompts; 48 prompts of 448 MiB need a 24 GiB pool for the memory row).
. scripts/gpu/env.sh
[ -d $M7B ] || python3 -m hpkv.cli.main demo-model $M7B --size 7b || exit 1
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--compare hpkv,native --scenarios prefill,gpu,memory,storage,valkey --pool-size 8G)
# TTFT_VLLM_ARGS="" runs with CUDA graphs (vLLM's default); eager otherwise. TTFT_NAME names the outputs
# (two runs in one call), TTFT_TIMEOUT bounds the run.
N=${TTFT_NAME:-ttft}
timeout ${TTFT_TIMEOUT:-580} python3 -m hpkv.cli.main bench ttft --model $M7B --vllm-args="${TTFT_VLLM_ARGS---enforce-eager}" "${ARGS[@]}" \
  --out $OUT/$N > $OUT/$N.log 2>&1
echo "rc=$?"
grep -h "Retrieved\|async load of\|staged" $OUT/$N/*.log 2>/dev/null | tail -${TTFT_LOG_LINES:-30}
tail -${TTFT_TAIL:-60} $OUT/$N.log
