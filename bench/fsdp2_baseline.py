#!/usr/bin/env python3
"""The PyTorch FSDP2 row beside zerotrain's scaling rows: the same shape (random weights), batch
and step, with torch.distributed.fsdp.fully_shard on every decoder layer and the root, bf16
parameters with fp32 gradient reduction, AdamW, gradient checkpointing, LoRA through PEFT.

    zerotrain launch --nproc_per_node N -- python3 bench/fsdp2_baseline.py SHAPE.json MODE SEQ MBS [STEPS]

(torchrun works the same; any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.)

MODE is lora (r16 all-linear) or full. Prints one line `RESULT {json}` on rank 0: tokens/s of
the job and per GPU, peak memory of the largest rank. Runs on the GPU machine only.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    shape_path, mode, seq, mbs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    shape = json.load(open(shape_path))
    config = AutoConfig.for_model(**shape)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = model.base_model.model.model.layers if mode == "lora" else model.model.layers
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    times = []
    for step in range(steps):
        ids = torch.randint(0, shape["vocab_size"], (mbs, seq), device="cuda", generator=gen)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    steady = times[1:] or times
    step_s = sum(steady) / len(steady)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("RESULT " + json.dumps({
            "impl": "fsdp2", "shape": os.path.basename(shape_path), "mode": mode, "seq": seq,
            "mbs": mbs, "world": world, "step_s": round(step_s, 4),
            "tokens_per_s": round(world * mbs * seq / step_s),
            "tokens_per_s_per_gpu": round(mbs * seq / step_s),
            "peak_gib": round(peak.item(), 2), "loss": round(loss.item(), 4)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
