#!/usr/bin/env bash
# One check on a CUDA machine: the kernel tests on the GPU (HERMES and H2SVC stages), the real-size check against the
# references (tests/hermes_kernels/test_real_size.py at the 7B shapes, Qwen3.5's and Gemma 4's: the HERMES step lazy
# and eager with two streams, the H2SVC step of every class block, every rotary layout (partial rotary and Gemma 4's
# proportional RoPE at D 512 included), fp16 and bf16, keep sets and moved caches; the split launch when there are
# two GPUs), then the benchmark tables at the LLaVA-OV-7B and Qwen2.5-VL-7B shapes in fp16 (triton, torch,
# reference): the HERMES stages, then the H2SVC stages (frame features, STCE, the step of all three class blocks;
# 16-frame chunks, full memories), then the stages that rotate keys at the Qwen3-VL-8B shape (interleaved M-RoPE
# sections), at Qwen3.5's (its 8 full-attention layers, D 256 with partial rotary R 64) and at Gemma 4's (its 5
# full-attention layers, D 512, proportional RoPE; triton and torch), each with the device-to-device copy bandwidth
# measured in the same run for the floor ratio.
#
#   bash bench/gpu_check.sh OUTDIR
#
# Needs python3 with torch, triton, transformers, pytest, tqdm (matplotlib optional; pytest-xdist used when there)
# already installed; installs nothing, downloads nothing, needs no flash-attn. Writes into OUTDIR: nvidia-smi.txt,
# tests.log, real_size.log, kernels.log, bench.log, bench_h2svc.log, bench_rotary.log, <gpu>.csv, <gpu>.png. Sized
# for a 15-minute device lease with room for one rerun: at most about 7.8 minutes (2 for the tests, 2.2 for the
# real-size check, 0.75 for the static compile table, 1.25 for the HERMES table, 1 for the H2SVC table, 0.7 for
# Qwen3-VL-8B, Qwen3.5 and Gemma 4); the exit status is non-zero if the tests, the real-size check, the compile check
# or a benchmark failed.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: bash bench/gpu_check.sh OUTDIR" >&2
    exit 2
fi
mkdir -p "$1"
out=$(cd "$1" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}

"$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA device")'
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem \
    --format=csv >"$out/nvidia-smi.txt" 2>&1 || echo "nvidia-smi unavailable" >"$out/nvidia-smi.txt"
cat "$out/nvidia-smi.txt"

# 1. Kernel tests on CUDA: the test files that run on tests.utils.DEVICE (cuda here), but the real-size check (step
#    1b). The model/stream tests run tiny models on CPU and are left to CI.
mapfile -t cuda_tests < <(grep -rl --include='test_*.py' "from tests.utils import .*DEVICE" tests \
    | grep -v "test_real_size.py")
if [[ ${#cuda_tests[@]} -eq 0 ]]; then
    echo "gpu_check: no test file imports tests.utils.DEVICE" >&2
    exit 1
fi
echo "== CUDA tests: ${cuda_tests[*]}"
# most of their time is Triton compiling each specialisation: spread the files over the machine's cores
workers=()
if "$python" -c "import xdist" 2>/dev/null; then
    workers=(-n "$(( $(nproc) < 8 ? $(nproc) : 8 ))")
fi
tests_rc=0
timeout 120 "$python" -m pytest "${cuda_tests[@]}" "${workers[@]}" -q -p no:cacheprovider 2>&1 \
    | tee "$out/tests.log" || tests_rc=$?

# 1b. The real-size check against the references (docs/gpu.md#real-size): its "7b" cases (the "small" ones ran in
#     CI); the two-GPU split launch is skipped on a one-GPU machine.
echo "== real-size check"
real_rc=0
timeout 130 "$python" -m pytest tests/hermes_kernels/test_real_size.py -k "7b" "${workers[@]}" -q -rs \
    -p no:cacheprovider 2>&1 | tee "$out/real_size.log" || real_rc=$?

# 2. The static compile table of the same shapes (registers, spills, occupancy, access widths), to read next to
#    the measured times (python -m bench.kernels; it compiles for sm_80/sm_90 and needs no device).
echo "== kernel compile table"
kernels_rc=0
timeout 45 "$python" -m bench.kernels --check --models llava-ov-7b qwen2.5-vl-7b qwen3-vl-8b qwen3.5 gemma4 \
    --dtypes fp16 --jobs "$(nproc)" 2>&1 | tee "$out/kernels.log" || kernels_rc=$?

# 3. The benchmark table (the reference is slow Python per layer: fewer repeats).
echo "== benchmark"
bench_rc=0
timeout 75 "$python" -m bench --device cuda --shapes llava-ov-7b qwen2.5-vl-7b --dtypes float16 \
    --budgets 6000 --chunks 16 --backends reference torch triton \
    --stages pooled_attention_q40 pooled_attention_q20 scores select compact step \
    --repeats 20 --reference-repeats 1 --warmup 2 --out "$out" 2>&1 | tee "$out/bench.log" \
    || bench_rc=$?

# 4. The H2SVC stages (the per-head reference step takes seconds: one timed run, one warm-up).
echo "== benchmark: H2SVC stages"
h2svc_rc=0
timeout 60 "$python" -m bench --device cuda --shapes llava-ov-7b qwen2.5-vl-7b --dtypes float16 --chunks 16 \
    --stages h2svc_features h2svc_stce h2svc_step --backends reference torch triton \
    --repeats 20 --reference-repeats 1 --warmup 1 --no-e2e --no-plot --out "$out" 2>&1 \
    | tee "$out/bench_h2svc.log" || h2svc_rc=$?

# 5. Qwen3-VL-8B (36 layers, 8 KV heads, interleaved M-RoPE sections), Qwen3.5 (8 full-attention layers, 4 KV
#    heads of D 256, partial rotary: interleaved M-RoPE over the first 64 channels; K/V 4.5x smaller per token than
#    Qwen3-VL-8B's) and Gemma 4 (5 full-attention layers, 4 KV heads of D 512, 1D over all 256 pairs with its
#    proportional inv_freq; K/V 3.6x smaller per token than Qwen3-VL-8B's): the stages that rotate keys by a position
#    delta, triton and torch only (the reference's per-layer loops are what makes steps 3-4 slow; agreement with it
#    is the tests' job). Qwen3.5 and Gemma 4 each add about a fifth to this step, paid for by fewer repeats.
echo "== benchmark: Qwen3-VL-8B and Qwen3.5, interleaved M-RoPE (Qwen3.5: partial rotary); Gemma 4, D 512"
qwen3_rc=0
timeout 40 "$python" -m bench --device cuda --shapes qwen3-vl-8b qwen3.5 gemma4 --dtypes float16 --budgets 6000 \
    --chunks 16 --stages compact step h2svc_step --backends torch triton --repeats 10 --warmup 2 --no-e2e --no-plot \
    --out "$out" 2>&1 | tee "$out/bench_rotary.log" || qwen3_rc=$?

echo "== gpu_check: tests exit ${tests_rc}, real-size check exit ${real_rc}, compile check exit ${kernels_rc}, bench" \
    "exit ${bench_rc}, H2SVC bench exit ${h2svc_rc}, rotary bench exit ${qwen3_rc}; results in $out"
if [[ $tests_rc -ne 0 || $real_rc -ne 0 || $kernels_rc -ne 0 || $bench_rc -ne 0 || $h2svc_rc -ne 0 \
      || $qwen3_rc -ne 0 ]]; then
    exit 1
fi
