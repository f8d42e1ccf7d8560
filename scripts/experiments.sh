#!/usr/bin/env bash
# The runs behind docs/experiments.md, all on the Brown corpus (data/brown, scripts/fetch_brown.sh):
#   (a) MoE balancing: Quantile Balancing (exact and histogram estimator) vs the sign-update bias vs a
#       Switch-style auxiliary loss              configs/train-experiment.json --balance ...
#   (b) Block AttnRes vs plain residual          --model configs/k3-small-plain-residual.json
#   (c) bounded vs softplus KDA gate             --model configs/k3-small-softplus.json
#   (d) passkey retrieval after each stage of the 256 -> 512 -> 1024 curriculum, on a run whose training
#       data hold 10% synthetic passkey documents (configs/train-curriculum-passkey.json)
# Every variant of (a)-(c) sees the same data, seed and token budget (one stage, 400K tokens at 256).
#
#   scripts/experiments.sh [train|eval|all]     (default all)
# Environment: LONGMOE_BIN (build/longmoe), LONGMOE_EXP_DIR (runs), LONGMOE_EXP_THREADS (threads per
# ablation run, 2), LONGMOE_EXP_CURRICULUM_THREADS (threads for the curriculum run, 4),
# LONGMOE_EXP_PARALLEL=1 runs the seven trainings at once (for a machine with >= 16 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
L=${LONGMOE_BIN:-build/longmoe}
out=${LONGMOE_EXP_DIR:-runs}
th=${LONGMOE_EXP_THREADS:-2}
cth=${LONGMOE_EXP_CURRICULUM_THREADS:-4}
what=${1:-all}
mkdir -p "$out"

job() {  # job NAME THREADS ARGS...: one training run, its log in $out/NAME.log
  local name=$1 t=$2
  shift 2
  echo "train $name: $L --threads $t train $* --out $out/$name --overwrite"
  if [[ ${LONGMOE_EXP_PARALLEL:-0} == 1 ]]; then
    "$L" --threads "$t" train "$@" --out "$out/$name" --overwrite --quiet > "$out/$name.log" 2>&1 &
  else
    "$L" --threads "$t" train "$@" --out "$out/$name" --overwrite --quiet > "$out/$name.log" 2>&1
  fi
}

if [[ $what == train || $what == all ]]; then
  E=configs/train-experiment.json
  job curriculum-passkey "$cth" --config configs/train-curriculum-passkey.json
  job exp-qb "$th" --config $E --balance qb
  job exp-qb-hist "$th" --config $E --balance qb --qb-estimator hist
  job exp-sign "$th" --config $E --balance sign
  job exp-aux "$th" --config $E --balance aux
  job exp-plain-residual "$th" --config $E --model configs/k3-small-plain-residual.json
  job exp-softplus "$th" --config $E --model configs/k3-small-softplus.json
  wait
  for r in curriculum-passkey exp-qb exp-qb-hist exp-sign exp-aux exp-plain-residual exp-softplus; do
    echo "== $r"; tail -n 4 "$out/$r.log"
  done
fi

if [[ $what == eval || $what == all ]]; then
  for s in 0 1 2; do
    echo "== passkey after stage $((s + 1)) ($out/curriculum-passkey/stage-$s)"
    "$L" --threads "$cth" eval --model "$out/curriculum-passkey/stage-$s" --passkey 256,512,1024,2048 --trials 20
  done
fi
