# The load levels on the H200: hpkv next to vLLM alone. LOAD_LEVELS (default 16), LOAD_COMPARE (default
# hpkv,none; also hpkv-sync (HPKV_ASYNC_LOAD=false), native),
# LOAD_TIMEOUT (default 560 s: ~80 s per system and level at 16),
# LOAD_TURNS (default 3), LOAD_REPEAT (default 1), LOAD_NAME (default serve: names the outputs, for two runs
# in one call). HPKV_STEP_TRACE=$OUT/trace in the caller's environment traces each hpkv server's steps
# (scripts/steps.py reads them). LOAD_ARGS: more `hpkv bench serve` arguments, e.g. "--fault valkey-kill
# --valkey" (faults under load) or "--logprobs 5" with VLLM_BATCH_INVARIANT=1 in the caller's environment
# (vLLM's batch-invariant kernels and each token's log-probabilities: the text check against vLLM alone).
. scripts/gpu/env.sh
[ -d $M7B ] || python3 -m hpkv.cli.main demo-model $M7B --size 7b || exit 1
timeout ${LOAD_TIMEOUT:-560} python3 -m hpkv.cli.main bench serve --model $M7B \
  --compare ${LOAD_COMPARE:-hpkv,none} --users 16 --context 8192 --turns ${LOAD_TURNS:-3} \
  --repeat ${LOAD_REPEAT:-1} \
  --concurrency ${LOAD_LEVELS:-16} --engine-blocks 1000 --pool-size 4G --vllm-args="--enforce-eager" \
  ${LOAD_ARGS:-} \
  --out $OUT/${LOAD_NAME:-serve} > $OUT/${LOAD_NAME:-serve}.log 2>&1
echo "rc=$?"; tail -${LOAD_TAIL:-16} $OUT/${LOAD_NAME:-serve}.log
grep -c "Retrieved.*async" $OUT/${LOAD_NAME:-serve}/vllm-*.log  # hits loaded asynchronously, per system
