#!/usr/bin/env python3
"""GPU time per kernel of one training step, zerotrain's and the peer's, to find where they
differ. Each side runs in its own process under torch.profiler (CUDA activity only):

  python3 bench/tools/profile_step.py zerotrain SHAPE MODE SEQ MICRO_BATCH CKPT [OUT.json]
  python3 bench/tools/profile_step.py hf        SHAPE MODE SEQ MICRO_BATCH CKPT [OUT.json]
  python3 bench/tools/profile_step.py compare   OURS.json PEER.json

zerotrain runs through its C API (libzerotrain.so, loaded into this Python process with ctypes:
the library links the same LibTorch as the torch module here, so the profiler sees its kernels),
set up as `zt_bench_model` is: random weights of the shape (examples/shapes/), bf16 — pure bf16
for MODE full, fp32 masters for full_amp —, ZeRO-2 at one rank, no clipping, labels = inputs. The peer is transformers (+
PEFT) set up by bench/tools/hf_phases.py, as ../shared/bench/hf_baseline.py does (full_amp: fp32
weights under bf16 autocast; HF_COMPILE=1: torch.compile, compiled during the warm-up).
Environment: ZT_LIB (default build-gpu/lib/libzerotrain.so); ZT_BENCH_KEEP and ZT_BENCH_OFFLOAD, as zt_bench_model's;
ZT_PROFILE_DEEPSPEED, a DeepSpeed
config file for zerotrain instead of the built-in one (e.g. examples/deepspeed/ds_config_zero3_offload.json,
to see how much of an offloaded step the GPU sits idle); run after `source .gpu-deps/env.sh`.
Prints the kernels by GPU time per step, the wall time per step, how long the GPU sat idle between
kernels (and the longest such gaps, with the kernels around them) and a RESULT line; `compare`
lines the two up by kernel family (matmul, attention, elementwise, ...).
"""
import collections
import ctypes
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHAPE_FILES = {"qwen2.5-7b": "qwen2.5-7b.json", "qwen2.5-1.5b": "qwen2.5-1.5b.json", "llama2-7b": "llama-2-7b.json", "llama2-13b": "llama-2-13b.json"}
FAMILIES = [  # first match wins; kernel names are lower-cased
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")),
    ("optimizer", ("adam", "fused_adamw", "multi_tensor")),
    ("softmax / loss", ("softmax", "nll", "cross_entropy", "logsumexp")),
    ("reduction / norm", ("reduce", "norm", "sum_kernel")),
    ("embedding", ("embedding", "index", "scatter", "gather", "sort", "radix")),
    ("copy / cast / fill", ("memcpy", "memset", "copy", "fill", "cast", "cat", "direct_copy")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "silu", "swiglu", "rotary", "mul", "add")),
]


def family(name):
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def profiled(step, warmup=3, steps=4):
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1000.0 / steps
    kernels = []
    for e in prof.key_averages():
        total = getattr(e, "self_device_time_total", None)
        if total is None:
            total = e.self_cuda_time_total
        if total <= 0:
            continue
        kernels.append({"name": e.key, "ms_per_step": total / 1000.0 / steps,
                        "calls_per_step": e.count / steps})
    kernels.sort(key=lambda k: -k["ms_per_step"])
    return kernels, wall_ms, idle_gaps(prof, steps)


def idle_gaps(prof, steps):
    """Where the GPU sat idle: gaps between one device activity's end and the next one's start
    (all streams merged), summed per step, and the longest ones with their neighbours."""
    spans = []
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start:
            spans.append((e.time_range.start, e.time_range.end, e.name))
    spans.sort()
    gaps, busy_until, before = [], None, None
    for start, end, name in spans:
        if busy_until is not None and start - busy_until > 20:  # µs; launch jitter below that
            gaps.append({"us": start - busy_until, "after": before[:70], "before": name[:70]})
        if busy_until is None or end > busy_until:
            busy_until, before = end, name
    gaps.sort(key=lambda g: -g["us"])
    return {"idle_ms_per_step": sum(g["us"] for g in gaps) / 1000.0 / steps, "longest": gaps[:12]}


