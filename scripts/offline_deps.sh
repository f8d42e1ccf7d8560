#!/usr/bin/env bash
# Building on a machine without network (e.g. a rented GPU box with CUDA but none of our -dev packages):
#
#   scripts/offline_deps.sh download DIR   here (Debian 12, network): the .deb files of the build's libraries into DIR
#   . scripts/offline_deps.sh env DIR      there: unpack them under /opt/lm (never /), point pkg-config, CMake and the
#                                          loader at them, and set LM_CMAKE_ARGS for `cmake -S . -B build $LM_CMAKE_ARGS`
#   scripts/offline_deps.sh build DIR B [T ...]   there, in one step: env DIR, configure build folder B (Release,
#                                          Ninja when present) and build targets T (all when none); the log in
#                                          B/build.log, its errors on stderr
#
# Only the libraries the build links or includes travel (no compilers, no MPI: dist/ builds its MPI parts only when
# MPI is found). -Werror is off there: a newer GCC warns inside the Debian headers.
LONGMOE_OFFLINE_DEBS=(
  nlohmann-json3-dev libcli11-dev libfmt-dev libfmt9 libspdlog-dev libspdlog1.10 libgtest-dev libgmock-dev
  libbenchmark-dev libbenchmark1debian libsentencepiece-dev libsentencepiece0 libcpp-httplib-dev libcpp-httplib0.11
  libbrotli-dev libbrotli1 libssl-dev libssl3 zlib1g-dev zlib1g libstb-dev libstb0 libpng-dev libpng16-16
  libjpeg62-turbo-dev libjpeg62-turbo libopenblas-openmp-dev libopenblas0-openmp libopenblas-dev libgfortran5
  pkgconf libpkgconf3 pkgconf-bin
)

longmoe_offline_download() {
  mkdir -p "$1" && (cd "$1" && apt-get download "${LONGMOE_OFFLINE_DEBS[@]}")
  # The build links OpenBLAS's shared library: its -dev package's 58 MB static archive is repacked away (the
  # device tool carries at most 64 MiB beside the tree).
  local dev tmp
  for dev in "$1"/libopenblas-openmp-dev_*.deb; do
    tmp=$(mktemp -d) && dpkg-deb -R "$dev" "$tmp/p" && find "$tmp/p" -name '*.a' -delete &&
      dpkg-deb -b "$tmp/p" "$dev" > /dev/null
    rm -rf "$tmp"
  done
}

longmoe_offline_env() {
  local R=/opt/lm pc
  if [[ ! -d $R/usr ]]; then
    mkdir -p $R
    for f in "$1"/*.deb; do dpkg -x "$f" $R; done
    for pc in $R/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc $R/usr/share/pkgconfig/*.pc; do
      [[ -f $pc ]] && sed -i "s|=/usr|=$R/usr|g; s| -I/usr| -I$R/usr|g; s| -L/usr| -L$R/usr|g" "$pc"
    done
  fi
  export PKG_CONFIG_PATH=$R/usr/lib/x86_64-linux-gnu/pkgconfig:$R/usr/share/pkgconfig
  export CMAKE_PREFIX_PATH=$R/usr
  export LD_LIBRARY_PATH=$R/usr/lib/x86_64-linux-gnu:$R/usr/lib/x86_64-linux-gnu/openblas-openmp:${LD_LIBRARY_PATH:-}
  local pkgconfig
  pkgconfig=$(command -v pkg-config || echo $R/usr/bin/pkgconf)
  LM_CMAKE_ARGS="-DLONGMOE_WERROR=OFF -DOPENBLAS_INCLUDE_DIR=$R/usr/include/x86_64-linux-gnu/openblas-openmp"
  LM_CMAKE_ARGS+=" -DOPENBLAS_LIBRARY=$R/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so"
  LM_CMAKE_ARGS+=" -DPKG_CONFIG_EXECUTABLE=$pkgconfig"
  export LM_CMAKE_ARGS
}

[[ ${BASH_SOURCE[0]} == "$0" ]] && set -euo pipefail  # (not in the shell that sources it)

longmoe_offline_build() {
  local debs=$1 dir=$2 gen=() t=()
  shift 2
  longmoe_offline_env "$debs"
  command -v ninja > /dev/null && gen=(-G Ninja)
  for x in "$@"; do t+=(--target "$x"); done
  # shellcheck disable=SC2086  # (LM_CMAKE_ARGS is a list of words)
  cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release $LM_CMAKE_ARGS > /dev/null &&
    { cmake --build "$dir" -j "$(nproc)" "${t[@]}" > "$dir/build.log" 2>&1 ||
      { grep -m 20 -A 8 'error' "$dir/build.log" >&2; return 1; }; }
}

case ${1:-} in
  download) longmoe_offline_download "${2:?usage: offline_deps.sh download DIR}" ;;
  env) longmoe_offline_env "${2:?usage: . offline_deps.sh env DIR}" ;;
  build) longmoe_offline_build "${2:?usage: offline_deps.sh build DIR BUILD [TARGET ...]}" \
           "${3:?usage: offline_deps.sh build DIR BUILD [TARGET ...]}" "${@:4}" ;;
  *) sed -n '2,12p' "${BASH_SOURCE[0]}"; [[ ${BASH_SOURCE[0]} == "$0" ]] && exit 2 ;;
esac
