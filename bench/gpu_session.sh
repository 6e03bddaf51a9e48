#!/usr/bin/env bash
# One GPU-machine session's work, in phases, each small enough for one device call (≤ 10 min):
#
#   bench/gpu_session.sh build            configure + build into build-gpu/ (kept while warm)
#   bench/gpu_session.sh test             the whole ctest suite, GPU tests included (but the tier below)
#   bench/gpu_session.sh qlora            QLoRA / DoRA 7B rows beside the bf16 LoRA row
#   bench/gpu_session.sh dpo              DPO (reference online, and given) beside the SFT LoRA row
#   bench/gpu_session.sh qlora_big        QLoRA 13B, an 8B on a 24 GiB-capped allocator, a 70B step
#   bench/gpu_session.sh ranks            the multi-rank tier: NCCL at world 2 and 4 on emulated nodes
#   bench/gpu_session.sh zero3mem         LLaMA-2-13B LoRA ZeRO-3 at 2 ranks: peak memory per rank
#   bench/gpu_session.sh overlap          exposed communication per step at 2 emulated nodes, by stage
#   bench/gpu_session.sh nodes            [7/7]'s modes (MiCS, hpZ, qwZ + qgZ) at 4 emulated ranks as 2 nodes
#                                         of 2: exposed communication and traffic per step, the model's check
#   bench/gpu_session.sh scaling          the scaling rows at 1, 2, 4, 8 GPUs beside FSDP2 (EMULATE=1:
#                                         the GPUs missing played as nodes on GPU 0, a dry run)
#   bench/gpu_session.sh lora7b           examples/finetune_7b.sh MODE=lora beside the peer
#   bench/gpu_session.sh full7b           examples/finetune_7b.sh MODE=full (optimizer offload)
#   bench/gpu_session.sh lora13b          examples/finetune_13b_zero3_offload.sh
#   bench/gpu_session.sh models           zt_bench_model lora / freeze on Qwen2.5-7B vs the peer
#   bench/gpu_session.sh fullamp          full fine-tune with fp32 masters: Qwen2.5-1.5B vs the peer, 7B
#   bench/gpu_session.sh lora             LoRA 7B 1024 × 8 and 2048 × 4 (checkpointing), 13B 1024 × 8 (checkpointing) vs the peer
#   bench/gpu_session.sh full             pure bf16 full fine-tune 7B 1024 × 4 (checkpointing) vs the peer
#   bench/gpu_session.sh stages           LoRA 7B 1024 × 8 under ZeRO-3 and ZeRO-2 at one rank (their ratio)
#                                         beside the peer (which has no ZeRO)
#                                         (COMPILED=1: each peer run also with HF_COMPILE=1)
#   bench/gpu_session.sh micro            AdamW, copies, the full-model step vs the peer
#   bench/gpu_session.sh phases           forward / backward / optimizer times, ours and HF's
#   bench/gpu_session.sh profile          GPU time per kernel family of one step, ours vs HF's
#                                         (PROFILE="SHAPE MODE SEQ MBS CKPT", default the pure-bf16 7B step)
#   bench/gpu_session.sh profile13b       the same of the 13B ZeRO-3 offload LoRA step (ours): how long the GPU idles
#   bench/gpu_session.sh parity           per-layer hidden states of a Qwen2.5-7B-shaped model against transformers
#                                         (SHAPE=glm-4-9b: a GLM-4-9B-shaped one)
#   bench/gpu_session.sh glm              the GLM-4-9B-shaped LoRA step beside the peer (extended with that shape)
#   bench/gpu_session.sh families         LoRA on the Qwen3-8B, Gemma-3-12B, Gemma-2-9B and Phi-4 shapes beside
#                                         the peer (COMPILED=1 too), QLoRA Qwen3-14B's peak memory
#   bench/gpu_session.sh moefull          full fine-tuning with expert parallelism at 2 emulated nodes:
#                                         losses beside world 1, the cut 30B-A3B shape's memory per rank
#   bench/gpu_session.sh moebig           a QLoRA step of the GLM-4.5-Air shape (106B) on one GPU
#   bench/gpu_session.sh moe              LoRA on the Qwen3-30B-A3B shape beside the peer (COMPILED=1 too),
#                                         QLoRA over gpt-oss-20b's 4-bit experts: peak memory
#   bench/gpu_session.sh tokspeed         one-thread encoding speed, ours and HF tokenizers', per real
#                                         tokenizer folder (REAL=DIR, TOKMB=10)
#   bench/gpu_session.sh compare          before/after: the models, micro and glm rows of this tree and of
#                                         zt-before/ (git archive REV | tar -x -C zt-before), alternately
#   bench/gpu_session.sh varlen           LoRA 7B on real lengths (the peer's varlen_lengths): padded, and packed
#                                         rows with variable-length attention, beside the peer's lora_varlen
#   bench/gpu_session.sh ladder           long context: one LoRA 7B step at micro-batch 1 with checkpointing
#                                         at 16k, 32k, ... 256k tokens until the first failure, ours then the peer's
#   bench/gpu_session.sh conformance      PEFT, transformers and tensorboard read what zerotrain wrote
#                                         (this build's tool tests write it), results in $OUT/conformance.tgz
#   bench/gpu_session.sh generate         generation tokens/s, generate_batch beside transformers' generate
#                                         (GEN="SHAPE BATCH PROMPT NEW LORA_R;...")
#   bench/gpu_session.sh grpo             a GRPO step on the Qwen2.5-7B shape, LoRA, P=32 prompts x 8 x
#                                         (256 + 768) tokens, then that batch's generation alone
#   bench/gpu_session.sh grpolong         an 8B (LLaMA-3-8B shape) LoRA GRPO step, 8 generations of 20K tokens:
#                                         wall time and peak memory
#   bench/gpu_session.sh sp               Ulysses sequence parallelism at world 1, SP 2 and SP 4 on emulated
#                                         nodes: losses beside world 1's, exposed all-to-all time
#   bench/gpu_session.sh fixtures         make_fixtures.py SECTIONS (FAMILIES=...) and transformers' sources
#                                         of SOURCES="gpt_oss glm4_moe ...", in $OUT/fixtures.tgz
#
# Phases may be chained (`build test`). Needs `.gpu-deps/` (../shared/gpu/prepare-deps.sh, then
# cmake/gpu-deps-extra.sh) and,
# for the peer runs, `.peer/hf_baseline.py` (a copy of ../shared/bench/hf_baseline.py): carry
# both. Logs and RESULT lines go under $OUT (the device tool's result folder), training
# outputs under /tmp so that no model weights are sent back.
set -euo pipefail
cd "$(dirname "$0")/.."
source .gpu-deps/env.sh
results=${OUT:-/tmp/zt-gpu-results}
mkdir -p "$results"
b=build-gpu
zt=$PWD/$b/bin/zerotrain
steps=${STEPS:-20}

