#!/usr/bin/env bash
# The 7B / 13B / GLM-4-9B / DPO example scripts run end to end on a tiny model of the same kind (2 steps at RANKS
# ranks, synthetic token data), so they cannot rot between GPU sessions.
#   run_scripts.sh ZEROTRAIN RANKS
set -euo pipefail
zt=$1 ranks=$2
here=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/zt-scripts-XXXXXX")
trap 'rm -rf "$work"' EXIT
cat > "$work/tiny.json" <<'JSON'
{"model_type": "llama", "vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": false}
JSON
cat > "$work/tiny_glm.json" <<'JSON'
{"model_type": "glm", "vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "partial_rotary_factor": 0.5, "attention_bias": true, "max_position_embeddings": 256,
 "rms_norm_eps": 1e-5, "tie_word_embeddings": false}
JSON
run() {  # NAME SCRIPT [VAR=VALUE...]: runs it and checks the final model's files
  local name=$1 script=$2
  shift 2
  env SHAPE_FILE="$work/tiny.json" "$@" ZT="$zt" NGPU="$ranks" STEPS=2 SEQ=32 OUT="$work/$name" \
    OMP_NUM_THREADS=1 "$here/examples/$script" > "$work/$name.log" 2>&1 || {
    cat "$work/$name.log"
    echo "$name: $script failed"
    exit 1
  }
  grep -q '"train_loss"' "$work/$name/trainer_log.jsonl" || { echo "$name: no final log record"; exit 1; }
}
run lora7b finetune_7b.sh MODE=lora
[ -f "$work/lora7b/adapter_model.safetensors" ] || { echo "lora7b: no adapter"; exit 1; }
run full7b finetune_7b.sh MODE=full
[ -f "$work/full7b/model.safetensors" ] || { echo "full7b: no model"; exit 1; }
run dpo7b dpo_7b.sh MODE=lora
[ -f "$work/dpo7b/adapter_model.safetensors" ] || { echo "dpo7b: no adapter"; exit 1; }
grep -q '"rewards/margins"' "$work/dpo7b/trainer_log.jsonl" || { echo "dpo7b: no DPO metrics"; exit 1; }
run dpofull7b dpo_7b.sh MODE=full LOSS=sigmoid
[ -f "$work/dpofull7b/model.safetensors" ] || { echo "dpofull7b: no model"; exit 1; }
run dpofrozen7b dpo_7b.sh MODE=full REFERENCE=model
grep -q 'a frozen copy of the trainable weights' "$work/dpofrozen7b.log" ||
  { echo "dpofrozen7b: no frozen reference"; exit 1; }
run kto7b dpo_7b.sh MODE=lora STAGE=kto
grep -q '"kl"' "$work/kto7b/trainer_log.jsonl" || { echo "kto7b: no KTO metrics"; exit 1; }
run lora13b finetune_13b_zero3_offload.sh
[ -f "$work/lora13b/adapter_model.safetensors" ] || { echo "lora13b: no adapter"; exit 1; }
run loraglm finetune_glm4_9b.sh SHAPE_FILE="$work/tiny_glm.json"
[ -f "$work/loraglm/adapter_model.safetensors" ] || { echo "loraglm: no adapter"; exit 1; }
grep -q gate_up_proj "$work/loraglm/adapter_config.json" ||
  { echo "loraglm: the adapter does not target gate_up_proj"; exit 1; }
# ChatGLM3 P-Tuning v2 on the tiny ChatGLM fixture, with the seed layout's records.
env ZT="$zt" NGPU="$ranks" STEPS=2 SEQ=64 SRC=16 DTYPE=bf16 OMP_NUM_THREADS=1 OUT="$work/ptglm" \
  MODEL="$here/tests/fixtures/models/chatglm" DATA="$here/tests/fixtures/chatglm/seed_records.jsonl" \
  "$here/examples/finetune_chatglm3_ptuning.sh" > "$work/ptglm.log" 2>&1 ||
  { cat "$work/ptglm.log"; echo "ptglm: finetune_chatglm3_ptuning.sh failed"; exit 1; }
[ -f "$work/ptglm/prefix_encoder.safetensors" ] || { echo "ptglm: no ChatGLM prefix encoder"; exit 1; }
echo "example scripts: OK"
