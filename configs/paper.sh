#!/usr/bin/env bash
# The paper's recipe on one machine with GPUS GPUs: AR-SFT (stage 1), then MARS with block size B from AR-SFT's
# last checkpoint (stage 2, same data and settings). docs/scaling.md explains the settings and the memory.
#
#   configs/paper.sh 7b 4            # Qwen2.5-7B, B = 4, 8 GPUs
#   configs/paper.sh 0.5b 16 8 --dry-run --plan-examples 2000000   # both stages planned, nothing trained
#
# Extra flags after GPUS go to both stages. Rerunning resumes each stage where it stopped (a finished stage
# trains nothing). The data (configs' "data") is a chat JSONL you provide: one {"messages": [...]} per line.
set -euo pipefail
if [[ $# -lt 2 ]]; then
    echo "usage: configs/paper.sh {0.5b|7b} {4|8|16} [GPUS (default 8)] [finetune.train flags...]" >&2
    exit 2
fi
size=$1 B=$2 gpus=${3:-8}
shift $(( $# < 3 ? $# : 3 ))
here=$(cd "$(dirname "$0")" && pwd)
ar="$here/qwen2.5-$size-ar-sft.json" mars="$here/qwen2.5-$size-mars-b$B.json"
for f in "$ar" "$mars"; do
    [[ -f $f ]] || { echo "error: no config $f: use size 0.5b or 7b and B 4, 8 or 16" >&2; exit 2; }
done
cd "$here/.."
launch=(torchrun --standalone --nproc_per_node "$gpus" -m finetune.train)
read_key() { python -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$@"; }

"${launch[@]}" --config "$ar" "$@"
if [[ " $* " == *" --dry-run "* ]]; then
    # stage 1 has not run: plan stage 2 on the same architecture, the AR-SFT run's base model
    base=$(read_key "$ar" base_model)
else
    base=$(read_key "$(read_key "$ar" output_dir)/status.json" last_checkpoint)
fi
"${launch[@]}" --config "$mars" --base-model "$base" "$@"