peer() {  # SHAPE MODE SEQ MBS CKPT  (PEER=0 skips the peer runs; COMPILED=1 adds HF_COMPILE=1,
        # COMPILED=only runs the compiled peer alone)
  [ "${PEER:-1}" = 1 ] || return 0
  if [ -f .peer/hf_baseline.py ]; then
    if [ "${COMPILED:-0}" != only ]; then
      python3 .peer/hf_baseline.py "$@" 2>&1 | tee -a "$results/peer.log" | grep '^RESULT' || true
    fi
    if [ "${COMPILED:-0}" != 0 ]; then
      HF_COMPILE=1 python3 .peer/hf_baseline.py "$@" 2>&1 | tee -a "$results/peer.log" |
        grep '^RESULT' || true
    fi
  else
    echo "no .peer/hf_baseline.py: peer run skipped" | tee -a "$results/peer.log"
  fi
}

ours() {  # SHAPE MODE SEQ MBS CKPT: zt_bench_model's RESULT line
  $b/bin/zt_bench_model "$@" 2>&1 | tee -a "$results/ours.log" | grep '^RESULT' || true
}

# Runs one example script; keeps its trainer_log.jsonl and prints the steady-state summary.
example() {  # NAME SCRIPT [VAR=VALUE...]
  local name=$1 script=$2
  shift 2
  local out=/tmp/zt-$name
  rm -rf "$out" "$out.synthetic.jsonl"
  local start=$SECONDS
  env "$@" ZT="$zt" OUT="$out" STEPS="$steps" "$script" > "$results/$name.log" 2>&1 || {
    echo "$name failed (status $?), last lines:"
    tail -20 "$results/$name.log"
    return 0
  }
  cp "$out/trainer_log.jsonl" "$results/$name.trainer_log.jsonl"
  python3 bench/tools/summarize_log.py "$name" "$out/trainer_log.jsonl" $((SECONDS - start)) |
    tee -a "$results/summary.jsonl"
}

