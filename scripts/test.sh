#!/usr/bin/env bash
# Builds longmoe (Release) and runs its tests: the README's test command.
#
#   scripts/test.sh
#
# Steps: scripts/deps.sh; configure into build/ (Release, Ninja); build; then
#   ctest --output-on-failure -L cpu  -j2
#   ctest --output-on-failure -L cuda      (GPU tests; they skip when there is no GPU, and are not
#                                           built at all without nvcc)
# Environment: LONGMOE_BUILD_DIR (default build), LONGMOE_JOBS (default 2),
#              LONGMOE_CMAKE_ARGS (extra configure arguments), LONGMOE_SKIP_DEPS=1 (skip deps.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

build_dir=${LONGMOE_BUILD_DIR:-build}
jobs=${LONGMOE_JOBS:-2}
read -r -a extra_args <<< "${LONGMOE_CMAKE_ARGS:-}"

if [[ ${LONGMOE_SKIP_DEPS:-0} != 1 ]]; then
  scripts/deps.sh
fi

cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${extra_args[@]}"
cmake --build "$build_dir" -j "$jobs"

cd "$build_dir"
ctest --output-on-failure -L cpu -j "$jobs" --no-tests=error
ctest --output-on-failure -L cuda --no-tests=ignore
