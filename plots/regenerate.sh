#!/usr/bin/env bash
# Rerun the speed sweep on the shipped model and redraw every figure (plots/*.png) from its CSV.
# Takes about a minute on 2 cores; nothing else should run meanwhile, or the timings mean little.
set -euo pipefail
cd "$(dirname "$0")/.."
common/install-deps.sh build plots
cmake --preset release >/dev/null
cmake --build --preset release
build/release/bin/03_benchmark --lengths 32,64,128,256,512,1024,1536,2048 \
  --csv plots/data/speedup.csv --memory-csv plots/data/cache_memory.csv "$@"
/usr/bin/python3 plots/plot.py  # Debian's interpreter, which has python3-matplotlib
