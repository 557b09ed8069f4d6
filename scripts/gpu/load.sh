# The load levels on the H200: hpkv (HPKV_ASYNC_LOAD=auto) next to hpkv-sync (=false, the load mode before
# "auto") and vLLM alone, the fifteenth session's workload. LOAD_LEVELS (default 16), LOAD_COMPARE (default
# hpkv,hpkv-sync,none; add native), LOAD_TIMEOUT (default 560 s: ~80 s per system and level at 16).
. scripts/gpu/env.sh
[ -d /root/m7b ] || python3 -m hpkv.cli.main demo-model /root/m7b --size 7b || exit 1
timeout ${LOAD_TIMEOUT:-560} python3 -m hpkv.cli.main bench serve --model /root/m7b \
  --compare ${LOAD_COMPARE:-hpkv,hpkv-sync,none} --users 16 --context 8192 --turns 3 \
  --concurrency ${LOAD_LEVELS:-16} --engine-blocks 1000 --pool-size 4G --vllm-args="--enforce-eager" \
  --out $OUT/serve > $OUT/serve.log 2>&1
echo "rc=$?"; tail -16 $OUT/serve.log; grep -c "Retrieved.*async" $OUT/serve/vllm-*.log  # hits loaded asynchronously, per system
