#!/usr/bin/env bash
# One GPU round: correctness first, then measurements. Run from the repo root on a CUDA machine.
#   bash scripts/gpu_check.sh tests    # GPU tests (kernels vs twins, CUDA vs CPU vs transformers)
#   bash scripts/gpu_check.sh bench    # bench.py, step timings, profile, transformers side by side
#   bash scripts/gpu_check.sh quick    # bench.py, the CUDA engine and fused-kernel checks, profile, step times (~8 min)
#   bash scripts/gpu_check.sh tune     # bench.py, fused-kernel checks, decode kernel sweeps (~6 min)
#   bash scripts/gpu_check.sh final    # bench.py three times, engine and sampler GPU tests, profile, step times (~8 min)
#   BASE="DIR..." bash scripts/gpu_check.sh ab   # attention/engine GPU tests, then bench.py here and in each
#                                                # DIR (older checkouts) in turn, twice each
#   BASE="DIR..." bash scripts/gpu_check.sh ab-profile   # step times and GPU-busy time, here and in each DIR
#   BASE="DIR" bash scripts/gpu_check.sh benches   # bench.py here and in DIR alternating (0.6B shape), then
#                                                  # the other families' shapes with their floors (~9 min)
#   bash scripts/gpu_check.sh cuda-tests          # the engine's CPU tests again on CUDA (graphs on) (~9 min)
#   bash scripts/gpu_check.sh fp8                 # FP8 kernel checks and timings, bench.py auto vs fp8 (~6 min)
#   BASE=DIR bash scripts/gpu_check.sh speed      # bench.py 0.6B bf16 and fp8, 8B, here and in DIR alternating (~7 min)
#   bash scripts/gpu_check.sh timeline            # bench.py bf16 and fp8, kernels and gaps of a decode step, split
#                                                 # sweep of the decode kernel, FP8 engine tests (~7 min)
#   bash scripts/gpu_check.sh waits               # where the device waits for the host: profile_bench with CUDA's
#                                                 # lazy and eager module loading, first graph replays (~3 min)
#   bash scripts/gpu_check.sh sampling            # beam width 4 and n = 4 against separate requests (~2 min)
#   bash scripts/gpu_check.sh moe                 # Qwen3-30B-A3B shape: floor, bench.py, MoE share of the step,
#                                                 # kernel tiles at each batch (one H200: nvidia-h200) (~8 min)
#   bash scripts/gpu_check.sh serving             # bench.py, then bench_serving.py at 16, 64 req/s and at once (needs the
#                                                 # server's packages: carry them as wheels, see device notes)
# Logs go to $OUT (or ./gpu_logs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1   # keep carried wheels (/tmp/site) visible
LOGS=${OUT:-gpu_logs}
mkdir -p "$LOGS"
stage=${1:-all}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__)"

if [ "$stage" = tests ] || [ "$stage" = all ]; then
  python -m pytest -q -x tests/test_kernels.py tests/test_gpu.py -s 2>&1 | tee "$LOGS/pytest_gpu.log" | grep -E "passed|failed|error|ours|Error" | tail -30
  python -m pytest -q tests/ --ignore=tests/test_kernels.py --ignore=tests/test_gpu.py 2>&1 | tee "$LOGS/pytest_rest_on_cuda.log" | tail -15
fi
if [ "$stage" = quick ]; then
  python bench.py --config configs/qwen3-0.6b.json 2>&1 | tee "$LOGS/bench.log" | grep -v Loading
  python -m pytest -q tests/test_gpu.py tests/test_kernels.py tests/test_engine.py -s \
    -k "test_gpu or rotary or stores or gumbel or queued or arrive or preemption or chunked or logprobs" 2>&1 \
    | tee "$LOGS/pytest_gpu.log" | grep -E "passed|failed|error|ours|Error" | tail -20
  python scripts/profile_bench.py 2>&1 | tee "$LOGS/profile.log" | grep -v Loading | head -30
  python scripts/step_timing.py 2>&1 | tee "$LOGS/step_timing.log" | grep -v Loading
