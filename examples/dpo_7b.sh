#!/usr/bin/env bash
# Preference-tune (DPO, or KTO) a 7B model on every GPU of this machine (docs/preference.md).
#
#   MODEL=/models/Qwen2.5-7B-Instruct DATA=pairs.jsonl examples/dpo_7b.sh
#   MODEL=/models/Qwen2.5-7B-Instruct DATA=pairs.jsonl LOSS=simpo BETA=2.0 examples/dpo_7b.sh
#   MODEL=/models/Llama-2-7b-hf DATA=pairs.jsonl MODE=full examples/dpo_7b.sh
#   MODEL=/models/Qwen2.5-7B-Instruct DATA=feedback.jsonl STAGE=kto examples/dpo_7b.sh
#
# DATA: TRL's {"prompt", "chosen", "rejected"} records (text or messages) or LLaMA-Factory's
# pairwise alpaca / sharegpt records; with STAGE=kto also KTO's unpaired records ({"prompt",
# "completion", "label"}, or messages / conversations / alpaca with "label"), pairs being two
# examples. The model's own chat format is used (--template auto).
# Without MODEL, a model of the Qwen2.5-7B shape (SHAPE_FILE=config.json for another) with random
# weights trains on synthetic pairs: a throughput and memory check (STEPS steps, default 20).
# MODE=lora: LoRA r16 on all linear layers, bf16, ZeRO-2, micro batch 4 pairs (8 sequences of
#            SEQ tokens); the reference is the model with its adapters off, no second model.
# MODE=full: every weight, bf16, ZeRO-3, the reference's log-probs computed once before the
#            first step (precompute_ref_log_probs) and kept in every checkpoint — or with
#            REFERENCE=model a frozen copy of the starting weights, sharded as the policy is; on
#            one or two GPUs the optimizer state in host memory (OFFLOAD=0 keeps it on the GPUs).
# STAGE: dpo (the default) or kto. LOSS: sigmoid (DPO, the default; with STAGE=kto the kto
# loss), ipo, hinge, robust, orpo, simpo, apo_zero_unpaired (kto); BETA: pref_beta (0.1).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
zt=${ZT:-zerotrain}
ngpu=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$ngpu" -ge 1 ] || { echo "no GPU found (set NGPU)" >&2; exit 2; }
mode=${MODE:-lora}
out=${OUT:-output_dpo_7b_$mode}
seq=${SEQ:-1024}
steps=${STEPS:-20}

if [ -n "${MODEL:-}" ]; then
  model=(--model_name_or_path "$MODEL")
  data=${DATA:?set DATA to a JSONL file of preference pairs}
  length=(--num_train_epochs 1)
  template=(--template auto)
else
  model=(--model_config "${SHAPE_FILE:-$here/shapes/qwen2.5-7b.json}")
  data=${DATA:-$out.synthetic_pairs.jsonl}
  length=(--max_steps "$steps")
  template=(--template alpaca)
  # TRL's text pairs that fill SEQ tokens of the byte-level tokenizer (no tokenizer files
  # without MODEL): a quarter prompt, the rest the answer.
  [ -f "$data" ] || python3 - "$data" "$seq" <<'PY'
import json, random, sys
path, seq = sys.argv[1], int(sys.argv[2])
rng = random.Random(0)
words = "the a model learns from data memory compute sharded gradient answer better worse".split()
def text(n):
    out = ""
    while len(out) < n:
        out += rng.choice(words) + " "
    return out[:n]
with open(path, "w") as f:
    for _ in range(512):
        f.write(json.dumps({"prompt": text(seq // 4), "chosen": " " + text(seq * 3 // 4 - 8),
                            "rejected": " " + text(seq * 3 // 4 - 8)}) + "\n")
PY
fi

case "$mode" in
  lora)
    method=(--finetuning_type lora --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear
            --per_device_train_batch_size 4 --learning_rate 5e-6
            --deepspeed '{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                          "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2, "overlap_comm": true}}')
    ;;
  full)
    # 7B: 16 bytes a parameter of weights, fp32 masters and Adam's moments (about 120 GB) over
    # the ranks; on one or two GPUs the optimizer's share goes to host memory.
    offload=''
    if [ "${OFFLOAD:-$([ "$ngpu" -le 2 ] && echo 1 || echo 0)}" = 1 ]; then
      offload=', "offload_optimizer": {"device": "cpu", "pin_memory": true}'
    fi
    method=(--finetuning_type full --per_device_train_batch_size 2 --gradient_checkpointing
            --learning_rate 5e-7
            --precompute_ref_log_probs "$([ "${REFERENCE:-table}" = model ] && echo false || echo true)"
            --deepspeed '{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                          "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3, "overlap_comm": true,
                          "stage3_gather_16bit_weights_on_model_save": true'"$offload"'}}')
    ;;
  *) echo "MODE must be lora or full" >&2; exit 2 ;;
esac

exec "$zt" launch --nproc_per_node "$ngpu" -- "$zt" train \
  "${model[@]}" --train_file "$data" --output_dir "$out" --overwrite_output_dir "${template[@]}" \
  --stage "${STAGE:-dpo}" --pref_loss "${LOSS:-sigmoid}" --pref_beta "${BETA:-0.1}" \
  --bf16 --max_length "$seq" "${length[@]}" "${method[@]}" \
  --gradient_accumulation_steps 1 --lr_scheduler_type cosine --warmup_ratio 0.1 \
  --logging_steps 5 --save_steps 500 --save_total_limit 2
