# Cold-prefill overhead, interleaved with vLLM alone, fresh server pairs.
. scripts/gpu/env.sh
[ -d $M7B ] || python3 -m hpkv.cli.main demo-model $M7B --size 7b || exit 1
# COLD_TIMEOUT bounds the run (a call that installs first has ~520 s left of its 600); COLD_ARGS adds
# arguments, e.g. COLD_ARGS="--pairs 1 --role kv_consumer" (lookups only: the valkey probe without writes).
timeout ${COLD_TIMEOUT:-580} python3 -m hpkv.cli.main bench cold --model $M7B --rounds 6 --prompts 2 --pairs 2 --pool-size 8G $COLD_ARGS \
  --vllm-args="--enforce-eager --gpu-memory-utilization 0.4" --out $OUT/cold > $OUT/cold.log 2>&1
echo "rc=$?"; tail -40 $OUT/cold.log
