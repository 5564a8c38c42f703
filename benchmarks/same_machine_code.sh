#!/usr/bin/env bash
# Whether a change to the CUDA kernels changes the GPU machine code, without a GPU: builds
# every kernel translation unit of custom_ops/kernels/cuda to a cubin per SM version (the
# CUDA_ARCHS default, 80 and 90), once from git revision REV and once from the working tree,
# and compares the bytes. Identical cubins run identically, so a refactor that passes this
# needs no new GPU timing; a different cubin needs benchmarks/gpu_check.sh on a GPU.
#
#   benchmarks/same_machine_code.sh REV [SM ...]
#
# Exit status 0 when every cubin is identical, 1 when one differs, 2 when a build fails,
# 3 when a unit's cubin is not reproducible from one build to the next (it is named "unknown").
# nvcc only; about 2 minutes per SM version on 2 cores.
set -u -o pipefail

REV=${1:?usage: benchmarks/same_machine_code.sh REV [SM ...]}
shift
SMS=("${@:-80 90}")
read -r -a SMS <<<"${SMS[*]}"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Both sides are built from one path: a translation unit that names its file (assert,
# __FILE__) embeds the path in its cubin.
SRC="$WORK/src"
units=$(cd "$ROOT" && ls custom_ops/kernels/cuda/*.cu)

build_all() {  # build_all OUT_DIR: every unit of $SRC, every SM
  mkdir -p "$1"
  for unit in $units; do
    [ -f "$SRC/$unit" ] || continue
    for sm in "${SMS[@]}"; do
      nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I"$SRC/custom_ops" \
        -gencode "arch=compute_$sm,code=sm_$sm" -cubin \
        -o "$1/$(basename "$unit" .cu)_sm$sm.cubin" "$SRC/$unit" || exit 2
    done
  done
}

mkdir -p "$SRC"
git -C "$ROOT" archive "$REV" custom_ops | tar -x -C "$SRC" || exit 2
build_all "$WORK/a"
rm -rf "$SRC/custom_ops"
cp -r "$ROOT/custom_ops" "$SRC/custom_ops"
build_all "$WORK/b"

status=0
for unit in $units; do
  for sm in "${SMS[@]}"; do
    name="$(basename "$unit" .cu)_sm$sm.cubin"
    if [ ! -f "$WORK/a/$name" ]; then
      echo "new      $unit (not in $REV)"
    elif cmp -s "$WORK/a/$name" "$WORK/b/$name"; then
      echo "same     $unit sm_$sm"
    else
      # A unit with an anonymous namespace gets a fresh mangled name per nvcc run: its
      # cubins differ from build to build, and this check cannot speak for it.
      mkdir -p "$WORK/c"
      nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I"$SRC/custom_ops" \
        -gencode "arch=compute_$sm,code=sm_$sm" -cubin -o "$WORK/c/$name" "$SRC/$unit" || exit 2
      if cmp -s "$WORK/b/$name" "$WORK/c/$name"; then
        echo "DIFFERS  $unit sm_$sm ($(stat -c%s "$WORK/a/$name") -> $(stat -c%s "$WORK/b/$name") bytes)"
        status=1
      else
        echo "unknown  $unit sm_$sm (two builds of the same source differ: not comparable here)"
        [ $status -eq 0 ] && status=3
      fi
    fi
  done
done
exit $status
