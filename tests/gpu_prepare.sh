#!/usr/bin/env bash
# Run here, before the one device call of a session lent a GPU (tests/gpu_session.sh says what that call does):
# makes what the GPU machine lacks and the call must carry - the header-only Eigen and doctest as a prefix in
# .deps/ (their CMake config files included, doctest's made relocatable), and an older tree to compare with in
# .ab/base (a git archive of BASE_COMMIT). Both folders are ignored through .git/info/exclude, never committed.
# Usage, from the repository root: bash tests/gpu_prepare.sh BASE_COMMIT
set -euo pipefail
if [[ ${1:-} == --help || ${1:-} == -h ]]; then sed -n '2,/^set -euo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."  # .deps and .ab belong at the repository root, where the device call runs
base=${1:?usage: gpu_prepare.sh BASE_COMMIT (the commit to compare with, e.g. the last one measured on a GPU)}
git rev-parse --verify --quiet "$base^{commit}" >/dev/null || { echo "gpu_prepare.sh: no commit $base" >&2; exit 2; }
for path in /usr/include/eigen3 /usr/include/doctest /usr/share/eigen3/cmake /usr/lib/cmake/doctest; do
  [[ -e $path ]] || { echo "gpu_prepare.sh: $path is missing; run common/install-deps.sh build first" >&2; exit 2; }
done
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for ignored in /.deps/ /.ab/; do
  grep -qxF "$ignored" "$exclude" 2>/dev/null || echo "$ignored" >>"$exclude"
done
rm -rf .deps .ab
mkdir -p .deps/include .deps/share/eigen3 .deps/lib/cmake .ab/base
cp -r /usr/include/eigen3 /usr/include/doctest .deps/include/
cp -r /usr/share/eigen3/cmake .deps/share/eigen3/
cp -r /usr/lib/cmake/doctest .deps/lib/cmake/
sed -i 's|set(_IMPORT_PREFIX "/usr")|get_filename_component(_IMPORT_PREFIX "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)|' \
  .deps/lib/cmake/doctest/doctestTargets.cmake
# Another doctest's file worded otherwise would keep /usr, found missing only on the GPU machine, in device minutes.
! grep -qF 'set(_IMPORT_PREFIX "/usr")' .deps/lib/cmake/doctest/doctestTargets.cmake ||
  { echo "gpu_prepare.sh: doctestTargets.cmake still names /usr: adapt the sed above to this doctest version" >&2; exit 1; }
git archive "$base" CMakeLists.txt CMakePresets.json common chapters tests | tar -x -C .ab/base
echo "made .deps ($(du -sh .deps | cut -f1)) and .ab/base ($(git rev-parse --short "$base"), $(du -sh .ab/base | cut -f1))."
echo "Now a device call, on an H100 (book 07's numbers are an H100's; another card's are not comparable):"
echo "run(command='GPU_SESSION_ARCHIVE=\$OUT/s.tgz bash tests/gpu_session.sh /tmp/s .ab/base build,ab,test,chunks,profile,sanitize,transcripts,chapters', carry=['.deps', '.ab'], kind='nvidia-h100-x1', timeout_s=600)"
echo "then, at once on the still-warm machine and only where device time is left, a second with the steps it did not reach (gpu_session.sh's header says why)"
