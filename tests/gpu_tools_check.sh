#!/usr/bin/env bash
# The GPU session's tools, checked where there is no GPU (a lent GPU's minutes are too few to find a typo in them):
# tests/gpu_session.sh parses, refuses an unknown step, exits 1 when its runs fail and archives after every run; tests/gpu_ab_table.py makes the A/B table, the chunks
# step's rows (decoding's chunks, the products' warps) included, from breakdown CSVs named as gpu_session.sh names them (a stored GPU run's CSV stands in);
# tests/gpu_stall_table.py makes the stall table, tests/gpu_kernel_profile.py the kernel profile's; the patch back to
# version 8's decoding kernel applies.
# Usage: bash tests/gpu_tools_check.sh PYTHON3 (from anywhere).
set -euo pipefail
python=${1:?usage: gpu_tools_check.sh PYTHON3}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bash -n "$root/tests/gpu_session.sh"
if bash "$root/tests/gpu_session.sh" "$work/session" "" build,nonsense >"$work/refused.log" 2>&1; then
  echo "gpu_session.sh ran an unknown step"; exit 1
fi
grep -q "no step 'nonsense'" "$work/refused.log" || { echo "gpu_session.sh refused an unknown step without naming it"; exit 1; }
[[ ! -e $work/session ]] || { echo "gpu_session.sh made OUT_DIR before refusing its steps"; exit 1; }
# --help prints the header and runs nothing (it once took --help as OUT_DIR and started the build).
(cd "$work" && bash "$root/tests/gpu_session.sh" --help) >"$work/help.log" 2>&1 || { echo "gpu_session.sh --help failed"; exit 1; }
grep -q "^STEPS: a comma-separated list" "$work/help.log" || { echo "gpu_session.sh --help lacks the steps"; exit 1; }
[[ ! -e $work/--help ]] || { echo "gpu_session.sh --help made a folder"; exit 1; }
# A step whose runs fail (here: no binaries in an empty folder, so every one exits 127) makes the session exit 1 and
# list them; it once exited 0 after failed tests, with the archive's tar the last status.
if (cd "$work" && mkdir empty && cd empty && env -u GPU_SESSION_ARCHIVE bash "$root/tests/gpu_session.sh" "$work/failing" "" chapters) >"$work/failing.log" 2>&1; then
  echo "gpu_session.sh exited 0 after its runs failed"; cat "$work/failing.log"; exit 1
fi
grep -q "^FAILED, 7:" "$work/failing.log" || { echo "gpu_session.sh did not list its 7 failed runs"; cat "$work/failing.log"; exit 1; }
grep -q "^  chapter 10 speed (exit 127)" "$work/failing.log" || { echo "gpu_session.sh did not name a failed run"; exit 1; }
# The archive follows every run, not only every step (a call stopped in the middle of a step keeps its runs so far):
# the same step again with a tar that counts its calls, 7 runs and the step's end. Then the archive holds the runs'
# logs, and no half-written one is left.
mkdir "$work/bin"
printf '#!/bin/sh\necho "$2" >>"%s/tar_calls"\nexec %s "$@"\n' "$work" "$(command -v tar)" >"$work/bin/tar"  # $2: -czf's file
chmod +x "$work/bin/tar"
(cd "$work/empty" && env -u GPU_SESSION_ARCHIVE PATH="$work/bin:$PATH" bash "$root/tests/gpu_session.sh" "$work/counted" "" chapters) \
  >/dev/null 2>&1 || true
calls=$(wc -l <"$work/tar_calls")
# written aside every time (then renamed): a call stopped during tar keeps the last whole archive
[[ $(sort -u "$work/tar_calls") == "$work/counted.tgz.part" ]] || { echo "gpu_session.sh wrote its archive in place:"; cat "$work/tar_calls"; exit 1; }
[[ $calls == 8 ]] || { echo "gpu_session.sh archived $calls times in a step of 7 runs (expected 8: after each run and at the end)"; exit 1; }
# Listed to a file first: under pipefail, `tar -t | grep -q` fails whenever grep stops reading before tar has written
# its last name (tar dies of SIGPIPE), which depends on the names' order and on timing: it failed CI once.
tar -tzf "$work/counted.tgz" >"$work/counted.list" || { echo "cannot list the archive $work/counted.tgz"; exit 1; }
grep -q 'counted/kv_format_speed_gpu.log' "$work/counted.list" || { echo "the archive lacks the step's last log"; exit 1; }
[[ ! -e $work/counted.tgz.part ]] || { echo "gpu_session.sh left a half-written archive"; exit 1; }
csv=$root/plots/data/gpu/breakdown_h100_synthetic_cuda_v6.csv
mkdir "$work/out"
for name in synthetic_base_1 synthetic_release_1 synthetic_gemv-warps-2_1 synthetic_chunks-128-16_1 synthetic_chunks-32-64_1 \
  synthetic_chunks-64-64_1 synthetic_gemv-warps-1_1; do
  cp "$csv" "$work/out/$name.csv"
