#!/usr/bin/env bash
# The GPU round: run from the repo root on a CUDA machine, one stage per call (each fits in 10 minutes).
#   bash scripts/gpu_check.sh tests      # GPU tests (kernels against their twins, CUDA engine against CPU and
#                                        # transformers), then the rest of the suite on CUDA
#   bash scripts/gpu_check.sh bench      # bench.py: Qwen3-0.6B shape bf16 and FP8 KV (RUNS times, default 2),
#                                        # Qwen3-8B shape bf16 and FP8 KV, with their floors
#   BASE=DIR bash scripts/gpu_check.sh bench   # the same here and in DIR (an older checkout), alternating
#   bash scripts/gpu_check.sh latency    # bench_latency.py (batch 1, 4, 16, 64 against the decode floor) on the
#                                        # Qwen3-0.6B, Llama-3.2-1B and Qwen3-8B shapes
#   bash scripts/gpu_check.sh serving    # bench.py, then bench_serving.py against `nanovllm serve` at RATES
#                                        # (default "16 64 inf"); BASE=DIR also serves DIR at once
#   bash scripts/gpu_check.sh moe        # Qwen3-30B-A3B shape: copy bandwidth, floor, bench.py, profile (H200)
#   bash scripts/gpu_check.sh profile    # profile_bench.py: device busy and idle per step kind, kernel groups
#                                        # (SHAPE=configs/x.json, default the Qwen3-0.6B shape; bf16 and FP8 KV)
#   bash scripts/gpu_check.sh peer       # transformers' continuous batching, tuned (CUDA graphs, 256 requests
#                                        # per batch), on bench.py's workload
#   bash scripts/gpu_check.sh parallel   # two GPUs: the all-reduce by size, the two-GPU tests (TP, PP), bench_latency and
#                                        # bench.py at TP=1, TP=2 (and with NCCL only) and PP=2, a TP=2 decode profile
#   bash scripts/gpu_check.sh four       # four GPUs, Qwen3-32B shape: batch-1 latency at TP=1, 2, 4 and bench.py at
#                                        # TP=1, 2, 4 and TP=2 x PP=2 (each rank's host time beside each)
#   bash scripts/gpu_check.sh quant      # quantized weights, Qwen3-8B shape, FP8 KV: bench.py with each of FORMATS
#                                        # (default "bf16 awq fp8"; BASE=DIR alternates) and each one's floor
#   bash scripts/gpu_check.sh quant-gemm # bench_latency.py at batch 1, 8, 16, 64 for each format, then each format's
#                                        # GEMMs per projection (TFLOP/s, 16-256 rows) and the float8 GEMM routes
#   bash scripts/gpu_check.sh quant-tp   # two GPUs: bench.py with FP8 weights and the Qwen3-30B-A3B shape, TP=1 and 2
# Arguments after the stage go to its Python commands: `bash scripts/gpu_check.sh latency --enforce-eager`.
# Logs go to $OUT (or ./gpu_logs).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-}
case "$stage" in
  tests|bench|latency|serving|moe|profile|peer|parallel|four|quant|quant-gemm|quant-tp) shift ;;
  -h|--help|help) sed -n '2,/^set /p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "usage: bash scripts/gpu_check.sh tests|bench|latency|serving|moe|profile|peer|parallel|four|quant|quant-gemm|quant-tp [ARGS...]" \
       "(--help)" >&2; exit 2 ;;
esac
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1   # keep carried wheels (/tmp/site) visible
case "$stage" in   # the stages on several GPUs: never multicast (the engine's ranks set it too)
  parallel|four|quant-tp) export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 ;;
esac
LOGS=${OUT:-gpu_logs}
mkdir -p "$LOGS"

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__)"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)${BASE:+, base $BASE}"

bench() {   # TREE SHAPE KV [ARGS...]: one bench.py run, its throughput line labelled
  local tree=$1 shape=$2 kv=$3; shift 3
  (cd "$tree" && python bench.py --config "configs/$shape.json" --kv-cache-dtype "$kv" "$@") 2>&1 \
    | tee -a "$LOGS/bench.log" | grep Throughput | sed "s|^|$shape $kv $tree: |"
}

if [ "$stage" = tests ]; then
  python -m pytest -q -x tests/test_kernels.py tests/test_kernels_fp8.py tests/test_gpu.py tests/test_fp8_kv.py "$@" 2>&1 \
    | tee "$LOGS/pytest_gpu.log" | grep -E "passed|failed|error|Error" | tail -30
  python -m pytest -q tests/ --ignore=tests/test_kernels.py --ignore=tests/test_kernels_fp8.py \
    --ignore=tests/test_gpu.py --ignore=tests/test_fp8_kv.py "$@" 2>&1 | tee "$LOGS/pytest_rest_on_cuda.log" | tail -15
