# The home row on the GPU: prefill, GPU hit and memory hit, hpkv beside vLLM's native OffloadingConnector
# and vLLM alone, with CUDA graphs, 10 random 8192-token prompts; then where hpkv's time goes:
#   - the copy probe (probe_copy.py): the mover's load against a pinned copy, outside vLLM;
#   - the step trace of hpkv's engine (HPKV_STEP_TRACE) under $OUT/trace;
#   - py-spy on hpkv's engine process during its GPU-hit row (HOME_SPY=1; needs py-spy's wheel in .whl/).
# HOME_COMPARE names the systems (default hpkv,native,none), HOME_ARGS adds bench arguments.
# Source scripts/gpu/install.sh first on a fresh machine (HOME_INSTALL=1 does it here).
# HOME_TREE=DIR runs hpkv from another tree (e.g. an earlier commit's `git archive`, carried) instead.
[ "${HOME_INSTALL:-0}" = 1 ] && . scripts/gpu/install.sh
. scripts/gpu/env.sh
[ -n "${HOME_TREE:-}" ] && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --upgrade --target /root/site "$HOME_TREE" > /dev/null 2>&1
python3 -c "import hpkv, os; print('hpkv from', os.path.dirname(hpkv.__file__))"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -d $M7B ] || python3 -m hpkv.cli.main demo-model $M7B --size 7b > $OUT/model.log 2>&1 || exit 1
[ "${HOME_PROBE:-1}" = 1 ] && timeout 90 python3 scripts/gpu/probe_copy.py 10 2>&1 | tail -14
mkdir -p $OUT/trace
export HPKV_STEP_TRACE=$OUT/trace
# Interleaved: the three servers share the GPU (0.3 of its memory each), requests alternate.
timeout ${HOME_TIMEOUT:-470} python3 -m hpkv.cli.main bench ttft --model $M7B \
  --vllm-args="--gpu-memory-utilization 0.3" --compare ${HOME_COMPARE:-hpkv,native,none} --interleave \
  --scenarios prefill,gpu,memory --prompt-kind random --prompts ${HOME_PROMPTS:-10} --pool-size 8G \
  ${HOME_ARGS:-} \
  --out $OUT/${HOME_NAME:-home} > $OUT/${HOME_NAME:-home}.log 2>&1 &
B=$!
if [ "${HOME_SPY:-0}" = 1 ]; then
  pip_spy=$(ls /root/whl/py_spy-*.whl 2>/dev/null | head -1)
  [ -x /root/py-spy ] || { [ -n "$pip_spy" ] && python3 -c "import zipfile,sys; z=zipfile.ZipFile(sys.argv[1]); n=[x for x in z.namelist() if x.endswith('/py-spy')][0]; open('/root/py-spy','wb').write(z.read(n))" "$pip_spy" && chmod +x /root/py-spy; }
  until grep -aq "hpkv gpu " $OUT/${HOME_NAME:-home}.log 2>/dev/null; do kill -0 $B 2>/dev/null || break; sleep 0.2; done
  PID=""  # hpkv's engine: the EngineCore whose API server names HpkvConnectorV1
  for p in $(pgrep -f EngineCore); do
    grep -aq HpkvConnectorV1 /proc/$(ps -o ppid= -p $p | tr -d ' ')/cmdline 2>/dev/null && PID=$p
  done
  [ -n "$PID" ] && /root/py-spy record --pid $PID --threads --nonblocking --rate 1000 --duration 8 \
    --format raw --output $OUT/spy-gpu.txt > $OUT/spy.log 2>&1
fi
wait $B
echo "bench rc=$?"
tail -${HOME_TAIL:-45} $OUT/${HOME_NAME:-home}.log
grep -h "Retrieved" $OUT/${HOME_NAME:-home}/*.log 2>/dev/null | tail -6
[ -s $OUT/spy-gpu.txt ] && python3 scripts/gpu/summarize_spy.py $OUT/spy-gpu.txt | head -60
true