done
"$python" "$root/tests/gpu_ab_table.py" "$work/out" >"$work/table.md"
cat "$work/table.md"
# The rows in order (base, this build, the chunks settings by their numbers, then the products' warps by theirs),
# each with the CSV's numbers: step 1.763 ms, graph 1.726 ms, attention 0.660 ms at 512 positions.
rows=$(grep -c '^| 512 |' "$work/table.md")
[[ $rows == 7 ]] || { echo "expected 7 rows at 512 positions, got $rows"; exit 1; }
order=$(grep '^| 512 |' "$work/table.md" | cut -d'|' -f3 | tr -s ' ' | paste -sd';')
expected=" base ; this build ; this build, KVS_DECODE_CHUNKS=32,64 ; this build, KVS_DECODE_CHUNKS=64,64 ; this build, KVS_DECODE_CHUNKS=128,16 "
expected+="; this build, KVS_GEMV_WARPS=1 ; this build, KVS_GEMV_WARPS=2 "
[[ $order == "$expected" ]] || { echo "rows in the wrong order: $order"; exit 1; }
grep -q '^| 512 | this build, KVS_DECODE_CHUNKS=128,16 | 1.763 | 1.726 | 0.660 | 83 |' "$work/table.md" ||
  { echo "the chunks row lost the CSV's numbers"; exit 1; }
grep -q '^| 512 | this build, KVS_GEMV_WARPS=1 | 1.763 | 1.726 | 0.660 | 83 |' "$work/table.md" ||
  { echo "the products' warps row lost the CSV's numbers"; exit 1; }
# The stall table, from a CSV laid out as ncu 2025.3 wrote the kernel profile's on the H100 (a units row under the
# header, the kernel's full name, numbers with thousands separators); its numbers are made up.
cat >"$work/stalls.csv" <<'CSV'
==PROF== Connected to process 1234
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","gpu__time_duration.sum","sm__warps_active.avg.pct_of_peak_sustained_active","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio"
"","","","","","","","","","","","ns","%","inst","inst","inst"
"0","1234","03_benchmark","h","void kvs::<unnamed>::attention_decode_kernel<4, 1, true>(float *, kvs::<unnamed>::DecodeChunks, int)","1","13","(128, 1, 1)","(4, 64, 1)","0","9.0","47,300","12.1","3.50","0.25","1.25"
CSV
"$python" "$root/tests/gpu_stall_table.py" "$work/stalls.csv" >"$work/stalls.md"
cat "$work/stalls.md"
grep -qF '| `attention_decode_kernel<4, 1, true>` | (4, 64, 1) | 47.3 | 12% | 5.00 in all: long_scoreboard 3.50 (70%), short_scoreboard 1.25 (25%), barrier 0.25 (5%) |' \
  "$work/stalls.md" || { echo "the stall table lost the CSV's numbers or their order"; exit 1; }
# The kernel profile's table (gpu_kernel_profile.py), from a CSV laid out as ncu wrote it (a units row, full names):
# one decode step of three launches, the two products' numbers made up to give round figures.
cat >"$work/profile.csv" <<'CSV'
==PROF== Connected to process 1234
"ID","Kernel Name","Grid Size","gpu__time_duration.sum","dram__bytes_read.sum","launch__registers_per_thread","sm__warps_active.avg.pct_of_peak_sustained_active"
"","","","ns","byte","register/thread","%"
"0","void kvs::<unnamed>::embed_kernel(float *, const float *, const int *, int)","(1, 1, 1)","1,000","512","16","3.0"
"1","void kvs::<unnamed>::gemv_kernel<1, 4, (kvs::<unnamed>::GemvStore)0>(kvs::<unnamed>::GemvArgs)","(768, 1, 1)","10,000","16,800,000","40","50.0"
"2","void kvs::<unnamed>::gemv_kernel<1, 4, (kvs::<unnamed>::GemvStore)0>(kvs::<unnamed>::GemvArgs)","(768, 1, 1)","10,000","16,800,000","40","60.0"
CSV
"$python" "$root/tests/gpu_kernel_profile.py" "$work/profile.csv" >"$work/profile.md"
cat "$work/profile.md"
grep -qF '| `gemv_kernel<1, 4, (GemvStore)0>` | (768, 1, 1) | 2 | 10.0 | 16.80 | 1680 | 95.2% | 40 | 55% |' "$work/profile.md" &&
  grep -qF '| `embed_kernel` | (1, 1, 1) | 1 | 1.0 | 0.00 | 1 | 4.8% | 16 | 3% |' "$work/profile.md" &&
  grep -qF 'Per decode step (1 profiled, 3.0 launches each): kernels 0.021 ms summed, 33.6 MB read from DRAM, 1600 GB/s'     "$work/profile.md" || { echo "the kernel profile's table lost the CSV's numbers"; exit 1; }
# The way back to version 8's decoding kernel, should version 9's measure slower (book 07): the patch still applies
# to this tree (an edit near the kernel's lines once made the recorded `git diff | git apply -R` fail).
(cd "$root" && git apply --check tests/gpu_version8_kernel.patch) ||
  { echo "tests/gpu_version8_kernel.patch no longer applies to common/cuda/cuda_backend.cu: remake it (book 07)"; exit 1; }
echo "gpu session tools: ok"