for phase in "$@"; do
  echo "== $phase ($(date -u +%H:%M:%S))"
  case "$phase" in
    grpo)
      P=${P:-32} bench/tools/grpo_step.sh 2>&1 | tee -a "$results/grpo.log" | tail -12
      ;;
    grpolong)  # [5/7]: an 8B LoRA GRPO step with 20K-token completions (Unsloth's 54.3 GB mark)
      SHAPE=llama3-8b P=1 MICRO=1 COMPLETION=${COMPLETION:-20000} SPLIT=0 bench/tools/grpo_step.sh \
        2>&1 | tee -a "$results/grpolong.log" | tail -12
      ;;
    generate)
      IFS=';' read -r -a cases <<< "${GEN:-qwen2.5-1.5b 64 256 256 0;qwen2.5-7b 64 256 256 16}"
      for c in "${cases[@]}"; do
        # shellcheck disable=SC2086
        $b/bin/zt_bench_generate $c 2>&1 | tee -a "$results/generate.log" | grep '^RESULT' || true
        if [ "${PEER:-1}" = 1 ]; then
          # shellcheck disable=SC2086
          python3 bench/tools/hf_generate.py $c 2>&1 | tee -a "$results/generate.log" |
            grep '^RESULT' || true
        fi
      done
      ;;
    build)
      cmake -S . -B $b -G Ninja -DCMAKE_BUILD_TYPE=Release > "$results/configure.log" 2>&1 ||
        { tail -30 "$results/configure.log"; exit 1; }
      # -k 0: a target that does not compile still leaves every other one built and usable.
      if cmake --build $b -- -k 0 > "$results/build.log" 2>&1; then
        echo "built"
      else
        grep -B2 -A12 'error' "$results/build.log" | head -80
        echo "build incomplete: the phases below use what was built"
      fi
      ;;
    test)
      (cd $b && ctest -j8 --timeout 600 -E 'nccl ranks' > "$results/ctest.log" 2>&1) || true
      tail -25 "$results/ctest.log"
      ;;
    qlora)  # QLoRA / DoRA beside zerotrain's bf16 LoRA row, Qwen2.5-7B shape, r16 all-linear:
      # 1024 × 8, 1024 × 4 with checkpointing, DoRA's and 4-bit DoRA's cost (docs/performance.md)
      for row in "lora 1024 8 0" "qlora 1024 8 0" "qlora 1024 4 1" "dora 1024 8 0" "qdora 1024 4 1"; do
        ours qwen2.5-7b $row 8
      done
      ;;
    dpo)  # [5/5]: DPO beside zerotrain's SFT LoRA row at the same rows (Qwen2.5-7B shape, r16
      # all-linear; MICRO_BATCH rows = MICRO_BATCH / 2 pairs): the reference online and given
      for row in "lora 1024 8 0" "dpo 1024 8 0" "dpo_pre 1024 8 0" "lora 1024 8 1" "dpo 1024 8 1"; do
        ours qwen2.5-7b $row 8
      done
      ;;
    qlora_big)  # LLaMA-2-13B QLoRA 1024 × 4 (checkpointing); an 8B QLoRA at 8192 × 1 on a "24 GB
      # card" (the allocator capped at 24 GiB); one LLaMA-2-70B-shaped QLoRA step
      ours llama2-13b qlora 1024 4 1 6
      ZT_BENCH_CAP_GIB=24 ours llama3-8b qlora 8192 1 1 4
      ZT_BENCH_WARMUP=1 ours llama2-70b qlora ${SEQ70:-1024} 1 1 2
      ;;
    ranks)  # the multi-rank GPU tier: NCCL at world 2 and 4, each rank a node of its own when the
      # GPUs are fewer (tests/gpu/test_nccl_ranks.cpp; RANKS=REGEX picks some of its cases)
      (cd $b && ctest -j${RANKS_JOBS:-6} --timeout 900 -R "nccl ranks${RANKS:+.*$RANKS}" \
        > "$results/ranks.log" 2>&1) || true
      grep -E '(Passed|Failed|Not Run|Timeout|tests passed|ZeRO-3 memory)' "$results/ranks.log" | tail -40
      ;;
    overlap)  # exposed communication per step at 2 ranks on emulated nodes (slow socket links
      # make hidden and exposed communication easy to tell apart): LoRA 7B at stages 2, 3 and
      # 3 + offload, full fine-tuning of the 1.5B shape at stages 1, 2, 3 (OVERLAP="..." rows).
      # A stage suffixed "oc" adds "overlap_comm": true and 2e8-element buckets (HF's ZeRO-2
      # example config), "no" "overlap_comm": false (DeepSpeed's default below stage 3; zerotrain's
      # is on). OVWORLD=1 runs the same rows as one plain rank (no timeline): the compute the
      # model is checked from; OVWORLD=4 at four ranks. A stage may carry the [7/7] modes after
      # '+' (3+hpz, 3+qw+qg, 2oc+mics) with groups of OVNODE ranks (default half the world), the
      # ranks per node. Then: scaling_model.py check FILE --link measured --kappa 1.25
      # (docs/scaling.md).
      python3 examples/synthetic_tokens.py /tmp/zt-ov.jsonl 1024
      rows=${OVERLAP:-"lora:qwen2.5-7b:2oc lora:qwen2.5-7b:3 lora:qwen2.5-7b:3off full:qwen2.5-1.5b:1oc full:qwen2.5-1.5b:2oc full:qwen2.5-1.5b:3"}
      world=${OVWORLD:-2}
      for row in $rows; do
        IFS=: read -r mode shape stage <<< "$row"
        name=$mode-$shape-z$stage-w$world
        base=${stage%%+*}
        modes=${stage#"$base"}
        node=${OVNODE:-$(( world > 1 ? world / 2 : 1 ))}
        zero="\"stage\": ${base//[a-z]/}"
        case "$modes+" in *+hpz+*) zero+=", \"zero_hpz_partition_size\": $node" ;; esac
        case "$modes+" in *+mics+*) zero+=", \"mics_shard_size\": $node" ;; esac
        case "$modes+" in *+qw+*) zero+=', "zero_quantized_weights": true' ;; esac
        case "$modes+" in *+qg+*) zero+=', "zero_quantized_gradients": true' ;; esac
        case "$base" in
          *off) zero+=', "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}' ;;
          *oc) zero+=', "overlap_comm": true, "reduce_bucket_size": 2e8, "allgather_bucket_size": 2e8' ;;
          *no) zero+=', "overlap_comm": false' ;;
        esac
        ds="{\"zero_optimization\": {$zero}, \"bf16\": {\"enabled\": \"auto\"},
            \"train_micro_batch_size_per_gpu\": \"auto\", \"gradient_accumulation_steps\": \"auto\",
            \"train_batch_size\": \"auto\"}"
        extra=()
        [ "$mode" = lora ] && extra=(--lora_r 16 --lora_alpha 32 --lora_target_modules all-linear)
        launcher=("$zt" launch --nproc_per_node "$world" --one_node_per_rank true --)
        [ "$world" = 1 ] && launcher=()
        rm -rf "/tmp/zt-ov-$name" && mkdir -p "/tmp/zt-ov-$name"
        ZT_RANKS_PER_NODE=$node ZT_COMM_TIMELINE="/tmp/zt-ov-$name/tl" "${launcher[@]}" "$zt" train \
          --model_config "examples/shapes/$shape.json" --train_file /tmp/zt-ov.jsonl \
          --output_dir "/tmp/zt-ov-$name/out" --deepspeed "$ds" --bf16 true --max_length 1024 \
          --max_steps "${OVSTEPS:-5}" --finetuning_type "$mode" "${extra[@]}" \
          --per_device_train_batch_size 4 --gradient_checkpointing true --logging_steps 1 \
          --save_strategy no > "$results/overlap-$name.log" 2>&1 ||
          { echo "$name failed"; tail -5 "$results/overlap-$name.log"; continue; }
        python3 bench/tools/summarize_timeline.py "$name" "/tmp/zt-ov-$name/tl" \
          "/tmp/zt-ov-$name/out/trainer_log.jsonl" "$world" "$stage" "$node" |
          tee -a "$results/overlap.jsonl"
      done
      ;;
    nodes)  # [7/7] exposed communication per step by mode at 4 emulated ranks as 2 nodes of 2:
      # full fine-tuning of the 1.5B shape, plain stage 2 (the link is measured from it) and 3
      # beside MiCS, hpZ and qwZ + qgZ (NODES="..." rows), the one-rank row they are predicted
      # from, then scaling_model.py check on them (docs/scaling.md, "The modes across nodes").
      OVWORLD=1 OVERLAP="full:qwen2.5-1.5b:2" OVSTEPS=${OVSTEPS:-3} bench/gpu_session.sh overlap
      OVWORLD=4 OVNODE=2 OVSTEPS=${OVSTEPS:-3} OVERLAP="${NODES:-full:qwen2.5-1.5b:2oc \
        full:qwen2.5-1.5b:3 full:qwen2.5-1.5b:3+hpz+qw+qg full:qwen2.5-1.5b:2oc+mics \
        full:qwen2.5-1.5b:3+hpz full:qwen2.5-1.5b:3+mics}" bench/gpu_session.sh overlap
      python3 bench/tools/scaling_model.py check "$results/overlap.jsonl" --link measured \
        --kappa 1.25 | tee "$results/nodes-check.jsonl" || true
      ;;
    sp)  # [6/7] Ulysses sequence parallelism through the CLI: one LoRA step sequence of SPLEN
      # tokens (default 16384) on the SPSHAPE shape (default qwen2.5-1.5b: 12 heads, 2 kv),
      # bf16, at world 1 and at SP 2 and 4 on emulated nodes: each step's loss beside world 1's
      # (bf16 noise), tokens/s (time-sliced: not a speed figure) and the all-to-all time exposed
      # per step (ZT_COMM_TIMELINE, summarize_timeline.py).
      len=${SPLEN:-16384}
      shape=${SPSHAPE:-qwen2.5-1.5b}
      python3 examples/synthetic_tokens.py /tmp/zt-sp.jsonl "$len" 32000 64
      for n in 1 2 4; do
        name=sp-$shape-$len-w$n
        launcher=("$zt" launch --nproc_per_node "$n" --one_node_per_rank true --)
        [ "$n" = 1 ] && launcher=()
        rm -rf "/tmp/zt-$name" && mkdir -p "/tmp/zt-$name"
        ZT_COMM_TIMELINE="/tmp/zt-$name/tl" "${launcher[@]}" "$zt" train \
          --model_config "examples/shapes/$shape.json" --train_file /tmp/zt-sp.jsonl \
          --output_dir "/tmp/zt-$name/out" --bf16 true --max_length "$len" \
          --deepspeed '{"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}}' \
          --sequence_parallel_size "$n" --max_steps "${SPSTEPS:-4}" --finetuning_type lora \
          --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear \
          --per_device_train_batch_size 1 --gradient_accumulation_steps 1 \
          --gradient_checkpointing true --logging_steps 1 --save_strategy no \
          > "$results/$name.log" 2>&1 || { echo "$name failed"; tail -8 "$results/$name.log"; continue; }
        python3 - "/tmp/zt-$name/out/trainer_log.jsonl" "$name" <<'PY' | tee -a "$results/sp.jsonl"
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l and '"step"' in l]
print(json.dumps({"name": sys.argv[2], "losses": [r["loss"] for r in recs],
                  "tokens_per_s": [r.get("tokens_per_second") for r in recs]}))
