#!/usr/bin/env bash
# One GRPO step (random weights), LoRA r16, bf16, gradient checkpointing, one GPU, through the
# CLI (issue [5/7]'s rows): P prompts of PROMPT byte tokens x GENS generations of up to COMPLETION
# tokens (a random model's sampling over 100k+ ids rarely stops, so completions run to the end),
# MICRO completions a micro-batch; then (SPLIT=1) the same batch's generation alone
# (zt_bench_generate), for the split between phases.
#   P=64 bench/tools/grpo_step.sh                  the Qwen2.5-7B row: 64 x 8 x (256 + 768)
#   SHAPE=llama3-8b P=1 MICRO=1 COMPLETION=20000 SPLIT=0 bench/tools/grpo_step.sh
#                                                  the 8B row with 20K-token completions
# (from the project root on the GPU machine, after bench/gpu_session.sh build; needs .gpu-deps)
set -uo pipefail
source .gpu-deps/env.sh > /dev/null
SHAPE=${SHAPE:-qwen2.5-7b}
P=${P:-32}
GENS=${GENS:-8}
PROMPT=${PROMPT:-256}
COMPLETION=${COMPLETION:-768}
MICRO=${MICRO:-8}
case "$SHAPE" in
  qwen2.5-7b)
    CFG='{"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": false, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}' ;;
  llama3-8b)
    CFG='{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": false, "rope_theta": 500000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5}' ;;
  *) echo "unknown SHAPE $SHAPE (qwen2.5-7b, llama3-8b)"; exit 2 ;;
esac
dir=/tmp/grpo-$SHAPE
rm -rf "$dir" && mkdir -p "$dir"
python3 - "$P" "$PROMPT" > "$dir/prompts.jsonl" <<'PY'
import json, random, sys
random.seed(0)
for i in range(int(sys.argv[1])):
    print(json.dumps({"prompt": "".join(random.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(int(sys.argv[2]))), "answer": "1"}))
PY
echo "GRPO step: $SHAPE, $P prompts x $GENS generations of $PROMPT + up to $COMPLETION tokens, micro-batch $MICRO"
start=$(date +%s.%N)
build-gpu/bin/zerotrain train --model_config "$CFG" --train_file "$dir/prompts.jsonl" \
  --output_dir "$dir/out" --overwrite_output_dir true --stage grpo --num_generations "$GENS" \
  --max_completion_length "$COMPLETION" --per_device_train_batch_size "$MICRO" \
  --gradient_accumulation_steps $((P * GENS / MICRO)) \
  --max_steps 1 --logging_steps 1 --save_strategy no --bf16 true --finetuning_type lora --lora_r 16 \
  --lora_alpha 32 --gradient_checkpointing true --reward_funcs repetition:3:-1 --learning_rate 1e-5 \
  --report_to none 2>&1 | tail -6
end=$(date +%s.%N)
echo "wall $(python3 -c "print(round($end - $start, 1))") s"
head -2 "$dir/out/trainer_log.jsonl" | cut -c1-700
if [ "${SPLIT:-1}" = 1 ]; then
  build-gpu/bin/zt_bench_generate "$SHAPE" $((P * GENS)) "$PROMPT" "$COMPLETION" 16 2>&1 | grep RESULT
fi
