#!/usr/bin/env bash
# What a session lent a GPU runs in one call (book 07): build this tree and, for an A/B comparison, an older one;
# the breakdowns of both builds, interleaved, and of this one with its kernels launched plainly
# (KVS_PROGRAMMATIC_LAUNCH=0); the test suite with the GPU present; compute-sanitizer on the kernel tests.
# Usage, from the repository root on the GPU machine:
#   bash tests/gpu_session.sh OUT_DIR [BASE_SOURCE_DIR] [STEPS]
# STEPS: a comma-separated list of build,ab,chunks,test,sanitize,profile,chapters,transcripts, run in the order given
# (default: build,ab,test,chunks,sanitize,profile,chapters; profile: the synthetic model's decode kernels under Nsight
# Compute, each one's time and DRAM bytes, in profile.md, and what the decoding kernel's and the products' warps
# wait on; chunks: this build's decode steps with decoding cut into other chunks, KVS_DECODE_CHUNKS, and with the
# products in blocks of fewer warps, KVS_GEMV_WARPS, added to ab_table.md; chapters: chapter 08's serve check and batch throughput and chapter 10's formats' speed on the GPU; transcripts: book
# 07's GPU transcripts re-run, the book and its CSVs copied into OUT_DIR). Put the A/B right after the build: a call stopped at its time limit has the measurements.
# Header-only dependencies the machine lacks (Eigen, doctest) may be given as a prefix in .deps/ (CMake config
# files included); a base tree (git archive of an older commit) as BASE_SOURCE_DIR. tests/gpu_prepare.sh COMMIT
# makes both, in .deps/ and .ab/base, folders .git/info/exclude ignores; the device call carries them.
# Everything lands in OUT_DIR and in one archive, OUT_DIR.tgz or GPU_SESSION_ARCHIVE where set, rewritten after
# each run and each step (a step also prints its seconds). A device call returns at most 8 files of its $OUT: keep OUT_DIR out
# of it and the archive in it, `GPU_SESSION_ARCHIVE=$OUT/s.tgz bash tests/gpu_session.sh /tmp/s .ab/base STEPS`.
# A device call stops at 600 s, and a session has 15 minutes of device time, the machine's start included: build,
# test, sanitize and ab took 446 s in the 2026-11-23 call. So one call, timeout 600, the steps in the order of
# what the session needs most (each compute-sanitizer tool and the profiler stop after SANITIZE_SECONDS, default
# 150, and each of the profiler's three runs after PROFILE_SECONDS, 200); what a call stopped at its limit did not reach goes to a second call on the
# still-warm machine where time is left (the build step then rebuilds nothing). Exit status 1 where a build, a test, a
# tool or a run failed (each one listed at the end), 0 where every command exited 0.
set -uo pipefail
usage="usage: bash tests/gpu_session.sh OUT_DIR [BASE_SOURCE_DIR] [STEPS] (on the GPU machine; the header of this file says more)"
if [[ ${1:-} == --help || ${1:-} == -h ]]; then
  sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