PY
        [ "$n" = 1 ] || python3 bench/tools/summarize_timeline.py "$name" "/tmp/zt-$name/tl" \
          "/tmp/zt-$name/out/trainer_log.jsonl" "$n" 2 | tee -a "$results/sp.jsonl"
      done
      ;;
    scaling)  # the scaling rows at WORLDS ranks (default 1 2 4 8, those the machine has GPUs
      # for; EMULATE=1 plays the missing ones as nodes of their own on GPU 0 — a dry run, no
      # figure), each beside PyTorch FSDP2 (bench/fsdp2_baseline.py) on the same shape and batch.
      # A row's fifth field takes the [7/7] modes, '+'-separated (hpz, mics, qw, qg), with groups
      # of NODE ranks (default half the world: two nodes), e.g. full:qwen2.5-7b:3:2:hpz+qw+qg
      gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
      python3 examples/synthetic_tokens.py /tmp/zt-sc.jsonl 1024
      rows=${SCALING:-"lora:qwen2.5-7b:2:8 full:qwen2.5-7b:2:2 full:qwen2.5-7b:3:2 full:llama-2-13b:3:1"}
      for n in ${WORLDS:-1 2 4 8}; do
        nodes=false
        if [ "$n" -gt "$gpus" ]; then
          [ "${EMULATE:-0}" = 1 ] || { echo "world $n: $gpus GPU(s) here, not run"; continue; }
          nodes=true
        fi
        for row in $rows; do
          IFS=: read -r mode shape stage mbs modes <<< "$row"
          name=$mode-$shape-z$stage${modes:+-$modes}-w$n
          node=${NODE:-$(( n > 1 ? n / 2 : 1 ))}
          zk=""
          case "+$modes+" in *+hpz+*) zk="$zk, \"zero_hpz_partition_size\": $node" ;; esac
          case "+$modes+" in *+mics+*) zk="$zk, \"mics_shard_size\": $node" ;; esac
          case "+$modes+" in *+qw+*) zk="$zk, \"zero_quantized_weights\": true" ;; esac
          case "+$modes+" in *+qg+*) zk="$zk, \"zero_quantized_gradients\": true" ;; esac
          export ZT_RANKS_PER_NODE=$node
          ds="{\"zero_optimization\": {\"stage\": $stage$zk}, \"bf16\": {\"enabled\": \"auto\"},
              \"train_micro_batch_size_per_gpu\": \"auto\", \"gradient_accumulation_steps\": \"auto\",
              \"train_batch_size\": \"auto\"}"
          extra=()
          [ "$mode" = lora ] && extra=(--lora_r 16 --lora_alpha 32 --lora_target_modules all-linear)
          rm -rf "/tmp/zt-sc-$name"
          start=$SECONDS
          "$zt" launch --nproc_per_node "$n" --one_node_per_rank "$nodes" -- "$zt" train \
            --model_config "examples/shapes/$shape.json" --train_file /tmp/zt-sc.jsonl \
            --output_dir "/tmp/zt-sc-$name" --deepspeed "$ds" --bf16 true --max_length 1024 \
            --max_steps "${SCSTEPS:-6}" --finetuning_type "$mode" "${extra[@]}" \
            --per_device_train_batch_size "$mbs" --gradient_checkpointing true --logging_steps 1 \
            --save_strategy no > "$results/scaling-$name.log" 2>&1 &&
            python3 bench/tools/summarize_log.py "$name" "/tmp/zt-sc-$name/trainer_log.jsonl" \
              $((SECONDS - start)) | tee -a "$results/scaling.jsonl" ||
            { echo "$name: not run to the end"; tail -3 "$results/scaling-$name.log"; }
          # The same launcher (and, on emulated nodes, the same NCCL variables) for the peer.
          "$zt" launch --nproc_per_node "$n" --one_node_per_rank "$nodes" -- python3 \
            bench/fsdp2_baseline.py "examples/shapes/$shape.json" "$mode" 1024 "$mbs" \
            "${SCSTEPS:-6}" > "$results/fsdp2-$name.log" 2>&1
          grep -h '^RESULT' "$results/fsdp2-$name.log" | tee -a "$results/scaling.jsonl" ||
            { echo "fsdp2 $name: not run to the end"; tail -3 "$results/fsdp2-$name.log"; }
        done
      done
      ;;
    zero3mem)  # the issue's row: LLaMA-2-13B LoRA, ZeRO-3 bf16 without offload, 512 x 1 per rank,
      # keep none, at WORLD (2) ranks; peak memory per rank (allocated, from process start)
      python3 examples/synthetic_tokens.py /tmp/zt-z3mem.jsonl 512
      rm -rf /tmp/zt-z3mem
      "$zt" launch --nproc_per_node "${WORLD:-2}" --one_node_per_rank true -- "$zt" train \
        --model_config examples/shapes/llama-2-13b.json --train_file /tmp/zt-z3mem.jsonl \
        --output_dir /tmp/zt-z3mem --deepspeed '{"zero_optimization": {"stage": 3},
          "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}' \
        --bf16 true --max_length 512 --max_steps "${Z3STEPS:-4}" --finetuning_type lora \
        --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear \
        --per_device_train_batch_size 1 --gradient_checkpointing true \
        --gradient_checkpointing_keep none --logging_steps 1 --save_steps 1000 \
        > "$results/zero3mem.log" 2>&1 || { echo "zero3mem failed"; tail -20 "$results/zero3mem.log"; }
      grep -o '"peak_memory_gib": *[0-9.]*' /tmp/zt-z3mem/trainer_log.jsonl | tee "$results/zero3mem.peaks" || true
      ;;
    lora7b)
      example lora7b examples/finetune_7b.sh MODE=lora
      peer qwen2.5-7b lora 1024 8 0
      ;;
    full7b)
      example full7b examples/finetune_7b.sh MODE=full
      ;;
    lora13b)
      example lora13b examples/finetune_13b_zero3_offload.sh
      peer llama2-13b lora 1024 8 1
      ;;
    models)
      for m in "lora 1024 8 0" "freeze 1024 8 0"; do
        $b/bin/zt_bench_model qwen2.5-7b $m 2>&1 | tee -a "$results/models.log" | grep '^RESULT' || true
        peer qwen2.5-7b $m
      done
      ;;
    fullamp)  # the default full fine-tune (bf16 compute, fp32 masters): 1.5B beside the peer, 7B
      ours qwen2.5-1.5b full_amp 1024 8 0
      peer qwen2.5-1.5b full_amp 1024 8 0
      ours qwen2.5-7b full_amp 1024 4 1  # the peer's fp32 weights + AMP do not fit at 7B
      ;;
    lora)  # LoRA r16 all-linear: Qwen2.5-7B 1024 × 8 and 2048 × 4 with checkpointing,
      # LLaMA-2-13B 1024 × 8 with checkpointing (LORA13B=0 leaves it out)
      ours qwen2.5-7b lora 1024 8 0
      peer qwen2.5-7b lora 1024 8 0
      ours qwen2.5-7b lora 2048 4 1
      peer qwen2.5-7b lora 2048 4 1
      if [ "${LORA13B:-1}" = 1 ]; then
        ours llama2-13b lora 1024 8 1
        peer llama2-13b lora 1024 8 1
      fi
      ;;
    full)  # pure bf16 full fine-tune, Qwen2.5-7B 1024 × 4, checkpointing
      ours qwen2.5-7b full 1024 4 1
      peer qwen2.5-7b full 1024 4 1
      ;;
    stages)  # the issue's ZeRO-3 / ZeRO-2 row: the same LoRA step under each stage, one rank
      for stage in 3 2; do ZT_BENCH_STAGE=$stage ours qwen2.5-7b lora 1024 8 0; done
      peer qwen2.5-7b lora 1024 8 0
      ;;
    micro)
      # The host's layout decides whether memory placement matters to the CPU optimizer.
      lscpu | grep -E '^(Model name|CPU\(s\)|Socket|NUMA)' | tee "$results/lscpu.txt" || true
      $b/bin/zt_bench_engine adamw 2>&1 | tee "$results/adamw.log" | grep '^RESULT' || true
      $b/bin/zt_bench_engine copies 2>&1 | tee "$results/copies.log" | grep '^RESULT' || true
      $b/bin/zt_bench_model qwen2.5-7b full 1024 4 1 2>&1 | tee "$results/model.log" | grep '^RESULT' || true
      peer qwen2.5-7b full 1024 4 1
      ;;
    phases)
      for m in "full 1024 4 1" "lora 1024 8 0"; do
        ZT_BENCH_PHASES=1 $b/bin/zt_bench_model qwen2.5-7b $m 2>&1 | tee -a "$results/phases.log" | grep '^RESULT' || true
        python3 bench/tools/hf_phases.py qwen2.5-7b $m 2>&1 | tee -a "$results/phases.log" | grep '^RESULT' || true
      done
      ;;
    profile)  # PROFILE="SHAPE MODE SEQ MBS CKPT" (default the pure-bf16 7B step); PEER=0: ours only
      read -r -a case_ <<< "${PROFILE:-qwen2.5-7b full 1024 4 1}"
      tag=$(IFS=_; echo "${case_[*]}")
      impls=zerotrain
      [ "${PEER:-1}" = 1 ] && impls="zerotrain hf"
      for impl in $impls; do
        python3 bench/tools/profile_step.py $impl "${case_[@]}" "$results/profile_${tag}_$impl.json" \
          > "$results/profile_${tag}_$impl.log" 2>&1 || tail -20 "$results/profile_${tag}_$impl.log"
        head -45 "$results/profile_${tag}_$impl.log" | cut -c1-150
      done
      [ "${PEER:-1}" = 1 ] && python3 bench/tools/profile_step.py compare \
        "$results/profile_${tag}_zerotrain.json" "$results/profile_${tag}_hf.json" || true
      ;;
    profile13b)
      ZT_PROFILE_DEEPSPEED=$PWD/examples/deepspeed/ds_config_zero3_offload.json \
        python3 bench/tools/profile_step.py zerotrain llama2-13b lora 1024 8 1 "$results/profile_13b.json" \
        > "$results/profile_13b.log" 2>&1 || tail -20 "$results/profile_13b.log"
      head -30 "$results/profile_13b.log"
      ;;
    compare)  # before/after on one machine: the zt_bench rows of COMPARE ("models micro glm"
      # by default) from this tree and from zt-before/ (an earlier commit's sources, made here with
      # `git archive REV | tar -x -C zt-before`, which travels untracked), built into /tmp/zt-before
      # and run alternately, after then before, so that drift hits both alike. No peer runs.
      [ -d zt-before ] || { echo "compare: no zt-before/ (git archive REV | tar -x -C zt-before)"; exit 1; }
      ln -sfn ../.gpu-deps zt-before/.gpu-deps
      cmake -S zt-before -B /tmp/zt-before -G Ninja -DCMAKE_BUILD_TYPE=Release \
        > "$results/compare-configure.log" 2>&1 || { tail -20 "$results/compare-configure.log"; exit 1; }
      cmake --build /tmp/zt-before --target zt_bench_model zt_bench_engine \
        > "$results/compare-build.log" 2>&1 || { tail -20 "$results/compare-build.log"; exit 1; }
      rows=()
      for set in ${COMPARE:-models micro glm}; do
        case "$set" in
          models) rows+=("model qwen2.5-7b lora 1024 8 0" "model qwen2.5-7b freeze 1024 8 0") ;;
          micro) rows+=("engine adamw" "engine copies" "model qwen2.5-7b full 1024 4 1") ;;
          glm) rows+=("model glm-4-9b lora 1024 8 0") ;;
        esac
      done
      for row in "${rows[@]}"; do
        read -r tool args <<< "$row"
        for side in after before; do
          dir=$b/bin
          [ "$side" = before ] && dir=/tmp/zt-before/bin
          # shellcheck disable=SC2086
          $dir/zt_bench_$tool $args 2>&1 | tee -a "$results/compare-$side.log" | grep '^RESULT' |
            sed "s/^RESULT /RESULT $side /" | tee -a "$results/compare.jsonl" || true
        done
      done
      ;;
    families)
      # [1/7]: LoRA r16 all-linear 1024 × 8 on the 2026 families' shapes beside the peer, eager
      # and compiled (FAMILIES="qwen3-8b:0 phi-4:1" overrides: SHAPE:CKPT), then QLoRA
      # Qwen3-14B 1024 × 4 with checkpointing (peak memory; QLORA14=0 leaves it out).
      for row in ${FAMILIES:-qwen3-8b:0 gemma-3-12b:1 gemma-2-9b:1 phi-4:1}; do
        IFS=: read -r shape ckpt <<< "$row"
        ours "$shape" lora 1024 8 "$ckpt" 8
        peer "$shape" lora 1024 8 "$ckpt"
      done
      # QLoRA with checkpointing that keeps nothing (gradient_checkpointing_keep none): the
      # memory floor the goal is about; `auto` spends free memory on kept outputs for speed.
      [ "${QLORA14:-1}" = 1 ] && ZT_BENCH_KEEP=none ours qwen3-14b qlora 1024 4 1 8
      ;;
    moe)
      # [4/7]: LoRA r16 all-linear (attention, experts, routers: PEFT 0.21's conversion) on the
      # Qwen3-30B-A3B shape 1024 × 8 with checkpointing beside the peer, eager and compiled; then
      # the gpt-oss-20b shape's LoRA over 4-bit experts (QLoRA) 1024 × 1: its peak memory.
      ours qwen3-30b-a3b lora 1024 8 1 8
      peer qwen3-30b-a3b lora 1024 8 1
      ZT_BENCH_KEEP=none ours gpt-oss-20b qlora 1024 1 1 8
      ;;
    moefull)
      # [4/7]: full fine-tuning with expert parallelism over NCCL, 2 ranks as nodes of their own.
      # (1) a small Qwen3-MoE at world 1 and at world 2 and 4 with expert_parallel_size 2, ZeRO 2
      # and 3, bf16: the per-step losses side by side (summary: the largest relative difference).
      # (2) the Qwen3-30B-A3B shape cut to MOELAYERS (4) layers, bf16, ZeRO-2, 1024 × 1 with
      # checkpointing, at world 2 with expert_parallel_size 2: each rank's peak memory beside
      # docs/scaling.md's formula for it (bench/tools/scaling_model.py moe_memory).
      python3 examples/synthetic_tokens.py /tmp/zt-moe.jsonl 256 1000 64
      python3 examples/synthetic_tokens.py /tmp/zt-moe1k.jsonl 1024 150000 16
      cat > /tmp/zt-moe-small.json << 'JSON'
{"model_type": "qwen3_moe", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
 "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
 "norm_topk_prob": true, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
 "rope_theta": 1000000.0, "tie_word_embeddings": false}
