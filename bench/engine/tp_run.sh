#!/usr/bin/env bash
# GPU runs of the tensor-parallel engine on one 4-GPU host, one section per device call (each
# under the device's 10-minute limit; wall times measured on 4xH100):
#   70b        Llama-3-70B tp 4, 1024/512, 1,000 prompts, bf16 then FP8 KV          ~8 min
#   8b         Llama-3-8B tp 2 (GPUs 0,1) beside tp 1 (GPU 2), the same workload     ~2 min
#   tests      GPU tests of tp (NCCL, graphs, the server: needs .whl)               ~5 min
#   serve      serve --tp 4 (Llama-3-70B) with a client, then SIGTERM (needs .whl)   ~3 min
#   broadcast  what sending a step costs at tp 2 and 4 (tp_broadcast.py)            ~1 min
#   overlap-ce    70B tp 4, 1024/512, 500 prompts: Sequential, two_batch (one half's
#                 all-reduce beside the other's GEMMs), Sequential (A-B-A), all on the
#                 copy-engine all-reduce                                              ~7 min
#   overlap-nccl  the same on NCCL's all-reduce                                       ~7 min
#   overlap-sharegpt  the same as overlap-ce on ShareGPT lengths, 500 prompts         ~4 min
#   memory      where GPU memory goes between engines of one process (tp_memory.py)  ~3 min
#   aba ARM     one arm of the 1,000-prompt A-B-A across processes (the three in one process
#               take over a call's 10 minutes): `aba seq1`, `aba overlap`, `aba seq2`, in
#               that order on one machine: Sequential on NCCL, two_batch on the copy-engine
#               all-reduce, Sequential on NCCL; bench/tools/aba_merge.py joins them         ~5 min each
# as `bench/engine/tp_run.sh SECTION` from the repository root. Records (JSON, named as
# bench/results/ names them), logs and the GPUs' clock and power (nvidia-smi every second, a
# .smi.csv beside each record) go to $OUT, else bench/results/. The GPU image has no fastapi /
# uvicorn / httpx: carry their wheels as `.whl/dl/*.whl` (bench/engine/serve_poisson.py says
# which); they are unpacked here with Python's zipfile (the image has no unzip).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1
SITE=/tmp/nanosched-wheels
if [ -d .whl/dl ]; then
    mkdir -p "$SITE"
    for w in .whl/dl/*.whl; do python -m zipfile -e "$w" "$SITE"; done
fi
export PYTHONPATH=".:$SITE"
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
DAY=$(date -u +%Y%m%d)
GPU=$(python -c "import torch; n = torch.cuda.get_device_name(0); print('H200' if 'H200' in n else 'H100')")
W="--input-len 1024 --output-len 512 --num-prompts 1000 --graphs on"

bench() {  # bench NAME FLAGS...: one `nanosched bench` record, its log and its clock/power
    local name=$1; shift
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,utilization.gpu,memory.used \
        --format=csv -lms 1000 >"$OUT/$name-$GPU-$DAY.smi.csv" 2>/dev/null &
    local smi=$!
    python -m nanosched.cli bench "$@" --json "$OUT/$name-$GPU-$DAY.json" \
        >"$OUT/$name-$GPU-$DAY.log" 2>&1
    local code=$?
    kill $smi
    echo "$name: exit $code"
    tr '\r' '\n' <"$OUT/$name-$GPU-$DAY.log" | grep -v '^requests: ' | tail -n 30
}

case "${1:-}" in
70b)
    bench bench-tp4-llama3-70b-in1024-out512-n1000 --model llama3-70b --tp 4 $W
    bench bench-tp4-fp8-llama3-70b-in1024-out512-n1000 --model llama3-70b --tp 4 $W \
        --kv-cache-dtype fp8 ;;
8b)  # separate GPUs, so both run at once
    CUDA_VISIBLE_DEVICES=0,1 bench bench-tp2-llama3-8b-in1024-out512-n1000 --model llama3-8b \
        --tp 2 $W &
    sleep 2
    CUDA_VISIBLE_DEVICES=2 bench bench-tp1-llama3-8b-in1024-out512-n1000 --model llama3-8b \
        --tp 1 $W &
    wait ;;
tests)
    python -m pytest -m gpu -q tests/gpu/test_tp_engine_gpu.py tests/gpu/test_tp_serve_gpu.py \
        tests/gpu/test_tp_gpu.py tests/gpu/test_ce_allreduce_gpu.py \
        tests/gpu/test_timeline_tp_gpu.py 2>&1 | tail -n 40 ;;
serve)
    python bench/engine/tp_serve_smoke.py --model llama3-70b --tp 4 ;;
overlap-ce)  # 500 prompts: an A-B-A of 1,000 at 1024/512 takes over the 10 minutes of a call
    bench bench-tp4-2batch-ce-llama3-70b-in1024-out512-n500 --model llama3-70b --tp 4 \
        --input-len 1024 --output-len 512 --num-prompts 500 --graphs on --schedule two_batch \
        --compare --collective copy_engine ;;
overlap-nccl)
    bench bench-tp4-2batch-nccl-llama3-70b-in1024-out512-n500 --model llama3-70b --tp 4 \
        --input-len 1024 --output-len 512 --num-prompts 500 --graphs on --schedule two_batch \
        --compare --collective nccl ;;
overlap-sharegpt)
    bench bench-tp4-2batch-ce-llama3-70b-sharegpt-n500 --model llama3-70b --tp 4 \
        --workload sharegpt --num-prompts 500 --graphs on --schedule two_batch --compare \
        --collective copy_engine ;;
memory)
    python bench/engine/tp_memory.py --model llama3-70b --tp 4 --engines 3 --prompts 256 \
        --json "$OUT/tp_memory-llama3-70b-tp4-$GPU-$DAY.json" 2>&1 | grep -v Warning | tail -n 20 ;;
aba)
    N=llama3-70b-in1024-out512-n1000
    case "${2:-}" in
    seq1|seq2) bench bench-tp4-aba-$2-nccl-$N --model llama3-70b --tp 4 $W \
        --schedule sequential --collective nccl ;;
    overlap) bench bench-tp4-aba-2batch-ce-$N --model llama3-70b --tp 4 $W \
        --schedule two_batch --collective copy_engine ;;
    *) echo "usage: bench/engine/tp_run.sh aba seq1|overlap|seq2" >&2; exit 2 ;;
    esac ;;
broadcast)
    python bench/engine/tp_broadcast.py --tp 2 --rows 2048
    python bench/engine/tp_broadcast.py --tp 4 --rows 2048 ;;
*)
    echo "usage: bench/engine/tp_run.sh 70b|8b|tests|serve|broadcast|overlap-ce|overlap-nccl|overlap-sharegpt|memory|aba ARM" >&2
    exit 2 ;;
esac
