#!/usr/bin/env bash
# Installs the Debian 12 packages a task needs, only those missing. Usage:
#   common/install-deps.sh build    # cmake g++ make libeigen3-dev doctest-dev libboost-context-dev (build, tests)
#   common/install-deps.sh plots    # python3 python3-matplotlib                 (plots/)
#   common/install-deps.sh corpus   # python3 bible-kjv                          (data/build_corpus.py; the book test)
#   common/install-deps.sh train    # python3 python3-torch python3-numpy libopenblas0-pthread bible-kjv
#                                   #                                            (data/: train, golden files)
# Several groups may be given. On a system without apt-get it lists what to install by hand and fails.
set -euo pipefail
if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then sed -n '2,/^set -euo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi

[ $# -gt 0 ] || { echo "install-deps: name a group: build, plots, corpus or train (several may be given)" >&2; exit 2; }
packages=()
for group in "$@"; do
  case "$group" in
    build) packages+=(cmake g++ make libeigen3-dev doctest-dev libboost-context-dev) ;;
    plots) packages+=(python3 python3-matplotlib) ;;
    corpus) packages+=(python3 bible-kjv) ;;
    train) packages+=(python3 python3-torch python3-numpy libopenblas0-pthread bible-kjv) ;;
    *) echo "install-deps: unknown group '$group' (use build, plots, corpus or train)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-deps: this is not a Debian-like system; install these (or your system's equivalents) yourself:" >&2
  echo "  ${missing[*]}" >&2
  echo "  (CMake >= 3.25, a C++20 compiler, Eigen 3.4 and doctest for the build)" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "install-deps: installing Debian packages: ${missing[*]}" >&2
$sudo apt-get update -qq
# Through env: sudo's env_reset would drop a variable set before it, and tzdata (matplotlib's) would ask its question.
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