def zerotrain_step(shape, mode, seq, mbs, ckpt):
    lib = ctypes.CDLL(os.environ.get("ZT_LIB", os.path.join(ROOT, "build-gpu", "lib", "libzerotrain.so")))
    lib.zt_last_error.restype = ctypes.c_char_p
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.zt_trainer_create.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.zt_trainer_train_step.argtypes = [ctypes.c_void_p, i64p, i64p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    with open(os.path.join(ROOT, "examples", "shapes", SHAPE_FILES[shape])) as f:
        model_config = json.load(f)
    bf16 = {"enabled": True}
    if mode == "full":
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    options = {
        "model_config": model_config, "device": "cuda", "bf16": True, "max_grad_norm": 0.0,
        "per_device_train_batch_size": mbs, "gradient_checkpointing": ckpt, "learning_rate": 1e-5,
        "lr_scheduler_type": "constant", "max_steps": 1000, "logging_steps": 1000,
        "output_dir": "/tmp/zt-profile-step", "overwrite_output_dir": True,
        "deepspeed": {"bf16": bf16, "zero_optimization": {"stage": 2},
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}},
    }
    if os.environ.get("ZT_PROFILE_DEEPSPEED"):
        options["deepspeed"] = os.environ["ZT_PROFILE_DEEPSPEED"]
    if os.environ.get("ZT_BENCH_KEEP"):  # as zt_bench_model: gradient_checkpointing_keep
        options["gradient_checkpointing_keep"] = os.environ["ZT_BENCH_KEEP"]
    if os.environ.get("ZT_BENCH_OFFLOAD") == "1":
        options["use_unsloth_gc"] = True
    if mode in ("lora", "qlora"):
        options.update(finetuning_type="lora", lora_r=16, lora_alpha=32, lora_target_modules="all-linear")
        if mode == "qlora":
            options.update(quantization_bit=4)
    elif mode == "freeze":
        options.update(finetuning_type="freeze", freeze_trainable_layers=2)
    trainer = ctypes.c_void_p()
    if lib.zt_trainer_create(json.dumps(options).encode(), ctypes.byref(trainer)) != 0:
        sys.exit("zt_trainer_create: " + lib.zt_last_error().decode())
    torch.manual_seed(0)
    ids = torch.randint(0, model_config["vocab_size"], (mbs, seq), dtype=torch.int64).contiguous()
    pointer = ctypes.cast(ids.data_ptr(), i64p)

    def step(ids=ids):  # the default keeps the batch alive as long as the step function
        if lib.zt_trainer_train_step(trainer, pointer, None, mbs, seq, None) != 0:
            sys.exit("zt_trainer_train_step: " + lib.zt_last_error().decode())

    return step


def hf_step(shape, mode, seq, mbs, ckpt):
    sys.path.insert(0, HERE)
    from hf_phases import build
    cfg, model = build(shape, mode, ckpt)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (mbs, seq), device="cuda")
    model.train()

    if os.environ.get("HF_COMPILE") == "1":  # as hf_baseline.py: compiled in the warm-up steps
        model = torch.compile(model)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "full_amp"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def by_family(kernels):
    out = collections.defaultdict(float)
    for k in kernels:
        out[family(k["name"])] += k["ms_per_step"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def compare(ours_path, peer_path):
    ours, peer = (json.load(open(p)) for p in (ours_path, peer_path))
    fo, fp = by_family(ours["kernels"]), by_family(peer["kernels"])
    print(f"{'family':24} {'ours ms':>9} {'peer ms':>9} {'diff':>8}")
    for fam in sorted(set(fo) | set(fp), key=lambda f: -(fo.get(f, 0) - fp.get(f, 0))):
        print(f"{fam:24} {fo.get(fam, 0):9.2f} {fp.get(fam, 0):9.2f} {fo.get(fam, 0) - fp.get(fam, 0):+8.2f}")
    print(f"{'total':24} {sum(fo.values()):9.2f} {sum(fp.values()):9.2f} {sum(fo.values()) - sum(fp.values()):+8.2f}")
    print(f"{'wall (profiled)':24} {ours['wall_ms_per_step']:9.2f} {peer['wall_ms_per_step']:9.2f} "
          f"{ours['wall_ms_per_step'] - peer['wall_ms_per_step']:+8.2f}")
    if "idle_ms_per_step" in ours and "idle_ms_per_step" in peer:
        print(f"{'GPU idle (gaps > 20 us)':24} {ours['idle_ms_per_step']:9.2f} {peer['idle_ms_per_step']:9.2f} "
              f"{ours['idle_ms_per_step'] - peer['idle_ms_per_step']:+8.2f}")


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) < 7 or sys.argv[1] not in ("zerotrain", "hf"):
        sys.exit(__doc__)
    impl, shape, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    seq, mbs, ckpt = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
    global torch
    import torch  # here, so that `compare` runs where torch is not installed
    step = (zerotrain_step if impl == "zerotrain" else hf_step)(shape, mode, seq, mbs, ckpt)
    kernels, wall_ms, idle = profiled(step)
    total = sum(k["ms_per_step"] for k in kernels)
    print(f"{impl} {shape} {mode}: {total:.1f} ms of kernels in {wall_ms:.1f} ms per step (profiled), "
          f"GPU idle {idle['idle_ms_per_step']:.1f} ms per step in gaps over 20 us")
    for k in kernels[:40]:
        print(f"{k['ms_per_step']:8.2f} ms {k['calls_per_step']:7.1f}x  {family(k['name']):18} {k['name'][:110]}")
    print("longest idle gaps (us, after -> before):")
    for g in idle["longest"]:
        print(f"{g['us']:9.0f}  {g['after']} -> {g['before']}")
    result = {"impl": impl, "shape": shape, "mode": mode, "seq": seq, "mbs": mbs, "ckpt": int(ckpt),
              "kernel_ms_per_step": round(total, 2), "wall_ms_per_step": round(wall_ms, 2),
              "idle_ms_per_step": round(idle["idle_ms_per_step"], 2), "families": by_family(kernels),
              "kernels": kernels, "idle_gaps": idle["longest"]}
    if len(sys.argv) > 7:
        with open(sys.argv[7], "w") as f:
            json.dump(result, f)
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "kernels"}))


if __name__ == "__main__":
    main()