JSON
      for stage in ${STAGES:-2 3}; do
        for run in "1 1" "2 2" "4 2"; do
          read -r world ep <<< "$run"
          out=/tmp/zt-moefull-z$stage-w$world
          rm -rf $out
          "$zt" launch --nproc_per_node "$world" --one_node_per_rank true -- "$zt" train \
            --model_config /tmp/zt-moe-small.json --train_file /tmp/zt-moe.jsonl --output_dir $out \
            --deepspeed "{\"zero_optimization\": {\"stage\": $stage}}" --bf16 true \
            --finetuning_type full --learning_rate 1e-4 --max_length 256 --max_steps 6 \
            --per_device_train_batch_size $((4 / world)) --expert_parallel_size $ep \
            --logging_steps 1 --save_strategy no --seed 7 > "$results/moefull-z$stage-w$world.log" 2>&1 ||
            { echo "moefull z$stage w$world failed"; tail -20 "$results/moefull-z$stage-w$world.log"; }
        done
        for world in 2 4; do
        python3 - /tmp/zt-moefull-z$stage-w1 /tmp/zt-moefull-z$stage-w$world << 'PY' | tee -a "$results/summary.jsonl"
import json, sys
def losses(d):
    out = {}
    for line in open(d + "/trainer_log.jsonl"):
        r = json.loads(line)
        if "loss" in r: out[r["step"]] = r["loss"]
    return out
