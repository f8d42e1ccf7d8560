#!/usr/bin/env bash
# Installs the Debian (12, bookworm) packages longmoe needs to build, test, sanitize and fuzz.
#
#   scripts/deps.sh              build + test dependencies (what scripts/test.sh and .ci/run need), nodejs + npm
#                                included (the corpus download and the OpenAI Node SDK test use them)
#   scripts/deps.sh --with-node  the same (kept for older callers)
#   scripts/deps.sh --with-fashion-mnist  also Debian's dataset-fashion-mnist (the vision run's images, 30 MB)
#
# Idempotent: when every package is already installed it touches nothing (no apt-get update, no
# root needed). Otherwise it installs only the missing ones, through sudo unless run as root.
# Source it (`. scripts/deps.sh`) to reuse the functions without installing anything.
set -euo pipefail

LONGMOE_APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libopenblas-openmp-dev   # BLAS, OpenMP flavour (see the top-level CMakeLists.txt)
  nlohmann-json3-dev libcli11-dev libfmt-dev libspdlog-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libsentencepiece-dev sentencepiece
  libcpp-httplib-dev libstb-dev
  zlib1g-dev               # gzip-compressed IDX files (io/idx.cpp)
  libpng-dev libjpeg62-turbo-dev  # image decoding (io/image.cpp): fuzzed, unlike stb_image's decoder
  libopenmpi-dev openmpi-bin  # multi-process training (src/dist) and its mpirun tests
  strace                   # the save fault-injection test (a SIGKILL at every file-changing syscall of a save)
  clang libclang-rt-14-dev # fuzz build: clang-14 and its libFuzzer/ASan/UBSan runtimes
  libomp-dev               # clang's OpenMP runtime: the core library is built with -fopenmp
)

# Prints the packages among "$@" that are not installed.
longmoe_missing_packages() {
  local p
  for p in "$@"; do
    if ! dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
      echo "$p"
    fi
  done
}

# Installs whichever of "$@" are missing; a no-op (and no root needed) when none are.
longmoe_apt_install() {
  local -a missing
  mapfile -t missing < <(longmoe_missing_packages "$@")
  if [[ ${#missing[@]} -eq 0 ]]; then
    echo "deps: all $# packages already installed"
    return 0
  fi
  local -a as_root=()
  if [[ $(id -u) -ne 0 ]]; then
    if ! command -v sudo >/dev/null; then
      echo "deps: not root and no sudo; cannot install: ${missing[*]}" >&2
      return 1
    fi
    as_root=(sudo)
  fi
  echo "deps: installing ${missing[*]}"
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}

longmoe_install_build_deps() { longmoe_apt_install "${LONGMOE_APT_PACKAGES[@]}"; }

# nodejs + npm: the corpus download (scripts/fetch_brown.sh) and the OpenAI Node SDK test
# (tests/serve/test_openai_sdk.cpp, which CI requires to run: LONGMOE_REQUIRE_NODE_SDK=1 in .ci/run).
# A node + npm already on PATH (e.g. NodeSource's nodejs, which bundles npm and conflicts with
# Debian's npm package) is used as it is.
longmoe_install_node_deps() {
  if command -v node >/dev/null && command -v npm >/dev/null; then
    echo "deps: node $(node --version) and npm $(npm --version) already on PATH"
    return 0
  fi
  longmoe_apt_install nodejs npm
}

longmoe_deps_main() {
  local with_fmnist=0 a
  for a in "$@"; do
    case $a in
      --with-node) ;;
      --with-fashion-mnist) with_fmnist=1 ;;
      -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}"; return 0 ;;
      *) echo "deps: unknown argument '$a'" >&2; return 2 ;;
    esac
  done
  longmoe_install_build_deps
  longmoe_install_node_deps
  # /usr/share/datasets/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz
  if [[ $with_fmnist -eq 1 ]]; then longmoe_apt_install dataset-fashion-mnist; fi
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  longmoe_deps_main "$@"
fi
