#!/usr/bin/env bash
# Quick start, command 1: install what is missing, build in Release, and run every chapter built so far
# with short defaults on the shipped model. Text goes to stdout, measurements to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

common/install-deps.sh build
cmake --preset release >/dev/null
cmake --build --preset release
bin=build/release/bin

banner() { printf '\n\033[1m=== %s ===\033[0m\n' "$*" >&2; }

banner "Chapter 01: naive generation (the whole sequence is recomputed for every token)"
"$bin/01_naive_generation" --max-new-tokens 120
echo
banner "Done. Read book/README.md and run any chapter with --help."