[[ $# -ge 1 && $# -le 3 && -n $1 && $1 != -* ]] || { echo "$usage" >&2; exit 2; }
out=$1
base=${2:-}
steps=${3:-build,ab,test,chunks,sanitize,profile,chapters}
known=",build,ab,chunks,test,sanitize,profile,chapters,transcripts,"
IFS=, read -ra step_list <<<"$steps"
for step in "${step_list[@]}"; do
  [[ $known == *",$step,"* ]] || { echo "gpu_session.sh: no step '$step' (steps: ${known:1:-1})" >&2; exit 2; }
done
mkdir -p "$out"  # only once the arguments are known good
# The archive, rewritten after every run (check, below) and every step, so that a call stopped at its time limit
# still returns everything done before, the runs of a step it stopped in included (a device call returns at most 8
# files; the archive is one). Written aside, then renamed: a call stopped during tar keeps the last whole archive.
archive_path=${GPU_SESSION_ARCHIVE:-$out.tgz}
archive() {
  tar -czf "$archive_path.part" -C "$(dirname "$out")" "$(basename "$out")" && mv -f "$archive_path.part" "$archive_path"
}
# After each step: its seconds, and the archive rewritten.
step_start=$SECONDS
step_done() {
  echo "-- step $1: $((SECONDS - step_start)) s (session so far: $SECONDS s)"
  archive
  step_start=$SECONDS
}
jobs=$(nproc)
# What failed, for the last lines and the exit status: a call whose tests, tools or runs failed must not return 0.
# Every run, tool and table goes through check, which then rewrites the archive.
failed=()
check() {  # STATUS WHAT
  [[ $1 == 0 ]] || failed+=("$2 (exit $1)")
  archive
}
# The breakdowns' models (03_benchmark's flags): the shipped one, and book 07's synthetic one (fp32, 2048 wide).
shipped="--breakdown --lengths 32,512,1984 --max-new-tokens 64"
synthetic="--synthetic 2048,16,16,4 --memory-limit 70GiB --breakdown --max-new-tokens 32"
prefix=(); [[ -d .deps ]] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.deps")
configure() {  # source dir, build dir
  cmake -S "$1" -B "$2" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DKVS_CUDA=ON "${prefix[@]}" >"$out/configure_$(basename "$2").log" 2>&1
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
step_build() {
  start=$SECONDS
  # Each build's own exit status: on a warm machine (a second call) the first call's binaries are still there, so
  # a build that fails must stop the session rather than leave an older binary to be measured as this one.
  rm -f "$out/build.log" "$out/build_base.log"  # a second call's failed configure must not show the first call's log
  (configure . build/release && cmake --build build/release -j "$jobs" >"$out/build.log" 2>&1) &
  local release_pid=$! base_pid="" release_status base_status=0
  if [[ -n $base ]]; then
    (configure "$base" build/base && cmake --build build/base -j "$jobs" --target 03_benchmark kvs_cuda >"$out/build_base.log" 2>&1) &
    base_pid=$!
  fi
  wait "$release_pid"; release_status=$?
  [[ -n $base_pid ]] && { wait "$base_pid"; base_status=$?; }
  echo "builds: $((SECONDS - start)) s; this tree: exit $release_status${base_pid:+, base: exit $base_status}"
  if [[ $release_status != 0 ]]; then
    echo "build failed"; tail -30 "$out/build.log" 2>/dev/null || tail -30 "$out/configure_release.log"
    step_done build; exit 1
  fi
  if [[ $base_status != 0 ]]; then  # the A/B then runs this build alone, and says so
    check "$base_status" "the base build"
    echo "the base build failed: no A/B this call"; tail -10 "$out/build_base.log" 2>/dev/null || tail -10 "$out/configure_base.log"
    rm -f build/base/bin/03_benchmark
  fi
  tail -3 "$out/build.log"
  step_done build
}
step_ab() {
  # First a quick check that this build's replayed decode steps are the forward pass's on this GPU (graphs and
  # programmatic launch included): numbers from a wrong build are worth nothing.
  build/release/bin/kvs_tests -tc='recorded decoding:*' >"$out/smoke.log" 2>&1; smoke=$?
  echo "smoke (recorded decoding on the GPU): exit $smoke"; tail -3 "$out/smoke.log"; check $smoke "smoke"
  if [[ $smoke != 0 ]]; then  # programmatic launch not yet run on a GPU (book 07): the session goes on without it
    KVS_PROGRAMMATIC_LAUNCH=0 build/release/bin/kvs_tests -tc='recorded decoding:*' >"$out/smoke_plain.log" 2>&1 &&
      { export KVS_PROGRAMMATIC_LAUNCH=0; echo "smoke passes with KVS_PROGRAMMATIC_LAUNCH=0: the rest of this call runs with it"; }
  fi
  builds=(release); [[ -x build/base/bin/03_benchmark ]] && builds=(base release)
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    for b in "${builds[@]}"; do
      build/$b/bin/03_benchmark --backend cuda $shipped --csv "$out/shipped_${b}_$round.csv" >"$out/shipped_${b}_$round.log" 2>&1
      check $? "ab: shipped, $b, round $round"
      build/$b/bin/03_benchmark --backend cuda $synthetic --lengths 512,4096 --csv "$out/synthetic_${b}_$round.csv" >"$out/synthetic_${b}_$round.log" 2>&1
      check $? "ab: synthetic, $b, round $round"
      echo "== round $round, $b"; grep -A4 "  context     step" "$out/shipped_${b}_$round.log" | tail -4
      grep -A3 "  context     step" "$out/synthetic_${b}_$round.log" | tail -3; grep -A3 "  context  prefill" "$out/synthetic_${b}_$round.log" | tail -2
    done
    # This build's kernels launched plainly, each waiting for the one before to finish (cuda_support.h): what
    # programmatic dependent launch saves on the shipped model, whose step is mostly launches.
    KVS_PROGRAMMATIC_LAUNCH=0 build/release/bin/03_benchmark --backend cuda $shipped --csv "$out/shipped_plain_$round.csv" \
      >"$out/shipped_plain_$round.log" 2>&1
    check $? "ab: shipped, KVS_PROGRAMMATIC_LAUNCH=0, round $round"
    echo "== round $round, release with KVS_PROGRAMMATIC_LAUNCH=0"; grep -A4 "  context     step" "$out/shipped_plain_$round.log" | tail -4
  done
  build/release/bin/03_benchmark --backend cpu --threads 1 $shipped --csv "$out/shipped_cpu1.csv" >"$out/shipped_cpu1.log" 2>&1
  check $? "ab: one CPU core"
  echo "== one CPU core"; grep -A4 "  context     step" "$out/shipped_cpu1.log" | tail -4
  python3 tests/gpu_ab_table.py "$out" >"$out/ab_table.md" 2>&1; check $? "the A/B table"
  echo "== the A/B as book 07's tables (ab_table.md)"
  cat "$out/ab_table.md"
  step_done ab
}
# setting_runs NAME VARIABLE=VALUE WHEN: this build's breakdowns with that setting, the synthetic model at 512, 2,048,
# 4,096 and 16,384 positions and the shipped one, into synthetic_NAME.csv and shipped_NAME.csv (and .log).
setting_runs() {
  env "$2" build/release/bin/03_benchmark --backend cuda $synthetic --lengths 512,2048,4096,16384 \
    --csv "$out/synthetic_$1.csv" >"$out/synthetic_$1.log" 2>&1
  local synthetic_status=$?
  env "$2" build/release/bin/03_benchmark --backend cuda $shipped --csv "$out/shipped_$1.csv" >"$out/shipped_$1.log" 2>&1
  local shipped_status=$?
  check $synthetic_status "$2: synthetic"; check $shipped_status "$2: shipped"
  echo "== $3, $2: exit $synthetic_status (synthetic), $shipped_status (shipped)"
  tail -1 "$out/synthetic_$1.log" | grep error; grep -A4 "  context     step" "$out/synthetic_$1.log" | tail -4
}
step_chunks() {
  # Decoding's chunks (KVS_DECODE_CHUNKS=SPLITS,ROWS, default 64,16): more, shorter chunks keep more of the GPU
  # busy - at 512 positions chunks of 64 rows (64,64, the default until 2026-11-27) are 9 a KV head, 36 blocks of
  # the synthetic model on 132 SMs, each warp four rounds of rows; chunks of 16, 132 to 136 blocks, made the step
  # 11-13% shorter - but the last block of each KV head merges every chunk's partial. 64,16 and 64,64 cut alike
  # from 4,033 rows on; between 1,024 and 4,032 (the synthetic model's 2,048 here, the shipped one's 1,984) they
  # differ, unmeasured until this step ran whole; past 1,024 rows 128,16 and 256,16 make more chunks than 64,16
  # (128,16 alike up to 2,048). Each setting in turn, the synthetic model at 512, 2,048, 4,096 and 16,384
  # positions and the shipped one; CHUNKS (space-separated) replaces the settings, CHUNKS_ROUNDS (default 1: one
  # build, no drift between builds to interleave against) repeats them. Their rows join ab_table.md.
  # The products' blocks (KVS_GEMV_WARPS=W, default 4: the most warps a block of gemv_kernel takes): an H100 read
  # the smaller products at 1.6 TB/s and the largest at 2.5 (book 07); blocks of fewer warps are as many blocks,
  # smaller, each sweeping more of d_in, and more of them fit on the GPU at once (q/k/v's 768 blocks of 4 warps
  # do not all fit: 660 a wave). Each setting in turn, version 8's chunks (the 64,16 row above is 4 warps);
  # GEMV_WARPS (space-separated) replaces the settings.
  for round in $(seq 1 "${CHUNKS_ROUNDS:-1}"); do
    # The default's cut first, the products' warps next (the default's row is their baseline), then the other
    # cuts: a call stopped at its time limit keeps the comparisons it finished (the archive follows every run).
    chunk_list=(${CHUNKS:-64,16 64,64 128,16 256,16})
    ((${#chunk_list[@]})) && setting_runs "chunks-${chunk_list[0]/,/-}_$round" KVS_DECODE_CHUNKS="${chunk_list[0]}" "round $round"
    for warps in ${GEMV_WARPS:-1 2}; do
      setting_runs "gemv-warps-${warps}_$round" KVS_GEMV_WARPS="$warps" "round $round"
    done
    for chunks in "${chunk_list[@]:1}"; do
      setting_runs "chunks-${chunks/,/-}_$round" KVS_DECODE_CHUNKS="$chunks" "round $round"
    done
  done
  python3 tests/gpu_ab_table.py "$out" >"$out/ab_table.md" 2>&1; check $? "the A/B table, with the chunks"
  echo "== ab_table.md, the chunks' and the products' rows with the A/B's"
  cat "$out/ab_table.md"
  step_done chunks
}
step_test() {
  start=$SECONDS
  (cd build/release && ctest -j "$jobs" -LE book --timeout 600 >"$out/ctest.log" 2>&1)
  status=$?; check $status ctest
  echo "ctest: exit $status, $((SECONDS - start)) s"; grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Skipped" "$out/ctest.log" | head -20
  step_done test
}
step_sanitize() {
  kernels='cuda kernels:*,batched attention:*,paged attention:*,attention: rows past*,batched cache write:*,'
  kernels+='batched decode through pools:*'
  for tool in memcheck racecheck; do
    # racecheck without the recorded decoding's 1,000 replayed steps: they took it past 110 s (H100, 2026-11-26)
    cases=${SANITIZE_CASES:-$kernels}; [[ $tool == memcheck && -z ${SANITIZE_CASES:-} ]] && cases+=',recorded decoding:*'
    # a time limit each (exit 124), so that a slow tool cannot eat the steps after it
    timeout "${SANITIZE_SECONDS:-150}" compute-sanitizer --tool $tool --error-exitcode 99 build/release/bin/kvs_tests \
      -tc="$cases" >"$out/sanitizer_$tool.log" 2>&1
    status=$?; check $status "compute-sanitizer $tool"
    # memcheck ends with "ERROR SUMMARY", racecheck with "RACECHECK SUMMARY: N hazards displayed"
    summary='(ERROR|RACECHECK) SUMMARY'
    echo "compute-sanitizer $tool: exit $status ($(grep -cE "$summary" "$out/sanitizer_$tool.log") summaries: $(grep -E "$summary" "$out/sanitizer_$tool.log" | sort | uniq -c | tr '\n' ' '))"
  done
  step_done sanitize
}
# stall_profile NAME KERNEL_REGEX SKIP COUNT [VARIABLE=VALUE ...]: Nsight Compute's warp-state sections on COUNT
# launches of the kernels KERNEL_REGEX matches, after SKIP of them, in the synthetic model's decode steps at 4,096
# positions, the run given the settings after COUNT. Every metric
# in profile_NAME.csv (--page raw: the per-reason stalls among them, smsp__average_warps_issue_stalled_*_per_issue_
# active.ratio, where the details page shows only each section's summary), the stalls as a table in stalls_NAME.md.
stall_profile() {
  env "${@:5}" timeout "${PROFILE_SECONDS:-200}" ncu --clock-control none --kernel-name regex:"$2" --launch-skip "$3" \
    --launch-count "$4" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --csv --page raw --print-units base \
    --log-file "$out/profile_$1.csv" build/release/bin/03_benchmark --backend cuda --synthetic 2048,16,16,4 \
    --memory-limit 70GiB --breakdown --lengths 4096 --max-new-tokens 8 >"$out/profile_$1_run.log" 2>&1
  local status=$?; check $status "ncu, stalls of $1"
  echo "ncu, what the warps of $1 wait on: exit $status"
  python3 tests/gpu_stall_table.py "$out/profile_$1.csv" >"$out/stalls_$1.md" 2>&1; check $? "the stall table of $1"
  cat "$out/stalls_$1.md"
}
step_profile() {
  # The synthetic model's decode kernels one by one under Nsight Compute: each kernel's own time and the bytes it
  # reads from DRAM, against the ~3 TB/s a step could reach - which kernels keep a step from its bandwidth
  # (book 07; tests/gpu_kernel_profile.py makes the table). Two steps' 166 launches of the project's kernels
  # (83 a step: 5 a layer and 3) after the first 400: past the warm-up's prefill at 4,096 positions (147: 9 a
  # layer, cuBLAS's products not counted, and 3) and within its 7 decode steps (147 + 7 x 83 = 728); 166
  # consecutive launches hold each of a step's 83 twice.
  # --clock-control none: the clocks as the GPU sets them (ncu otherwise locks them to base, slower than a run).
  if command -v ncu >/dev/null; then
    timeout "${PROFILE_SECONDS:-200}" ncu --clock-control none --csv --page raw --print-units base --log-file "$out/profile_ncu.csv" \
      --kernel-name regex:'^(embed|rmsnorm|rope|write|attention|gemv|swiglu|add)_' \
      --launch-skip 400 --launch-count 166 \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
      build/release/bin/03_benchmark --backend cuda --synthetic 2048,16,16,4 --memory-limit 70GiB --breakdown \
      --lengths 4096 --max-new-tokens 8 >"$out/profile_run.log" 2>&1
    status=$?; check $status "ncu, kernel profile"
    echo "ncu: exit $status"
    python3 tests/gpu_kernel_profile.py "$out/profile_ncu.csv" >"$out/profile.md" 2>&1; check $? "the kernel profile's table"
    cat "$out/profile.md"
    # The decoding kernel once more, one launch past the first decode steps, with what its warps wait on: its time
    # hardly depends on the rows it reads (book 07, version 6), so the stall reasons say what a round of rows waits
    # for (memory, shuffles, the exponentials).
    stall_profile attention '^attention_decode' 40 1
    # The same for five consecutive products of a decode step (each of a layer's four, q/k/v, Wo, W1/W3 and W2,
    # at least once; their grids, 768, 512, 1,408 and 512 blocks, and their order tell them apart): why q/k/v and
    # Wo read at ~1.55 TB/s where W1/W3 reach 2.5 (book 07).
    stall_profile gemv '^gemv_kernel' 200 5
    # The same five with blocks of one warp (the chunks step's KVS_GEMV_WARPS=1): the setting changes every product,
    # and a step's time cannot say which it made faster and which slower; each kernel's time here can.
    stall_profile gemv-warps-1 '^gemv_kernel' 200 5 KVS_GEMV_WARPS=1
  else
    echo "ncu is not on the PATH: no kernel profile"
  fi
  step_done profile
}
step_chapters() {
  # Chapter 08's serve on the GPU: every output of a batch (up to 64 sequences a step, so the fused products' tiles
  # of 8 and the split decoding) checked against the request served alone; it exits 1 where one differs.
  build/release/bin/08_paged_batching --backend cuda --experiment serve --requests 64 >"$out/serve_gpu.log" 2>&1
  status=$?; check $status "chapter 08 serve"
  echo "== chapter 08 serve on the GPU: exit $status"; tail -2 "$out/serve_gpu.log"
  build/release/bin/08_paged_batching --backend cuda --experiment throughput --csv "$out/batch_throughput_gpu.csv" \
    >"$out/batch_throughput_gpu.log" 2>&1
  status=$?; check $status "chapter 08 throughput"
  echo "== chapter 08 throughput on the GPU: exit $status"; tail -12 "$out/batch_throughput_gpu.log"
  # The synthetic model twice more with the fused products limited to 8 tokens (9 to 64: cuBLAS and the small
  # kernels), interleaved with the default (tiles of 8 up to 64): which serves a large model's batch faster.
  for run in 1 2; do
    for limit in 64 8; do
      name=batch_throughput_synthetic_gpu; [[ $limit == 8 ]] && name+=_gemv8; [[ $run == 2 ]] && name+=_run2
      KVS_GEMV_MAX_TOKENS=$limit build/release/bin/08_paged_batching --backend cuda --experiment throughput \
        --synthetic 2048,16,16,4 --kv-memory 1GiB --memory-limit 16GiB --prompt-lengths 16,16 --output-lengths 64,64 \
        --csv "$out/$name.csv" >"$out/$name.log" 2>&1
      status=$?; check $status "chapter 08 throughput, synthetic, $limit tokens, run $run"
      echo "== chapter 08 throughput, synthetic 2048,16,16,4, fused products up to $limit tokens, run $run: exit $status"
      tail -12 "$out/$name.log"
    done
  done
  build/release/bin/10_quantized_cache --backend cuda --experiment speed --csv "$out/kv_format_speed_gpu.csv" \
    >"$out/kv_format_speed_gpu.log" 2>&1
  status=$?; check $status "chapter 10 speed"
  echo "== chapter 10 speed on the GPU: exit $status"; tail -12 "$out/kv_format_speed_gpu.log"
  step_done chapters
}
step_transcripts() {
  # Book 07's GPU transcripts and their CSVs are named for the H100 they were captured on: another card's numbers
  # would land under that name.
  if ! grep -q "H100" "$out/gpu.txt"; then  # the card named at the start of the session
    echo "transcripts: skipped, this GPU is not an H100 (book 07's GPU transcripts and CSVs are the H100's)"
    step_done transcripts; return
  fi
  python3 book/transcripts.py --gpu-only book/07_the_same_cache_on_a_gpu.md >"$out/transcripts.log" 2>&1
  status=$?; check $status transcripts
  echo "transcripts: exit $status"; tail -5 "$out/transcripts.log"; cp book/07_the_same_cache_on_a_gpu.md "$out/"
  cp -r plots/data/gpu "$out/plots_data_gpu"
  step_done transcripts
}
for step in "${step_list[@]}"; do
  step_start=$SECONDS
  "step_$step"
done
if ((${#failed[@]})); then
  echo "FAILED, ${#failed[@]}:"; printf '  %s\n' "${failed[@]}"
  exit 1
fi
echo "every step's commands exited 0"
