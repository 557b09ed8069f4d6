# The seed table's memory and storage rows at the commit in .base (carried: `git archive BASE | tar -x -C .base`)
# and at this tree, one after the other, each in fresh servers: AB_ORDER (default "base head"), AB_PROMPTS
# (default 12), AB_TIMEOUT per run (default 270 s).
. scripts/gpu/env.sh
[ -d $M7B ] || python3 -m hpkv.cli.main demo-model $M7B --size 7b || exit 1
[ -d /root/base-hpkv ] || python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --target /root/base-hpkv .base >/dev/null 2>&1 || exit 1
for which in ${AB_ORDER:-base head}; do
  pp=/root/site; [ "$which" = base ] && pp=/root/base-hpkv:/root/site
  PYTHONPATH=$pp timeout ${AB_TIMEOUT:-270} python3 -m hpkv.cli.main bench ttft --model $M7B \
    --vllm-args=--enforce-eager --compare hpkv --scenarios prefill,gpu,memory,storage --prompt-kind random \
    --prompts ${AB_PROMPTS:-12} --pool-size 8G --out $OUT/ab-$which > $OUT/ab-$which.log 2>&1
  echo "== $which rc=$?"; tail -${AB_TAIL:-24} $OUT/ab-$which.log
done
