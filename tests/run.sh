#!/usr/bin/env bash
# Quick start, command 2: install what is missing, then configure, build and run the whole test suite
# (cmake --workflow --preset test). CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
common/install-deps.sh build
cmake --workflow --preset test
