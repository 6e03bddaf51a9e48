#!/usr/bin/env bash
# Fine-tune a 7B model on every GPU of this machine, LoRA or in full.
#
#   MODEL=/models/Qwen2.5-7B-Instruct DATA=train.jsonl MODE=lora examples/finetune_7b.sh
#   MODEL=/models/Llama-2-7b-hf       DATA=train.jsonl MODE=full examples/finetune_7b.sh
#
# Without MODEL, a model of the Qwen2.5-7B shape (SHAPE=llama-2-7b for LLaMA-2) with random weights
# trains on synthetic token data: a throughput and memory check (STEPS steps, default 20);
# SHAPE_FILE=config.json takes any other shape (the tests use a tiny one).
# MODE=lora: LoRA r16 on all linear layers, bf16, ZeRO-2, sequences of 1024, micro batch 8.
# MODE=full: every weight, bf16, ZeRO-2 with the optimizer offloaded to the CPU
#            (fp32 master + Adam moments, 12 bytes per parameter, live in host memory).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
zt=${ZT:-zerotrain}
ngpu=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$ngpu" -ge 1 ] || { echo "no GPU found (set NGPU)" >&2; exit 2; }
mode=${MODE:-lora}
out=${OUT:-output_7b_$mode}
seq=${SEQ:-1024}
steps=${STEPS:-20}

if [ -n "${MODEL:-}" ]; then
  model=(--model_name_or_path "$MODEL")
  data=${DATA:?set DATA to a JSONL file}
  length=(--num_train_epochs 3)
else
  model=(--model_config "${SHAPE_FILE:-$here/shapes/${SHAPE:-qwen2.5-7b}.json}")
  data=${DATA:-$out.synthetic.jsonl}
  length=(--max_steps "$steps")
  [ -f "$data" ] || python3 "$here/synthetic_tokens.py" "$data" "$seq"
fi

case "$mode" in
  lora)
    method=(--finetuning_type lora --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear
            --per_device_train_batch_size 8 --learning_rate 2e-4
            --deepspeed '{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                          "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2, "overlap_comm": true}}')
    ;;
  full)
    method=(--finetuning_type full --per_device_train_batch_size 4 --gradient_checkpointing
            --learning_rate 2e-5 --deepspeed "$here/deepspeed/ds_config_zero2_offload.json")
    ;;
  *) echo "MODE must be lora or full" >&2; exit 2 ;;
esac

exec "$zt" launch --nproc_per_node "$ngpu" -- "$zt" train \
  "${model[@]}" --train_file "$data" --output_dir "$out" --overwrite_output_dir \
  --bf16 --max_length "$seq" "${length[@]}" "${method[@]}" \
  --gradient_accumulation_steps 1 --lr_scheduler_type cosine --warmup_ratio 0.03 \
  --logging_steps 5 --save_steps 500 --save_total_limit 2