a, b = losses(sys.argv[1]), losses(sys.argv[2])
diff = max(abs(a[k] - b[k]) / abs(a[k]) for k in a)
print(json.dumps({"row": sys.argv[2].split("/")[-1], "world1": [a[k] for k in sorted(a)],
                  "ep2": [b[k] for k in sorted(b)], "max_relative_difference": diff}))
PY
        done
      done
      layers=${MOELAYERS:-4}
      [ "$layers" = 0 ] && continue  # MOELAYERS=0: the losses only
      python3 -c "import json, sys; c = json.load(open('examples/shapes/qwen3-30b-a3b.json'))
c['num_hidden_layers'] = int(sys.argv[1]); c['max_window_layers'] = int(sys.argv[1]); print(json.dumps(c))" \
        "$layers" > /tmp/zt-moe-cut.json
      rm -rf /tmp/zt-moemem
      "$zt" launch --nproc_per_node 2 --one_node_per_rank true -- "$zt" train \
        --model_config /tmp/zt-moe-cut.json --train_file /tmp/zt-moe1k.jsonl \
        --output_dir /tmp/zt-moemem --deepspeed '{"zero_optimization": {"stage": 2}}' \
        --bf16 true --finetuning_type full --max_length 1024 --max_steps 3 \
        --per_device_train_batch_size 1 --gradient_checkpointing true --expert_parallel_size 2 \
        --logging_steps 1 --save_strategy no > "$results/moemem.log" 2>&1 ||
        { echo "moemem failed"; tail -20 "$results/moemem.log"; }
      grep -E "engine:|trainable params" "$results/moemem.log" | head -4
      grep -o '"peak_memory_gib": *[0-9.]*' /tmp/zt-moemem/trainer_log.jsonl | tail -1 |
        tee "$results/moemem.peak" || true
      python3 bench/tools/scaling_model.py moe_memory /tmp/zt-moe-cut.json --world 2 --ep 2 \
        --stage 2 | tee -a "$results/summary.jsonl"
      ;;
    moebig)
      # [4/7]: a QLoRA step of the GLM-4.5-Air shape (106B) on one GPU, 1024 × 1 with
      # checkpointing (keep none): LoRA r16 on every linear layer, then on attention alone
      # (TARGETS overrides). The 4-bit base is drawn directly (ZT_BENCH_RANDOM_4BIT: random codes
      # and repeated scales), not quantized from random values on the host.
      for target in ${TARGETS:-all-linear q_proj,k_proj,v_proj,o_proj}; do
        ZT_BENCH_TARGET=$target ZT_BENCH_RANDOM_4BIT=1 ZT_BENCH_KEEP=none ZT_BENCH_WARMUP=1 \
          ours glm-4.5-air qlora 1024 1 1 2
      done
      ;;
    tokspeed)
      # [2/7]: encoding speed on one thread, ours and HF tokenizers', on the same generated
      # corpus (TOKMB MB) for each real tokenizer folder under REAL (tests/tools/
      # fetch_real_tokenizers.sh): the ≥ 5× goal of docs/performance.md.
      real=${REAL:-/tmp/zt-real}
      if [ ! -d "$real" ] && [ -f .gpu-check/real.tar.xz ]; then
        mkdir -p "$real" && tar xJf .gpu-check/real.tar.xz -C "$real"
      fi
      mb=${TOKMB:-10}
      for d in "$real"/*/; do
        $b/bin/zt_bench_tokenizer --mb "$mb" --threads 1 --tokenizer "$d" 2>&1 |
          tee -a "$results/tokspeed.log" | grep '^RESULT' || true
      done
      RAYON_NUM_THREADS=1 python3 bench/tools/hf_tokenizer_speed.py \
        "${TMPDIR:-/tmp}/zt_tokenizer_bench_${mb}mb_v1.jsonl" "$real"/*/ 2>&1 |
        tee -a "$results/tokspeed.log" | grep '^RESULT' || true
      ;;
    glm)
      # GLM-4-9B-shaped LoRA step beside the peer extended with that shape (bench/tools/hf_baseline_glm.py).
      $b/bin/zt_bench_model glm-4-9b lora 1024 8 0 2>&1 | tee -a "$results/glm.log" | grep '^RESULT' || true
      if [ "${PEER:-1}" = 1 ] && [ -f .peer/hf_baseline.py ]; then
        python3 bench/tools/hf_baseline_glm.py .peer/hf_baseline.py glm-4-9b lora 1024 8 0 2>&1 |
          tee -a "$results/peer.log" | grep '^RESULT' || true
      fi
      ;;
    seed7b)  # the seed's command (README "Using it" with the seed's --fp16: full fine-tune,
      # ds_config_zero2_offload.json, 1024 × 4 × accumulation 4) on the Qwen2.5-7B shape, as it
      # is and with offload_optimizer.ratio 0.5 (RATIOS="1 0.5 ..." overrides)
      data=/tmp/zt-seed.synthetic.jsonl
      [ -f $data ] || python3 examples/synthetic_tokens.py $data 1024 32000 400
      for ratio in ${RATIOS:-1 0.5}; do
        python3 -c "import json, sys; c = json.load(open('examples/deepspeed/ds_config_zero2_offload.json'))
