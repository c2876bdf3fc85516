#!/usr/bin/env bash
# GPU runs of issue 34 on one 4-GPU host (nvidia-h100-x4 or -h200-x4), one device call a section,
# each kept under 9 minutes:
#   bench    the copy-engine all-reduce: correct and alone at sub-chunks auto,1,2,4,8; its
#            parts alone (one-row round, pulls, pushes, reduction); beside the `ug` GEMM
#   attention  the all-reduces beside the decode attention (ce_allreduce.py --attention), and
#            the fixed cost of a call taken apart (ce_latency.py)
#   tests    GPU tests of the copy-engine all-reduce (tp 2 and 4, whole and sub-chunked,
#            graphs) and of tp models on it
#   profile  one part of the full-grid Llama-3-70B tp 4 profile: stops before PROFILE_LIMIT_S
#            (default 500) s, resumes from wip/PROFILE.partial.json when that file is there
# as `bench/kernels/ce_run.sh SECTION` from the repository root. Records and logs go to $OUT,
# else bench/results/. Between profile parts, copy the returned PROFILE.partial.json into
# wip/ of the checkout (an untracked folder: it travels with the working tree, never commit
# it); the part that finishes returns PROFILE.json (exit 0; a part that stopped exits 75).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
# the profile is named after the GPUs it is measured on (h100x4, h200x4, ...)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -o 'H[0-9]00' \
    | tr 'H' 'h')
PROFILE=profile-llama3-70b-tp4-${GPU:-gpu}x4

case "${1:-}" in
bench)
    timeout 540 python bench/kernels/ce_allreduce.py --world 4 --subchunks auto,1,2,4,8 \
        >"$OUT/ce_allreduce.log" 2>&1
    echo "bench: exit $?"
    tail -n 60 "$OUT/ce_allreduce.log" ;;
attention)
    timeout 300 python bench/kernels/ce_allreduce.py --world 4 --quick --subchunks 1 --no-beside \
        --attention >"$OUT/ce_attention.log" 2>&1
    echo "attention: exit $?"
    tail -n 12 "$OUT/ce_attention.log"
    timeout 120 python bench/kernels/ce_latency.py --world 4 >"$OUT/ce_latency.log" 2>&1
    echo "latency: exit $?"
    tail -n 22 "$OUT/ce_latency.log" ;;
tests)
    timeout 540 python -m pytest -m gpu -q tests/gpu/test_ce_allreduce_gpu.py \
        tests/gpu/test_tp_gpu.py 2>&1 | tail -n 40 ;;
profile)
    mkdir -p wip
    resume=()
    [ -f "wip/$PROFILE.partial.json" ] && resume=(--resume)
    python -m nanosched.cli profile --gpu 0 --model llama3-70b --tp 4 --no-progress \
        --out "wip/$PROFILE.json" --time-limit "${PROFILE_LIMIT_S:-500}" "${resume[@]}" \
        >"$OUT/$PROFILE.log" 2>&1
    code=$?
    cp wip/"$PROFILE".*json "$OUT"/ 2>/dev/null  # the partial file, or the profile
    echo "profile: exit $code (0: done, 75: stopped at the limit, go on with the partial)"
    tail -n 30 "$OUT/$PROFILE.log" ;;
*)
    echo "usage: $0 bench|attention|tests|profile" >&2
    exit 2 ;;
esac
