# Two vLLM replicas on the one GPU behind the round-robin router (issue: one memory tier per host): hpkv's
# host pool next to a pool per engine and vLLM alone, each system a fresh pair of servers, each server at
# --gpu-memory-utilization 0.4. REPLICAS_COMPARE (default hpkv,hpkv-engine,none), REPLICAS_TIMEOUT
# (default 560 s), REPLICAS_NAME (default replicas: names the outputs).
. scripts/gpu/env.sh
[ -d $M7B ] || python3 -m hpkv.cli.main demo-model $M7B --size 7b || exit 1
N=${REPLICAS_NAME:-replicas}
timeout ${REPLICAS_TIMEOUT:-560} python3 -m hpkv.cli.main bench serve --model $M7B --replicas 2 \
  --compare ${REPLICAS_COMPARE:-hpkv,hpkv-engine,none} --users 16 --context 8192 --turns 3 \
  --concurrency 16 --engine-blocks 1000 --pool-size 8G \
  --vllm-args="--enforce-eager --gpu-memory-utilization 0.4" \
  --out $OUT/$N > $OUT/$N.log 2>&1
echo "rc=$?"; tail -${REPLICAS_TAIL:-24} $OUT/$N.log
