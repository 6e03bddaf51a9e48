#!/usr/bin/env bash
# LoRA on a 13B model with ZeRO-3 and CPU offload of parameters and optimizer state, on every GPU
# of this machine.
#
#   MODEL=/models/Llama-2-13b-hf DATA=train.jsonl examples/finetune_13b_zero3_offload.sh
#
# Without MODEL, a model of the LLaMA-2-13B shape with random weights trains on synthetic token
# data for STEPS steps (default 20): a throughput and memory check; SHAPE_FILE=config.json takes
# any other shape (the tests use a tiny one).
# Full fine-tuning of 13B does not fit one 141 GB GPU with a 125 GiB host (fp32 master + Adam
# moments alone are 12 bytes per parameter, about 156 GB): see docs/performance.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
zt=${ZT:-zerotrain}
ngpu=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$ngpu" -ge 1 ] || { echo "no GPU found (set NGPU)" >&2; exit 2; }
out=${OUT:-output_13b_lora}
seq=${SEQ:-1024}
steps=${STEPS:-20}

if [ -n "${MODEL:-}" ]; then
  model=(--model_name_or_path "$MODEL")
  data=${DATA:?set DATA to a JSONL file}
  length=(--num_train_epochs 3)
else
  model=(--model_config "${SHAPE_FILE:-$here/shapes/llama-2-13b.json}")
  data=${DATA:-$out.synthetic.jsonl}
  length=(--max_steps "$steps")
  [ -f "$data" ] || python3 "$here/synthetic_tokens.py" "$data" "$seq"
fi

exec "$zt" launch --nproc_per_node "$ngpu" -- "$zt" train \
  "${model[@]}" --train_file "$data" --output_dir "$out" --overwrite_output_dir \
  --deepspeed "$here/deepspeed/ds_config_zero3_offload.json" --bf16 --max_length "$seq" "${length[@]}" \
  --finetuning_type lora --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear \
  --per_device_train_batch_size 8 --gradient_accumulation_steps 1 --gradient_checkpointing \
  --learning_rate 2e-4 --lr_scheduler_type cosine --warmup_ratio 0.03 \
  --logging_steps 5 --save_steps 500 --save_total_limit 2