c['zero_optimization']['offload_optimizer']['ratio'] = float(sys.argv[1]); print(json.dumps(c))" \
          "$ratio" > /tmp/zt-seed-ds.json
        rm -rf /tmp/zt-seed7b
        start=$SECONDS
        $zt train --model_config examples/shapes/qwen2.5-7b.json --train_file $data \
          --output_dir /tmp/zt-seed7b --deepspeed /tmp/zt-seed-ds.json --finetuning_type full \
          --per_device_train_batch_size 4 --gradient_accumulation_steps 4 --learning_rate 2e-5 \
          --fp16 True --max_length 1024 --max_steps "${SEED_STEPS:-12}" --logging_steps 3 \
          --save_strategy no > "$results/seed7b_$ratio.log" 2>&1 ||
          { tail -20 "$results/seed7b_$ratio.log"; continue; }
        cp /tmp/zt-seed7b/trainer_log.jsonl "$results/seed7b_$ratio.trainer_log.jsonl"
        python3 bench/tools/summarize_log.py seed7b_ratio_$ratio /tmp/zt-seed7b/trainer_log.jsonl \
          $((SECONDS - start)) | tee -a "$results/summary.jsonl"
      done
      ;;
    varlen)  # LoRA 7B on the peer's varlen_lengths(): padded per micro-batch, and packed rows
      # of 2048 × 4 with variable-length attention (then with the dense document mask it
      # replaced, ZT_VARLEN_ATTENTION=0), beside the peer's lora_varlen 2048 4 0
      python3 -c "import sys; sys.path.insert(0, '.peer'); from hf_baseline import varlen_lengths