fi
if [ "$stage" = bench ]; then
  for run in $(seq "${RUNS:-2}"); do
    for tree in ${BASE:-} .; do
      for kv in auto fp8; do bench "$tree" qwen3-0.6b $kv "$@"; done
    done
  done
  for tree in ${BASE:-} .; do
    for kv in auto fp8; do bench "$tree" qwen3-8b $kv "$@"; done
  done
  for shape in qwen3-0.6b qwen3-8b; do
    for bytes in 2 1; do python scripts/bench_floor.py "configs/$shape.json" --kv-bytes $bytes | sed "s|^|kv bytes $bytes: |"; done
  done
fi
if [ "$stage" = latency ]; then
  for shape in qwen3-0.6b llama-3.2-1b qwen3-8b; do
    python bench_latency.py --config "configs/$shape.json" "$@" 2>&1 | tee -a "$LOGS/latency.log" \
      | grep -E "^batch|^\{" | sed "s|^|$shape: |"
  done
fi
if [ "$stage" = serving ]; then
  python bench.py --config configs/qwen3-0.6b.json "$@" 2>&1 | grep Throughput | sed "s|^|offline: |"
  model=$(python -c "from nanovllm.checkpoints.random_checkpoint import cached_shape; print(cached_shape('configs/qwen3-0.6b.json'))")
  serve_bench() {   # TREE LABEL RATE...: the same requests through the HTTP server, streamed
    local tree=$1 label=$2; shift 2
    (cd "$tree" && exec python -m nanovllm.serve "$model" --load-format dummy --port 8123 --max-model-len 4096 \
      --log-level warning) > "$LOGS/server_$label.log" 2>&1 &
    local server=$!
    for i in $(seq 180); do
      python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8123/health')" 2>/dev/null && break
      sleep 1
    done
    for rate in "$@"; do
      python bench_serving.py --port 8123 --request-rate $rate --save-result "$LOGS/serving_${label}_$rate.json" 2>&1 \
        | tee -a "$LOGS/serving.log" | sed "s|^|$label rate $rate: |"
    done
    kill -TERM $server; wait $server; echo "$label server exit code $?"
  }
  for tree in ${BASE:-}; do serve_bench "$tree" "$(basename "$tree")" inf; done
  serve_bench . here ${RATES:-16 64 inf}
fi
copy_bandwidth() {   # bytes/s the device copies 4 GiB at, for the floors
  python -c "
import torch
from triton.testing import do_bench
x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda'); y = torch.empty_like(x)
print(f'{2 * x.numel() / (do_bench(lambda: y.copy_(x)) / 1e3):.3e}')"
}
if [ "$stage" = moe ]; then
  bandwidth=$(copy_bandwidth)
  echo "device copy bandwidth $bandwidth B/s"
  python scripts/bench_floor.py configs/qwen3-30b-a3b.json --bandwidth "$bandwidth"
  python bench.py --config configs/qwen3-30b-a3b.json "$@" 2>&1 | tee "$LOGS/bench_moe.log" | grep -E "Throughput|nanovllm:"
  python scripts/profile_bench.py --config configs/qwen3-30b-a3b.json 2>&1 | tee "$LOGS/profile_moe.log" | grep -v Loading | head -45
fi
if [ "$stage" = profile ]; then
  for kv in auto fp8; do
    python scripts/profile_bench.py --config "${SHAPE:-configs/qwen3-0.6b.json}" --kv-cache-dtype $kv "$@" 2>&1 \
      | tee -a "$LOGS/profile.log" | grep -v Loading | head -45
  done
fi
if [ "$stage" = peer ]; then
  timeout 580 python scripts/hf_continuous_batching.py --cuda-graphs --max-requests-per-batch 256 --timeout 400 "$@" 2>&1 \
    | tee "$LOGS/hf_cb.log" | tail -5
