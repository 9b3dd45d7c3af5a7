#!/usr/bin/env bash
# Decode on a busy machine: chapter 03 generates --tokens tokens (default 1000) with --threads 1 and --threads 2,
# first on an idle machine, then while BUSY other processes (default 2) each keep a core busy with a
# plain loop. Prints, per run, the whole generation's wall time and the per-token p50 and p99; writes them
# to CSV (default plots/data/busy_machine.csv): load, threads, run, total_ms, decode_ms_p50, decode_ms_p99.
#
#   bash chapters/03_preallocated_cache/busy_machine.sh [--build DIR] [--tokens N] [--runs N] [--busy N] [--csv PATH]
set -euo pipefail
script=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$root/build/release tokens=1000 runs=3 busy=2 csv=$root/plots/data/busy_machine.csv
shown=plots/data/busy_machine.csv  # the CSV's path in messages: as the caller gave it
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) sed -n 2,7p "$script" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --build|--tokens|--runs|--busy|--csv)
      [[ $# -ge 2 && -n $2 ]] || { echo "busy_machine.sh: $1 needs a value; see --help" >&2; exit 2; }
      # --build and --csv as the caller means them: relative to the folder the script was started from
      case "$1" in
        --build) build=$(realpath -m -- "$2") ;;
        --csv) csv=$(realpath -m -- "$2") shown=$2 ;;
        --tokens) tokens=$2 ;;
        --runs) runs=$2 ;;
        --busy) busy=$2 ;;
      esac
      shift 2 ;;
    *) echo "busy_machine.sh: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
# Checked before minutes of runs: a folder named as the CSV would have received all.csv inside it.
[[ ! -d $csv ]] || { echo "busy_machine.sh: --csv $shown is a folder; give a file's path" >&2; exit 2; }
cd "$root"
for n in "$tokens" "$runs" "$busy"; do
  [[ "$n" =~ ^[0-9]+$ && "$n" -ge 1 && "$n" -le 100000 ]] || { echo "busy_machine.sh: '$n' is not a whole number from 1 to 100000" >&2; exit 2; }
done
binary="$build/bin/03_preallocated_cache"
[[ -x "$binary" ]] || { echo "busy_machine.sh: $binary not found; build first (cmake --build $build)" >&2; exit 2; }

loops=()
stop_loops() { [[ ${#loops[@]} -gt 0 ]] && kill "${loops[@]}" 2>/dev/null; loops=(); }
tmp=$(mktemp -d)
trap 'stop_loops; rm -rf "$tmp"' EXIT
echo "load,threads,run,total_ms,decode_ms_p50,decode_ms_p99" > "$tmp/all.csv"
printf '%-28s %7s %4s %10s %10s %10s\n' load threads run "total ms" "p50 ms" "p99 ms" >&2
for load in idle busy; do
  if [[ $load == busy ]]; then
    for ((i = 0; i < busy; ++i)); do (while :; do :; done) & loops+=($!); done
    sleep 1
  fi
  label=$([[ $load == idle ]] && echo "idle" || echo "$busy other busy processes")
  for ((run = 1; run <= runs; ++run)); do
    for threads in 1 2; do
      "$binary" --max-new-tokens "$tokens" --threads "$threads" --csv "$tmp/run.csv" > /dev/null 2> "$tmp/log" ||
        { cat "$tmp/log" >&2; exit 1; }
      # run.csv: one row; columns by name (decode_ms_median is the p50).
      row=$(python3 -c 'import csv,sys; r=list(csv.DictReader(open(sys.argv[1])))[0]; print(r["total_ms"], r["decode_ms_median"], r["decode_ms_p99"])' "$tmp/run.csv")
      read -r total p50 p99 <<< "$row"
      printf '%-28s %7s %4s %10.1f %10.4f %10.4f\n' "$label" "$threads" "$run" "$total" "$p50" "$p99" >&2
      echo "$load,$threads,$run,$total,$p50,$p99" >> "$tmp/all.csv"
    done
  done
  stop_loops
done
mkdir -p "$(dirname "$csv")"
cp "$tmp/all.csv" "$csv"
echo "wrote $shown" >&2
