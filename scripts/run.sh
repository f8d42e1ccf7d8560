#!/usr/bin/env bash
# The main job. Installs what it needs (Debian packages, idempotent), builds longmoe in Release, then:
#   1. `longmoe verify` on every golden file in ../shared/golden (KDA op files and model directories);
#   2. `longmoe bench kda`: chunked KDA, bounded vs exact diagonal tiles, forward and forward+backward.
# (Until the trainer lands, this is what "the main job" runs; see docs/ for what comes next.)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
"$here/scripts/deps.sh"
build=${LONGMOE_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" --target longmoe -j"$(nproc)"

golden=${LONGMOE_GOLDEN_DIR:-$here/../shared/golden}
if [ -d "$golden" ]; then
  mapfile -t files < <(find "$golden/kda" -name '*.safetensors' | sort)
  "$build/longmoe" verify "${files[@]}"
else
  echo "run.sh: no golden files at $golden (set LONGMOE_GOLDEN_DIR); skipping verify" >&2
fi
"$build/longmoe" bench kda ${LONGMOE_BENCH_ARGS:-}
