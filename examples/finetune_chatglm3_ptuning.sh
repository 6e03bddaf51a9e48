#!/usr/bin/env bash
# P-Tuning v2 on ChatGLM3-6B (THUDM's folder as published: model_type chatglm, tokenizer.model)
# the way ChatGLM's own scripts and ChatGLM-Finetuning train it: a prefix encoder of PRE_SEQ_LEN
# (16) virtual tokens with its projection, the base model frozen, ZeRO-2, one rank per GPU, on
# instruction / input / output records laid out as ChatGLM-Finetuning's data_set.py does for
# ChatGLM3 (--mode glm3).
#
#   MODEL=/models/chatglm3-6b DATA=train.jsonl examples/finetune_chatglm3_ptuning.sh
#
# The output folder holds the prefix encoder twice: PEFT's adapter files and
# prefix_encoder.safetensors under ChatGLM's names (docs/chatglm.md shows the line that loads it
# into ChatGLM's own scripts). NGPU ranks (default: every GPU), SEQ max_len (1024), SRC
# max_src_len (512), STEPS (default: one epoch) and DTYPE (bf16 | fp16) can be set.
set -euo pipefail
zt=${ZT:-zerotrain}
ngpu=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$ngpu" -ge 1 ] || { echo "no GPU found (set NGPU)" >&2; exit 2; }
model=${MODEL:?set MODEL to a ChatGLM3-6B folder}
data=${DATA:?set DATA to a JSONL file of instruction / input / output records}
out=${OUT:-output_chatglm3_ptuning}
length=(--num_train_epochs 1)
[ -n "${STEPS:-}" ] && length=(--max_steps "$STEPS")

exec "$zt" launch --num_gpus "$ngpu" train \
  --model_name_or_path "$model" --train_path "$data" --output_dir "$out" --overwrite_output_dir \
  --mode glm3 --max_len "${SEQ:-1024}" --max_src_len "${SRC:-512}" \
  --train_type ptuning --pre_seq_len "${PRE_SEQ_LEN:-16}" --prefix_projection True \
  --"${DTYPE:-bf16}" --per_device_train_batch_size 4 --gradient_accumulation_steps 1 \
  --learning_rate 2e-2 --warmup_ratio 0.1 "${length[@]}" --show_loss_step 10 \
  --gradient_checkpointing \
  --ds_file '{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": 1.0,
              "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
              "zero_optimization": {"stage": 2, "overlap_comm": true}}'
