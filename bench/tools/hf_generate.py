#!/usr/bin/env python3
"""The peer of zt_bench_generate: transformers' `generate` on a random-weight model of a real
shape (bf16, SDPA, its default dynamic KV cache), sampling at temperature 1 with every sequence
producing NEW_TOKENS tokens (min_new_tokens = max_new_tokens). Prints one RESULT line.

  python3 bench/tools/hf_generate.py SHAPE BATCH PROMPT_TOKENS NEW_TOKENS [LORA_R]

LORA_R > 0: PEFT LoRA adapters of that rank on all linear layers, unmerged, as TRL's GRPO
generates with a PEFT model. tokens_per_s counts the new tokens over the timed run (after a
warm-up generation of 8 tokens).
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_phases import SHAPES  # noqa: E402

def main():
    shape, batch, prompt, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    lora_r = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    from transformers import AutoConfig, AutoModelForCausalLM
    arch, dims = SHAPES[shape]
    cfg = AutoConfig.for_model(arch, **dims)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    if lora_r > 0:
        from peft import LoraConfig, get_peft_model
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r,
                                                 lora_dropout=0.0, target_modules=targets))
    model.eval()
    ids = torch.randint(3, cfg.vocab_size - 1, (batch, prompt), device="cuda")
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kwargs)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
    produced = (out.shape[1] - prompt) * batch
    print("RESULT " + json.dumps(dict(impl="transformers", shape=shape, batch=batch, prompt=prompt,
                                      new=new, lora_r=lora_r, tokens=produced, seconds=round(s, 4),
                                      tokens_per_s=round(produced / s, 1),
                                      peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))))


if __name__ == "__main__":
    main()
