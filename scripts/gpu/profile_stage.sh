# Where a storage hit's staging waits inside vLLM (measured at ~37 ms for 448 MiB with 4 or 8 I/O
# threads inside vLLM, against 22 ms for Catalog.stage with 8 outside it, probe_stage.py). Runs bench
# ttft's storage row and, once its storage phase has begun, samples the engine process with py-spy:
# first only the thread holding the GIL (--gil), then every thread that is not idle. Needs py-spy's
# wheel in .whl/ (install.sh installs every wheel there). Outputs under $OUT/prof: the bench's log and
# files, threads.txt (threads.py: CPU, faults and switches per thread from /proc), gil.txt and active.txt
# (py-spy's raw stacks), and a summary printed by summarize_spy.py.
. scripts/gpu/env.sh
SPY=${SPY:-/root/site/bin/py-spy}
[ -x $SPY ] || { echo "py-spy missing: put its wheel in .whl/"; exit 1; }
[ -d $M7B ] || python3 -m hpkv.cli.main demo-model $M7B --size 7b || exit 1
P=$OUT/prof; mkdir -p $P
python3 -m hpkv.cli.main bench ttft --model $M7B --vllm-args="${TTFT_VLLM_ARGS---enforce-eager}" \
  --compare hpkv --scenarios prefill,gpu,storage --prompt-kind random --prompts ${PROF_PROMPTS:-24} \
  --pool-size 24G --out $P/ttft > $P/ttft.log 2>&1 &
B=$!
until grep -q "staged 32 chunks" $P/ttft/vllm-hpkv.log 2>/dev/null; do
  kill -0 $B 2>/dev/null || { echo "the bench ended before its storage phase"; tail -20 $P/ttft.log; exit 1; }
  sleep 0.2
done
PID=$(pgrep -n -f EngineCore)
# /proc and py-spy's GIL pass at once: the storage phase of 24 prompts lasts ~6 s 
python3 scripts/gpu/threads.py $PID ${PROF_S:-3} > $P/threads.txt 2>&1 &
T=$!
$SPY record --pid $PID --gil --threads --nonblocking --rate 500 --duration ${PROF_S:-3} --format raw \
  --output $P/gil.txt > $P/spy-gil.log 2>&1
wait $T
$SPY record --pid $PID --threads --nonblocking --rate 500 --duration ${PROF_S:-3} --format raw \
  --output $P/active.txt > $P/spy-active.log 2>&1
wait $B
tail -12 $P/ttft.log
grep -h "staged" $P/ttft/vllm-hpkv.log | tail -3
cat $P/threads.txt
python3 scripts/gpu/summarize_spy.py $P/gil.txt $([ -s $P/active.txt ] && echo $P/active.txt)
