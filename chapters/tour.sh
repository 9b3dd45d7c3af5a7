#!/usr/bin/env bash
# Quick start, command 1: install what is missing, build in Release, and run every chapter built so far
# with short defaults on the shipped model (and chapter 04's recall on the copying model, where it ships).
# Text goes to stdout, measurements to stderr.
# --skip-build: run the chapters on the binaries already in build/release, or in KVS_BIN_DIR where set (a test runs
# the tour this way, on its own build's binaries, so that the README's first command keeps working).
set -euo pipefail
if [[ $# -eq 1 && ( $1 == --help || $1 == -h ) ]]; then
  sed -n '2,/^set -euo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'
  echo "Usage: bash chapters/tour.sh [--skip-build]   (without it: sudo apt-get for what is missing, then a build)"
  exit 0
fi
# KVS_BIN_DIR as given, from where the tour was started (the tour then runs from the repository root).
[[ -z ${KVS_BIN_DIR:-} || $KVS_BIN_DIR == /* ]] || KVS_BIN_DIR=$PWD/$KVS_BIN_DIR
cd "$(dirname "$0")/.."

case "$#:${1:-}" in
  0:) common/install-deps.sh build
      cmake --preset release >/dev/null
      cmake --build --preset release ;;
  1:--skip-build) ;;
  *) echo "usage: bash chapters/tour.sh [--skip-build] (--help says more)" >&2; exit 2 ;;
esac
bin=build/release/bin
[[ $# -eq 1 && -n ${KVS_BIN_DIR:-} ]] && bin=$KVS_BIN_DIR  # CTest's entry: its build's binaries
[[ -x $bin/00_perplexity ]] || { echo "tour.sh: no chapter binaries in $bin; build them (bash chapters/tour.sh) or set KVS_BIN_DIR" >&2; exit 2; }

# Bold on a terminal that takes it, plain in a file or a pipe (and where NO_COLOR is set, no-color.org).
if [[ -t 2 && -z ${NO_COLOR:-} && ${TERM:-dumb} != dumb ]]; then bold=$'\033[1m' plain=$'\033[0m'; else bold="" plain=""; fi
banner() { printf '\n%s=== %s ===%s\n' "$bold" "$*" "$plain" >&2; }

banner "Chapter 00: the model we use (bits per byte on held-out text)"
"$bin/00_perplexity" --max-bytes 32768
banner "Chapter 01: naive generation (the whole sequence is recomputed for every token)"
"$bin/01_naive_generation" --max-new-tokens 150
echo  # end the chapter's text with a newline
banner "Chapter 02: a cache that grows (concatenate per step vs chunked vs geometric growth)"
"$bin/02_dynamic_cache" --max-new-tokens 300
echo  # end the chapter's text with a newline
banner "Chapter 03: the preallocated cache (prefill, decode, memory, context wall)"
"$bin/03_preallocated_cache" --max-new-tokens 300
echo  # end the chapter's text with a newline
banner "Chapter 04: the sliding window (a ring of slots: memory stays flat, even past the trained context)"
"$bin/04_sliding_window" --window 64 --max-new-tokens 300
echo  # end the chapter's text with a newline
"$bin/04_sliding_window" --positions within-window --window 256 --max-new-tokens 5000 > /dev/null
if [ -f data/kjv-gpt-copy.bin ]; then
  banner "Chapter 04, the model that copies: recall holds while the window keeps the first copy (W >= d), then collapses"
  "$bin/04_sliding_window" --model data/kjv-gpt-copy.bin --experiment recall --windows full,512,256,128 --distances 128,256,512
  "$bin/04_sliding_window" --model data/kjv-gpt-copy.bin --experiment induction --distances 512
fi
banner "Chapter 05: break it - corrupt one cached key (texts side by side, KL per step, where the damage spreads)"
"$bin/05_break_corrupt_key" --max-new-tokens 60 --restore-after 10 --every 5
banner "Chapter 06: break it - write each position one slot off (the equivalence check catches it)"
"$bin/06_break_off_by_one" --max-new-tokens 60
banner "Chapter 08: many sequences at once - a paged cache, continuous batching, preemption, a block freed twice"
"$bin/08_paged_batching" --requests 24
"$bin/08_paged_batching" --experiment preemption --requests 16 --kv-memory 1MiB
"$bin/08_paged_batching" --experiment break --requests 16
banner "Chapter 09: requests that share a prefix share its cache - parallel sampling, a shared document, copy-on-write off"
"$bin/09_prefix_sharing" --samples 4
"$bin/09_prefix_sharing" --experiment prefix --counts 1,8,64
"$bin/09_prefix_sharing" --experiment break
banner "Chapter 10: a smaller cache - K and V in 16, 8 and 4 bits (the text, bytes per position, what keys and values hold)"
"$bin/10_quantized_cache" --max-new-tokens 80
"$bin/10_quantized_cache" --experiment memory
"$bin/10_quantized_cache" --experiment channels --text-bytes 1024
banner "Done. Read book/README.md; every binary takes --help. Speed sweep and plots: bash plots/regenerate.sh"
