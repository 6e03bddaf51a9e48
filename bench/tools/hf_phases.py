#!/usr/bin/env python3
"""Where the peer's training step spends its time: forward, backward and optimizer step of HF
transformers (+ PEFT for lora) on a random-weight model of a real shape, set up as
../shared/bench/hf_baseline.py does (bf16, SDPA, fused AdamW, labels = inputs), with a CUDA
synchronization between phases. Prints one RESULT line, to set beside
`ZT_BENCH_PHASES=1 zt_bench_model SHAPE MODE SEQ MICRO_BATCH CKPT`.

  python3 bench/tools/hf_phases.py SHAPE MODE SEQ MICRO_BATCH CKPT [STEPS]

SHAPE: qwen2.5-7b, qwen2.5-1.5b, llama2-13b; MODE: full (pure bf16), full_amp (fp32 weights,
bf16 autocast: the peer's mixed-precision row), lora (r16 all linear), freeze (last two layers).
"""
import json
import sys
import time

import torch

SHAPES = {
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 tie_word_embeddings=False, rope_theta=1e6,
                                 max_position_embeddings=32768)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2,
                                   vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                                   max_position_embeddings=32768)),
    "llama2-13b": ("llama", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                 num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                                 tie_word_embeddings=False, rope_theta=1e4,
                                 max_position_embeddings=4096)),
}


def build(shape, mode, ckpt):
    from transformers import AutoConfig, AutoModelForCausalLM
    arch, dims = SHAPES[shape]
    cfg = AutoConfig.for_model(arch, **dims)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            cfg, torch_dtype=torch.float32 if mode == "full_amp" else torch.bfloat16)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if mode == "lora":
        from peft import LoraConfig, get_peft_model
        model.enable_input_require_grads()
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules=targets))
    elif mode == "freeze":
        last = {f"layers.{i}." for i in (cfg.num_hidden_layers - 2, cfg.num_hidden_layers - 1)}
        for name, p in model.named_parameters():
            p.requires_grad = any(t in name for t in last)
    elif mode not in ("full", "full_amp"):
        raise ValueError(f"MODE must be full, full_amp, lora or freeze, not {mode!r}")
    return cfg, model


def main():
    shape, mode, seq, mbs, ckpt = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
    steps = int(sys.argv[6]) if len(sys.argv) > 6 else 8
    cfg, model = build(shape, mode, ckpt)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (mbs, seq), device="cuda")
    model.train()
    spent = [0.0, 0.0, 0.0]
    for s in range(steps + 3):
        torch.cuda.synchronize()
        marks = [time.perf_counter()]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "full_amp"):
            loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        loss.backward()
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        if s == 2:
            torch.cuda.reset_peak_memory_stats()
        if s >= 3:
            for i in range(3):
                spent[i] += marks[i + 1] - marks[i]
    step_s = sum(spent) / steps
    print("RESULT " + json.dumps(dict(
        impl="hf_phases", shape=shape, mode=mode, seq=seq, mbs=mbs, ckpt=int(ckpt),
        step_s=round(step_s, 4), tokens_per_s=round(mbs * seq / step_s),
        fwd_s=round(spent[0] / steps, 4), bwd_s=round(spent[1] / steps, 4),
        opt_s=round(spent[2] / steps, 4),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1), loss=float(loss))), flush=True)


if __name__ == "__main__":
    main()
