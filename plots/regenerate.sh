#!/usr/bin/env bash
# Rerun every experiment behind plots/data/*.csv (chapter 03's speed sweep and breakdown, then chapters 04-10's
# experiments, on the shipped model and the copying model), overwriting those CSVs, and redraw every figure
# (plots/*.png) from them. On 2 cores it took 9.4 minutes from a fresh clone (2026-11-26): 3.1 to build, 6.3 to
# run; nothing else should run meanwhile, or the timings mean little. Arguments are added to every binary's run
# (for instance --memory-limit 4GiB; not to busy_machine.sh, whose flags are its own): a flag that one of the
# binaries refuses, or that a run already sets, stops the script there.
set -euo pipefail
cd "$(dirname "$0")/.."
common/install-deps.sh build plots
cmake --preset release >/dev/null
cmake --build --preset release
build/release/bin/03_benchmark --lengths 32,64,128,256,512,1024,1536,1984 \
  --csv plots/data/speedup.csv --memory-csv plots/data/cache_memory.csv "$@"
build/release/bin/03_benchmark --breakdown --lengths 32,128,256,512,1024,1536,2048 --max-new-tokens 200 --threads 1 \
  --csv plots/data/decode_breakdown.csv "$@"
bash chapters/03_preallocated_cache/busy_machine.sh --runs 3 --csv plots/data/busy_machine.csv
# Chapter 04: what a window costs, and what it saves.
ch04=build/release/bin/04_sliding_window
"$ch04" --experiment perplexity --csv plots/data/window_perplexity.csv "$@"
"$ch04" --experiment recall --csv plots/data/window_recall.csv "$@"
"$ch04" --experiment fluency --windows full,512,128,32,16,8,4 --temperature 0.8 --seed 1 \
  --csv plots/data/window_fluency.csv "$@"
"$ch04" --experiment stream --window 256 --sinks 4 --csv plots/data/window_stream.csv "$@"
"$ch04" --experiment memory --window 256 --positions within-window --max-new-tokens 10240 \
  --csv plots/data/window_memory.csv "$@"
# Chapter 04 on the model that copies (data/kjv-gpt-copy.bin, when present): recall against W / d, the
# induction heads, what fails first with 4 sinks.
copy=data/kjv-gpt-copy.bin
if [ -f "$copy" ]; then
  "$ch04" --model "$copy" --experiment recall --csv plots/data/copy_window_recall.csv "$@"
  "$ch04" --model "$copy" --experiment recall --sinks 4 --csv plots/data/copy_window_recall_sinks.csv "$@"
  "$ch04" --model "$copy" --experiment induction --csv plots/data/copy_induction.csv "$@"
  "$ch04" --model "$copy" --experiment stream --window 256 --sinks 4 --csv plots/data/copy_window_stream.csv "$@"
  "$ch04" --model "$copy" --experiment fluency --sinks 4 --windows full,512,128,32,16,8 --temperature 0.8 --seed 1 \
    --csv plots/data/copy_window_fluency.csv "$@"
fi
# Chapters 05-06: break the cache on purpose.
ch05=build/release/bin/05_break_corrupt_key
"$ch05" --contamination-csv plots/data/break_contamination.csv --csv plots/data/break_run.csv "$@" >/dev/null
"$ch05" --experiment sweep --csv plots/data/break_sweep.csv --kl-csv plots/data/break_kl.csv "$@"
ch06=build/release/bin/06_break_off_by_one
"$ch06" --csv plots/data/off_by_one_run.csv "$@" >/dev/null
"$ch06" --experiment probes --csv plots/data/off_by_one_probes.csv "$@"
# Chapter 08: batches, blocks, continuous batching, preemption.
ch08=build/release/bin/08_paged_batching
for threads in 1 2; do
  "$ch08" --experiment throughput --threads "$threads" --csv "plots/data/batch_throughput_${threads}t.csv" "$@"
done
"$ch08" --experiment throughput --synthetic 1024,8,8,2 --kv-memory 64MiB --prompt-lengths 16,16 --output-lengths 16,16 \
  --batch-sizes 1,4,16,64 --threads 2 --csv plots/data/batch_throughput_synthetic_2t.csv "$@"
"$ch08" --experiment memory --requests 64 --kv-memory 16MiB --csv plots/data/paged_memory.csv "$@"
"$ch08" --experiment batching --requests 64 --mean-gap 4 --max-batch 16 --csv plots/data/batching.csv "$@"
"$ch08" --experiment preemption --requests 32 --kv-memory 1MiB --csv plots/data/preemption.csv "$@"
# Chapter 09: shared prefixes, parallel sampling.
ch09=build/release/bin/09_prefix_sharing
"$ch09" --experiment prefix --csv plots/data/prefix_sharing.csv "$@"
"$ch09" --experiment sampling --csv plots/data/sampling_memory.csv "$@"
# Chapter 10: the cache in 16, 8 and 4 bits.
ch10=build/release/bin/10_quantized_cache
"$ch10" --experiment channels --csv plots/data/kv_channels.csv --errors-csv plots/data/kv_channel_errors.csv "$@"
"$ch10" --experiment quality --csv plots/data/quantized_quality.csv "$@"
for group in 8 16; do
  "$ch10" --experiment quality --formats int4 --group "$group" --csv "plots/data/quantized_quality_g${group}.csv" "$@"
done
"$ch10" --experiment speed --csv plots/data/quantized_speed.csv "$@"
/usr/bin/python3 plots/plot.py  # Debian's interpreter, which has python3-matplotlib