fi
if [ "$stage" = tune ]; then
  python bench.py --config configs/qwen3-0.6b.json 2>&1 | tee "$LOGS/bench.log" | grep -v Loading
  python -m pytest -q tests/test_gpu.py tests/test_kernels.py -k "test_gpu or rotary or gumbel or decode" 2>&1 \
    | tee "$LOGS/pytest_gpu.log" | grep -E "passed|failed|error|Error" | tail -20
  python scripts/tune_decode_attention.py 2>&1 | tee "$LOGS/tune_attention.log"
  python scripts/decode_op_timing.py 2>&1 | tee "$LOGS/op_timing.log"
fi
if [ "$stage" = final ]; then
  for run in 1 2 3; do python bench.py --config configs/qwen3-0.6b.json 2>&1 | tee -a "$LOGS/bench.log" | grep -v Loading; done
  python -m pytest -q tests/test_gpu.py tests/test_kernels.py tests/test_sampler.py -s -k "test_gpu or gumbel or sampl" 2>&1 \
    | tee "$LOGS/pytest_gpu.log" | grep -E "passed|failed|error|Error" | tail -20
  python scripts/profile_bench.py 2>&1 | tee "$LOGS/profile.log" | grep -v Loading | head -22
  python scripts/step_timing.py 2>&1 | tee "$LOGS/step_timing.log" | grep -v Loading
fi
if [ "$stage" = ab ] || [ "$stage" = ab-profile ]; then
  trees=". ${BASE:?BASE names the checkouts to compare with, separated by spaces}"
fi
if [ "$stage" = ab ]; then
  python -m pytest -q -x tests/test_kernels.py tests/test_gpu.py tests/test_engine.py -s \
    -k "test_gpu or rotary or stores or decode or prefill or chunked or preemption or prefix" 2>&1 \
    | tee "$LOGS/pytest_gpu.log" | grep -E "passed|failed|error|ours|Error" | tail -20
  for run in 1 2; do
    for tree in $trees; do
      (cd "$tree" && python bench.py --config configs/qwen3-0.6b.json) 2>&1 | tee -a "$LOGS/bench.log" \
        | grep Throughput | sed "s|^|$tree: |"
    done
  done
fi
if [ "$stage" = ab-profile ]; then
  for tree in $trees; do
    (cd "$tree" && python scripts/step_timing.py && python scripts/profile_bench.py) 2>&1 | tee -a "$LOGS/profile.log" \
      | grep -E "^ *[0-9]+ \||prefill|decode|workload" | sed "s|^|$tree: |"
  done
fi
if [ "$stage" = benches ]; then
  for run in 1 2; do
    for tree in "${BASE:?BASE names an older checkout}" .; do
      (cd "$tree" && python bench.py --config configs/qwen3-0.6b.json) 2>&1 | grep Throughput | sed "s|^|qwen3-0.6b $tree: |"
    done
  done
  for shape in qwen2.5-0.5b llama-3.2-1b llama-3.1-8b; do
    python scripts/bench_floor.py configs/$shape.json 2>&1 | grep floor
    python bench.py --config configs/$shape.json 2>&1 | tee -a "$LOGS/bench_shapes.log" | grep -E "Throughput|nanovllm:" | sed "s|^|$shape: |"
  done
fi
if [ "$stage" = fp8 ]; then
  python -m pytest -q -x tests/test_kernels_fp8.py tests/test_fp8_kv.py 2>&1 | tee "$LOGS/pytest_fp8.log" | tail -3
  python scripts/fp8_kernel_check.py --no-sweep 2>&1 | tee "$LOGS/fp8_kernel_check.log" | tail -25
  for run in 1 2; do
    for kv in auto fp8; do
      python bench.py --config configs/qwen3-0.6b.json --kv-cache-dtype $kv 2>&1 | grep -E "Throughput" | sed "s|^|qwen3-0.6b $kv: |"
    done
  done
  python scripts/bench_floor.py configs/qwen3-0.6b.json --kv-bytes 1 2>&1 | grep floor