print('\n'.join(map(str, varlen_lengths(4000, 2048))))" > /tmp/zt-lengths.txt
      export ZT_BENCH_LENGTHS=/tmp/zt-lengths.txt
      ours qwen2.5-7b lora_varlen 2048 8 0
      ours qwen2.5-7b lora_packed 2048 4 0
      ZT_VARLEN_ATTENTION=0 ours qwen2.5-7b lora_packed 2048 4 0
      peer qwen2.5-7b lora_varlen 2048 4 0
      ;;
    ladder)  # LADDER="16384 32768 ..." overrides the lengths; LSHAPE the shape (qwen2.5-7b);
      # TILED=1 adds the tiled MLP, OFFLOAD=1 use_unsloth_gc (HOST_GIB its host budget),
      # SPAN=N recompute_num_layers, LAYERS=L the shape with L layers, LMODE=qlora QLoRA,
      # CAP_GIB an allocator cap, KEEP gradient_checkpointing_keep (the peer runs without any)
      lengths=${LADDER:-16384 32768 65536 131072 262144}
      for seq in $lengths; do
        line=$( (env ZT_BENCH_WARMUP=0 ZT_BENCH_TILED=${TILED:-0} ZT_BENCH_OFFLOAD=${OFFLOAD:-0} \
          ${KEEP:+ZT_BENCH_KEEP=$KEEP} ${SPAN:+ZT_BENCH_SPAN=$SPAN} ${LAYERS:+ZT_BENCH_LAYERS=$LAYERS} \
          ${HOST_GIB:+ZT_BENCH_HOST_GIB=$HOST_GIB} ${CAP_GIB:+ZT_BENCH_CAP_GIB=$CAP_GIB} \
          $b/bin/zt_bench_model "${LSHAPE:-qwen2.5-7b}" "${LMODE:-lora}" "$seq" 1 1 1 2>&1 || true) |
          tee -a "$results/ladder.log" | grep '^RESULT' || true)
        [ -n "$line" ] || line="RESULT {\"impl\": \"zerotrain\", \"seq\": $seq, \"error\": \"no result\"}"
        echo "$line"
        case $line in *'"error"'*) break ;; esac
      done
      if [ "${PEER:-1}" = 1 ] && [ -f .peer/hf_baseline.py ]; then
        # shellcheck disable=SC2086
        python3 bench/tools/peer_ladder.py .peer/hf_baseline.py qwen2.5-7b $lengths 2>&1 |
          tee -a "$results/peer.log" | grep '^RESULT' || true
      fi
      ;;
    parity)  # SHAPE=glm-4-9b for GLM
      rm -rf /tmp/zt-parity
      $b/bin/zt_model_dump "${SHAPE:-qwen2.5-7b}" /tmp/zt-parity > "$results/parity.log" 2>&1 &&
        python3 tests/tools/compare_hidden_states.py /tmp/zt-parity 2>&1 | tee -a "$results/parity.log" | grep '^RESULT' ||
        tail -20 "$results/parity.log"
      rm -rf /tmp/zt-parity
      ;;
    conformance)
      # PEFT, transformers and tokenizers read what zerotrain wrote: the adapters and exported
      # folders come from this build's own tool tests (zt_tests "[.tool]" cases), the real
      # tokenizer folders from .gpu-check/real.tar.xz (carried; tests/tools/
      # fetch_real_tokenizers.sh DIR NAME..., then tar cJf), results in $OUT/conformance.tgz.
      c=/tmp/zt-conformance
      rm -rf /tmp/zt-real $c && mkdir -p /tmp/zt-real $c
      if [ -f .gpu-check/real.tar.xz ]; then tar xJf .gpu-check/real.tar.xz -C /tmp/zt-real; fi
      ZT_OUT=$c/adapters $b/bin/zt_tests "tool: write zerotrain adapters for the PEFT check" \
        > $c/tool_adapters.log 2>&1 || tail -20 $c/tool_adapters.log
      ZT_OUT=$c/outputs ZT_REAL_TOKENIZERS=/tmp/zt-real $b/bin/zt_tests \
        "tool: write run outputs for the transformers checks" > $c/tool_outputs.log 2>&1 ||
        tail -20 $c/tool_outputs.log
      python3 tests/tools/check_peft_loads.py $c/adapters $c/peft > $c/peft.log 2>&1 ||
        tail -30 $c/peft.log
      python3 tests/tools/check_hf_outputs.py $c/outputs /tmp/zt-real $c/hf > $c/hf.log 2>&1 ||
        tail -30 $c/hf.log
      tar czf "$results/conformance.tgz" -C $c peft hf peft.log hf.log
      python3 - "$c/peft/report.json" <<'PY' || true
import json, sys
for name, r in sorted(json.load(open(sys.argv[1])).items()):
    if isinstance(r, dict) and "max_abs_diff_vs_zerotrain" in r:
        print(name, r["max_abs_diff_vs_zerotrain"], r.get("peft_resaves_same_tensors"))
    elif isinstance(r, dict) and "skipped" in r:
        print(name, "skipped:", r["skipped"])
PY
      ;;
    fixtures)
      # Reference fixtures from transformers / PEFT (tests/tools/make_fixtures.py; SECTIONS, by
      # default "families experts", FAMILIES=a,b for some family models only) and, for the
      # model types in SOURCES, transformers' own modeling and configuration files: all in
      # $OUT/fixtures.tgz, to be committed under tests/fixtures/.
      f=/tmp/zt-fixtures
      rm -rf $f && mkdir -p $f/src
      # shellcheck disable=SC2086
      python3 tests/tools/make_fixtures.py $f/out ${SECTIONS:-families experts} > $f/make.log 2>&1 ||
        true
      grep -E "FAILED|Error" $f/make.log | head -20 || true
      t=$(python3 -c "import os, transformers; print(os.path.dirname(transformers.__file__))")
      for m in ${SOURCES:-}; do cp "$t/models/$m/"*.py $f/src/ 2>/dev/null || echo "no model type $m"; done
      tar czf "$results/fixtures.tgz" -C $f .
      ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
