# Fourth run: the seed table on the 7B shape, hpkv ("ask again") next to hpkv-async, eager.
. scripts/gpu/env.sh
[ -d /root/m7b ] || python3 -m hpkv.cli.main demo-model /root/m7b --size 7b || exit 1
timeout 580 python3 -m hpkv.cli.main bench ttft --model /root/m7b --compare hpkv,hpkv-async \
  --scenarios prefill,gpu,memory,storage,valkey --pool-size 8G --vllm-args="--enforce-eager" --out $OUT/ttft > $OUT/ttft.log 2>&1
echo "rc=$?"
grep -h "Retrieved\|async load of\|staged" $OUT/ttft/*.log 2>/dev/null | tail -30
tail -60 $OUT/ttft.log