fi
if [ "$stage" = parallel ]; then
  timeout 120 python scripts/bench_all_reduce.py 2>&1 | tee "$LOGS/all_reduce.log" | grep KiB
  timeout 300 python -m pytest -q tests/test_all_reduce.py tests/test_shard_sampling.py tests/test_pipeline_parallel_gpu.py \
    2>&1 | tail -2      # the last needs the [structured] extra (xgrammar) on the machine
  for args in "--tensor-parallel-size 1" "--tensor-parallel-size 2" "--tensor-parallel-size 2 --disable-custom-all-reduce"; do
    timeout 150 python scripts/rank_host_times.py bench_latency --config configs/qwen3-8b.json --batch-sizes 1,16,64 \
      --output-len 256 $args "$@" 2>&1 | tee -a "$LOGS/latency_parallel.log" | grep -E "^batch|^rank" | sed "s|^|$args: |"
  done
  for args in "--tensor-parallel-size 1" "--tensor-parallel-size 2" "--pipeline-parallel-size 2"; do
    # with each rank's host time per step (scripts/rank_host_times.py)
    timeout 150 python scripts/rank_host_times.py bench --config configs/qwen3-8b.json $args "$@" 2>&1 \
      | tee -a "$LOGS/bench_parallel.log" | grep -E "Throughput|^rank" | sed "s|^|$args: |"
  done
  timeout 120 python scripts/profile_bench.py --config configs/qwen3-8b.json --tensor-parallel-size 2 --decode-batch 1 \
    2>&1 | tee "$LOGS/profile_tp2.log" | grep -A10 window
fi
if [ "$stage" = four ]; then
  for tp in 1 2 4; do
    timeout 150 python scripts/rank_host_times.py bench_latency --config configs/qwen3-32b.json --batch-sizes 1 \
      --output-len 128 --tensor-parallel-size $tp "$@" 2>&1 | tee -a "$LOGS/latency_four.log" | grep -E "^batch|^rank" \
      | sed "s|^|TP=$tp: |"
  done
  for args in "--tensor-parallel-size 1" "--tensor-parallel-size 2" "--tensor-parallel-size 4" \
              "--tensor-parallel-size 2 --pipeline-parallel-size 2"; do
    timeout 150 python scripts/rank_host_times.py bench --config configs/qwen3-32b.json $args "$@" 2>&1 \
      | tee -a "$LOGS/bench_four.log" | grep -E "Throughput|^rank" | sed "s|^|$args: |"
  done
fi
quantization() {   # FORMAT: bench.py's and bench_latency.py's argument for it (none for bf16)
  case "$1" in bf16) ;; *) echo "--quantization $1" ;; esac
}
if [ "$stage" = quant ]; then
  formats=${FORMATS:-bf16 awq fp8}
  for format in $formats; do
    for tree in ${BASE:-} .; do bench "$tree" qwen3-8b fp8 $(quantization $format) "$@" | sed "s|^|$format |"; done
  done
  bandwidth=$(copy_bandwidth)
  echo "device copy bandwidth $bandwidth B/s"
  for format in $formats; do   # bytes a weight: 4 bits plus a 16-bit scale and zero per 128
    linear_bytes=$(case $format in bf16) echo 2 ;; fp8) echo 1 ;; *) echo 0.53 ;; esac)
    python scripts/bench_floor.py configs/qwen3-8b.json --kv-bytes 1 --linear-bytes $linear_bytes \
      --bandwidth "$bandwidth" | sed "s|^|$format floor: |"
  done
fi
if [ "$stage" = quant-gemm ]; then
  for format in bf16 awq fp8; do
    timeout 150 python bench_latency.py --config configs/qwen3-8b.json --batch-sizes 1,8,16,64 --output-len 128 \
      $(quantization $format) "$@" 2>&1 | tee -a "$LOGS/latency_quant.log" | grep -E "^batch|^\{" | sed "s|^|$format: |"
  done
  timeout 150 python scripts/int_gemm_bench.py --tflops 2>&1 | tee "$LOGS/gemm_tflops.log" | grep -v Warn | tail -30
  timeout 120 python scripts/int_gemm_bench.py --w8a8 2>&1 | tee "$LOGS/gemm_w8a8.log" | grep -v Warn | tail -30
fi
if [ "$stage" = quant-tp ]; then
  for tp in 1 2; do
    timeout 150 python bench.py --config configs/qwen3-8b.json --quantization fp8 --kv-cache-dtype fp8 \
      --tensor-parallel-size $tp "$@" 2>&1 | tee -a "$LOGS/bench_quant_tp.log" | grep Throughput | sed "s|^|FP8 TP=$tp: |"
    timeout 150 python bench.py --config configs/qwen3-30b-a3b.json --tensor-parallel-size $tp "$@" 2>&1 \
      | tee -a "$LOGS/bench_quant_tp.log" | grep Throughput | sed "s|^|30B-A3B TP=$tp: |"
  done
fi
