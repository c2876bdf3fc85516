#!/usr/bin/env bash
# GPU runs of the tensor-parallel engine (one host, 4 GPUs), one section per call so that each
# stays under the device's 10-minute limit:
#   tests      GPU tests of tp (NCCL, graphs; the server's need .whl)                  ~5 min
#   broadcast  what sending a step costs at tp 2 and 4 (tp_broadcast.py)              ~1 min
#   70b        Llama-3-70B tp 4, 1024/512, 1,000 prompts, bf16 then FP8 KV              ~7 min
#   8b         Llama-3-8B tp 2 against tp 1, the same workload                          ~4 min
#   serve      serve --tp 4 (Llama-3-70B) with a client, then SIGTERM (tp_serve_smoke.py) ~3 min
# as `bench/engine/tp_run.sh SECTION` from the repository root. Results (JSON, named as
# bench/results/ names them) and logs go to $OUT (else bench/results/). Carry the serve wheels
# as bench/engine/serve_poisson.py says (.whl) for `tests` and `serve`.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=".:.whl"
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
DAY=$(date -u +%Y%m%d)
GPU=$(python -c "import torch; n = torch.cuda.get_device_name(0); print('H200' if 'H200' in n else 'H100')")
W="--input-len 1024 --output-len 512 --num-prompts 1000 --graphs on"

bench() {  # bench NAME FLAGS...: one `nanosched bench` record and its log
    local name=$1; shift
    python -m nanosched.cli bench "$@" --json "$OUT/$name-$GPU-$DAY.json" \
        >"$OUT/$name-$GPU-$DAY.log" 2>&1
    echo "$name: exit $?"; tail -n 45 "$OUT/$name-$GPU-$DAY.log"
}

case "${1:-}" in
tests)
    python -m pytest -m gpu -q tests/gpu/test_tp_engine_gpu.py tests/gpu/test_tp_serve_gpu.py \
        tests/gpu/test_tp_gpu.py 2>&1 | tail -n 40 ;;
broadcast)
    python bench/engine/tp_broadcast.py --tp 2 --rows 2048
    python bench/engine/tp_broadcast.py --tp 4 --rows 2048 ;;
70b)
    bench bench-tp4-llama3-70b-in1024-out512-n1000 --model llama3-70b --tp 4 $W
    bench bench-tp4-fp8-llama3-70b-in1024-out512-n1000 --model llama3-70b --tp 4 $W \
        --kv-cache-dtype fp8 ;;
8b)
    bench bench-tp2-llama3-8b-in1024-out512-n1000 --model llama3-8b --tp 2 $W
    bench bench-tp1-llama3-8b-in1024-out512-n1000 --model llama3-8b --tp 1 $W ;;
serve)
    python bench/engine/tp_serve_smoke.py --model llama3-70b --tp 4 ;;
*)
    echo "usage: bench/engine/tp_run.sh tests|broadcast|70b|8b|serve" >&2; exit 2 ;;
esac
