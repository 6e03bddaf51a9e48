#!/usr/bin/env bash
# LoRA on GLM-4-9B (transformers' `glm` layout: THUDM/glm-4-9b-chat-hf) on every GPU of this
# machine, one rank per GPU, ZeRO-2, bf16.
#
#   MODEL=/models/glm-4-9b-chat-hf DATA=train.jsonl examples/finetune_glm4_9b.sh
#
# DATA: JSONL records in any layout docs/data.md lists (chat `messages`, or instruction /
# input / output). Chat data is rendered in GLM-4's own format (`--template auto` finds it in
# the folder's chat template); instruction data too, as one user turn and the reply.
# Without MODEL, a model of the GLM-4-9B shape with random weights trains on synthetic token
# data: a throughput and memory check (STEPS steps, default 20); SHAPE_FILE=config.json takes
# another shape (the tests use a tiny one).
# LoRA r16 / alpha 32 on every linear layer (PEFT's names for GLM: q_proj, k_proj, v_proj,
# o_proj, gate_up_proj, down_proj); sequences of SEQ (1024) tokens, micro-batch 8.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
zt=${ZT:-zerotrain}
ngpu=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$ngpu" -ge 1 ] || { echo "no GPU found (set NGPU)" >&2; exit 2; }
out=${OUT:-output_glm4_9b_lora}
seq=${SEQ:-1024}
steps=${STEPS:-20}

if [ -n "${MODEL:-}" ]; then
  model=(--model_name_or_path "$MODEL" --template auto)
  data=${DATA:?set DATA to a JSONL file}
  length=(--num_train_epochs 3)
else
  model=(--model_config "${SHAPE_FILE:-$here/shapes/glm-4-9b.json}")
  data=${DATA:-$out.synthetic.jsonl}
  length=(--max_steps "$steps")
  [ -f "$data" ] || python3 "$here/synthetic_tokens.py" "$data" "$seq"
fi

exec "$zt" launch --nproc_per_node "$ngpu" -- "$zt" train \
  "${model[@]}" --train_file "$data" --output_dir "$out" --overwrite_output_dir \
  --bf16 --max_length "$seq" "${length[@]}" \
  --finetuning_type lora --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear \
  --per_device_train_batch_size 8 --learning_rate 2e-4 \
  --deepspeed '{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2, "overlap_comm": true}}' \
  --gradient_accumulation_steps 1 --lr_scheduler_type cosine --warmup_ratio 0.03 \
  --logging_steps 5 --save_steps 500 --save_total_limit 2
