#!/usr/bin/env bash
# book/transcripts.py itself, outside --check (which writes nothing): on a scratch chapter, it writes each command
# and its output into the block, under the machine line; leaves a chapter whose command fails, or whose block printed
# nothing, as it was, and exits 1. (A change once left every regenerated block empty, and --check could not see it.)
# Usage: bash tests/transcripts_check.sh PYTHON3 (from anywhere).
set -euo pipefail
python=${1:?usage: transcripts_check.sh PYTHON3}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chapter() {  # FILE COMMAND...: a chapter of one block holding these commands and stale output
  local file=$1; shift
  { printf '# test\n\n<!-- transcript -->\n```text\n'; printf '$ %s\n' "$@"; printf 'stale output\n```\nafter\n'; } >"$file"
}
transcripts() { "$python" "$root/book/transcripts.py" --only . "$@"; }  # --only: no figures redrawn

chapter "$work/ok.md" "echo hello" "printf 'a\\n\$ b\\n'"
transcripts "$work/ok.md" 2>"$work/ok.log" || { echo "transcripts.py failed on commands that succeed"; cat "$work/ok.log"; exit 1; }
expected=$(printf '# test\n\n<!-- transcript -->\n```text\n$ echo hello\nhello\n$ printf '"'"'a\\n$ b\\n'"'"'\na\n $ b\n```')
[[ $(head -n 10 "$work/ok.md") == "$expected" ]] || { echo "the block is not each command and its output:"; cat "$work/ok.md"; exit 1; }
sed -n 11p "$work/ok.md" | grep -q '^<sub>Captured by `book/transcripts.py`' || { echo "no machine line under the block"; cat "$work/ok.md"; exit 1; }
[[ $(sed -n 12p "$work/ok.md") == after ]] || { echo "the text after the block moved"; cat "$work/ok.md"; exit 1; }

for bad in "false" "echo hello | sed -n /nothing-matches/p"; do  # a failure; exit 0 but nothing printed
  chapter "$work/bad.md" "$bad"
  cp "$work/bad.md" "$work/before.md"
  if transcripts "$work/bad.md" 2>"$work/bad.log"; then echo "transcripts.py exited 0 after '$bad'"; exit 1; fi
  cmp -s "$work/bad.md" "$work/before.md" || { echo "transcripts.py changed the chapter after '$bad'"; exit 1; }
done
echo "transcripts.py: ok"
