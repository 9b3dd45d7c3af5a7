#!/usr/bin/env bash
# Quick start, command 2: install what is missing, then configure, build and run the whole test suite
# twice: optimised (cmake --workflow --preset test), then under AddressSanitizer + UBSan
# (cmake --workflow --preset sanitize; shorter shipped-model runs, one thread per test). CI runs exactly
# this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
common/install-deps.sh build corpus  # corpus: python3 and bible-kjv, for the book test (chapter 00 builds the corpus)
cmake --workflow --preset test
cmake --workflow --preset sanitize
