#!/usr/bin/env bash
# Load test of `longmoe serve`: starts a server (random weights for a config unless --model is given),
# runs scripts/serve_load.py (32 concurrent clients; a warm-up of >= 20 s and >= 1000 requests, then 60 s
# measured: every answer checked, malformed requests must get 400s, server RSS must not grow over the
# measured 60 s), then stops the server with SIGTERM and checks that it exits cleanly.
# --attack: scripts/serve_attack.py instead (200 slow connections trickling header lines for 60 s while short
# requests must keep answering: loaded p99 <= 2x unloaded p99).
# --long N: scripts/serve_attack.py --long-prompt N (prompts of N tokens back to back while short requests must
# keep answering: loaded p99 <= 3x unloaded p99; the context is N + 256).
#   scripts/serve_load.sh [--bin build/longmoe] [--config configs/k3-small.json] [--model DIR]
#                         [--clients 32] [--seconds 60] [--warmup 20] [--port 18080] [--attack | --long N]
#                         [--serve-args "..."]   (extra `serve` options, e.g. "--prefill-chunk 32")
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${here}/../build/longmoe config=${here}/../configs/k3-small.json model="" clients=32 seconds=60 warmup=20 port=18080
attack=0 long=0 serve_args=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --bin) bin=$2; shift 2 ;; --config) config=$2; shift 2 ;; --model) model=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;; --seconds) seconds=$2; shift 2 ;; --port) port=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;; --attack) attack=1; shift ;; --long) long=$2; shift 2 ;;
    --serve-args) serve_args=$2; shift 2 ;;
    *) echo "serve_load.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
context=4096
timeout=120
if [[ $long -gt 0 ]]; then context=$((long + 256)) timeout=3600; fi
if [[ -z $model ]]; then
  # A small tokenizer trained on generated text; the model's weights are random.
  python3 - "$work/corpus.txt" <<'PY'
import random, sys
r = random.Random(1)
words = "the river stone light cloud seven green alpha beta gamma time upon once key pass number what is in and of".split()
with open(sys.argv[1], "w") as f:
    for _ in range(4000):
        f.write(" ".join(r.choice(words) for _ in range(r.randint(5, 15))) + ".\n")
PY
  "$bin" tokenizer train --input "$work/corpus.txt" --vocab-size 400 --out "$work/tok.model" > /dev/null
  src=(--init-config "$config" --tokenizer "$work/tok.model")
else
  src=(--model "$model")
fi
read -r -a extra <<< "$serve_args"
"$bin" serve "${src[@]}" "${extra[@]}" --port "$port" --context $context --max-batch 32 --timeout $timeout --http-threads 48 --name load \
  > "$work/server.log" 2>&1 &
pid=$!
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  kill -0 $pid 2> /dev/null || { cat "$work/server.log"; exit 1; }
  sleep 0.2
done
status=0
if [[ $long -gt 0 ]]; then
  python3 "$here/serve_attack.py" --port "$port" --seconds "$seconds" --long-prompt "$long" --vocab 400 \
    --max-ratio 3 || status=$?
elif [[ $attack == 1 ]]; then
  python3 "$here/serve_attack.py" --port "$port" --seconds "$seconds" || status=$?
else
  python3 "$here/serve_load.py" --port "$port" --pid $pid --clients "$clients" --seconds "$seconds" \
    --warmup "$warmup" --context $context || status=$?
fi
# The server must still serve, then shut down cleanly on SIGTERM.
curl -sf "http://127.0.0.1:$port/health" > /dev/null || { echo "serve_load: server stopped serving"; status=1; }
t0=$(date +%s.%N)
kill -TERM $pid
rc=0
wait $pid || rc=$?
echo "serve_load: SIGTERM -> exit status $rc after $(echo "$(date +%s.%N) - $t0" | bc) s"
tail -n 2 "$work/server.log"
[[ $rc -eq 0 ]] || status=1
exit $status