fi
if [ "$stage" = serving ]; then
  # bench.py offline, then the same requests through the HTTP server: here at RATES (default 16, 64 and
  # at once), and at once in each older checkout of BASE (the same model directory for all)
  python bench.py --config configs/qwen3-0.6b.json 2>&1 | grep Throughput | sed "s|^|offline: |"
  model=$(python -c "from nanovllm.utils.random_checkpoint import cached_shape; print(cached_shape('configs/qwen3-0.6b.json'))")
  serve_bench() {   # TREE LABEL RATE...
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
if [ "$stage" = speed ]; then
  # the 0.6B shape in bf16 and with an FP8 cache, then the 8B shape: here and in BASE, alternating
  for run in 1 2; do
    for tree in "${BASE:?BASE names an older checkout}" .; do
      for kv in auto fp8; do
        (cd "$tree" && python bench.py --config configs/qwen3-0.6b.json --kv-cache-dtype $kv) 2>&1 | grep Throughput \
          | sed "s|^|qwen3-0.6b $kv $tree: |"
      done
    done
  done
  for tree in "$BASE" .; do
    (cd "$tree" && python bench.py --config configs/qwen3-8b.json) 2>&1 | grep Throughput | sed "s|^|qwen3-8b $tree: |"
  done
  python scripts/bench_floor.py configs/qwen3-8b.json 2>&1 | grep floor
fi
if [ "$stage" = timeline ]; then
  for kv in auto fp8; do
    python bench.py --config configs/qwen3-0.6b.json --kv-cache-dtype $kv 2>&1 | grep Throughput | sed "s|^|qwen3-0.6b $kv: |"
  done
  for kv in auto fp8; do
    python scripts/decode_timeline.py --kv-cache-dtype $kv 2>&1 | tee -a "$LOGS/timeline.log" | grep -v Loading
  done
  python scripts/decode_kernel_ab.py 2>&1 | tee "$LOGS/splits.log"
  python -m pytest -q tests/test_fp8_kv.py 2>&1 | tee "$LOGS/pytest_fp8_kv.log" | tail -3
fi
if [ "$stage" = waits ]; then
  # are the decode waits first uses of library kernels (cuBLAS's for the LM head at a row count not
  # seen before, say)? CUDA loads a kernel's module at its first use, with the host waiting, unless
  # told to load every module at start-up
  for loading in LAZY EAGER; do
    CUDA_MODULE_LOADING=$loading python scripts/profile_bench.py 2>&1 | tee -a "$LOGS/waits.log" \
      | grep -E "workload|idle|waits" | sed "s|^|$loading: |"
  done
  python scripts/graph_replay_timing.py 2>&1 | tee "$LOGS/graph_replay.log" | tail -2
fi
if [ "$stage" = sampling ]; then
  python scripts/bench_parallel_sampling.py --config configs/qwen3-0.6b.json 2>&1 | tee "$LOGS/sampling.log" | grep -v Loading
fi
if [ "$stage" = moe ]; then
  bandwidth=$(python -c "
import torch
from triton.testing import do_bench
x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda'); y = torch.empty_like(x)
print(f'{2 * x.numel() / (do_bench(lambda: y.copy_(x)) / 1e3):.3e}')")
  echo "device copy bandwidth $bandwidth B/s"
  python scripts/bench_floor.py configs/qwen3-30b-a3b.json --bandwidth "$bandwidth" 2>&1 | grep floor
  python bench.py --config configs/qwen3-30b-a3b.json 2>&1 | tee "$LOGS/bench_moe.log" | grep -E "Throughput|nanovllm:"
  python scripts/profile_bench.py --config configs/qwen3-30b-a3b.json 2>&1 | tee "$LOGS/profile_moe.log" | grep -v Loading | head -45
  python scripts/moe_check.py --no-tests --sweep 2>&1 | tee "$LOGS/moe_check.log" | tail -40
fi
if [ "$stage" = cuda-tests ]; then
  python -m pytest -q -x tests/test_gpu.py tests/test_kernels.py -s 2>&1 | tee "$LOGS/pytest_gpu.log" | grep -E "passed|failed|error|ours|Error" | tail -30
  python -m pytest -q tests/test_interrupts.py tests/test_parallel_sampling.py tests/test_worker.py tests/test_streaming.py \
    tests/test_engine.py tests/test_models.py -k "not tensor_parallel" 2>&1 | tee "$LOGS/pytest_cuda.log" | tail -15
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  python bench.py --config configs/qwen3-0.6b.json 2>&1 | tee "$LOGS/bench.log" | grep -v Loading
  python scripts/step_timing.py 2>&1 | tee "$LOGS/step_timing.log" | grep -v Loading
  python scripts/profile_bench.py 2>&1 | tee "$LOGS/profile.log" | grep -v Loading | head -30
  timeout 280 python scripts/hf_continuous_batching.py --timeout 200 2>&1 | tee "$LOGS/hf_cb.log" | tail -5
fi
