#!/usr/bin/env bash
# Profile Llama-3-8B on GPU 0: the --quick grid, then the full one; print the time each took.
# Writes to $OUT (or bench/results/) profile-*.json and the `profile show` output and plot.
# Usage: bench/tools/profile_run.sh [MODEL] [TP]      (defaults: llama3-8b 1)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-llama3-8b}
TP=${2:-1}
DEST=${OUT:-bench/results}
mkdir -p "$DEST"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stamp=$(date -u +%Y%m%dT%H%M%SZ)
for kind in quick full; do
  flag=""
  [ "$kind" = quick ] && flag="--quick"
  file="$DEST/profile-$MODEL-tp$TP-$kind-$stamp.json"
  start=$(date +%s)
  python -m nanosched.cli profile --gpu 0 --model "$MODEL" --tp "$TP" $flag --out "$file" \
    --no-progress 2>&1 | tee "$DEST/profile-$MODEL-tp$TP-$kind-$stamp.log"
  end=$(date +%s)
  echo "$kind profile of $MODEL tp $TP: $((end - start)) s wall" | tee -a "$DEST/profile-$MODEL-tp$TP-$kind-$stamp.log"
  python -m nanosched.cli profile show "$file" --plot "${file%.json}.png" \
    > "${file%.json}.txt"
done
