#!/usr/bin/env bash
# A GRPO step on the Qwen2.5-7B shape (random weights), LoRA r16, bf16, one GPU, through the CLI
# (issue [5/7]'s row): P prompts of 256 byte tokens x 8 generations of up to 768 tokens (a random
# model's sampling over 152k ids rarely stops, so completions are about 768 tokens), then the same
# batch's generation alone (zt_bench_generate), for the split between phases.
#   P=64 bench/tools/grpo_step.sh   (from the project root on the GPU machine, after
#   bench/gpu_session.sh build; needs .gpu-deps)
set -uo pipefail
source .gpu-deps/env.sh > /dev/null
P=${P:-32}
mkdir -p /tmp/grpo7b
python3 - "$P" > /tmp/grpo7b/prompts.jsonl <<'PY'
import json, random, sys
random.seed(0)
for i in range(int(sys.argv[1])):
    print(json.dumps({"prompt": "".join(random.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(256)), "answer": "1"}))
PY
CFG='{"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": false, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}'
start=$(date +%s.%N)
build-gpu/bin/zerotrain train --model_config "$CFG" --train_file /tmp/grpo7b/prompts.jsonl \
  --output_dir /tmp/grpo7b/out --overwrite_output_dir true --stage grpo --num_generations 8 \
  --max_completion_length 768 --per_device_train_batch_size 8 --gradient_accumulation_steps $((P)) \
  --max_steps 1 --logging_steps 1 --save_strategy no --bf16 true --finetuning_type lora --lora_r 16 \
  --lora_alpha 32 --gradient_checkpointing true --reward_funcs repetition:3:-1 --learning_rate 1e-5 \
  --report_to none 2>&1 | tail -6
end=$(date +%s.%N)
echo "wall $(python3 -c "print(round($end - $start, 1))") s"
cat /tmp/grpo7b/out/trainer_log.jsonl | head -2 | cut -c1-600
nvidia-smi --query-gpu=memory.used --format=csv
build-gpu/bin/zt_bench_generate qwen2.5-7b $((P * 8)) 256 768 16 2>&1 | grep RESULT
