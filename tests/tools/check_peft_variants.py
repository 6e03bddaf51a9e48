#!/usr/bin/env python3
"""QLoRA, DoRA and PiSSA adapters zerotrain trained, loaded in HF PEFT: the logits PEFT gives
with each equal those of the model `zerotrain merge` writes from it (loaded in transformers).

    cd REPO_ROOT && python3 tests/tools/check_peft_variants.py ZEROTRAIN_BIN WORK_DIR [DEVICE]

Runs on the GPU machine (transformers + PEFT 0.21), on the tiny llama fixture, fp32:
  qlora   LoRA over a bitsandbytes NF4 folder (double quantization) that tests/tools/
          bnb_reference.py writes; PEFT's base is that folder's dequantized values (the
          reference's expected.safetensors), as PEFT's merge_and_unload sees a dequantized base.
  qdora   DoRA over the same 4-bit folder.
  dora    DoRA over the fp32 base.
  pissa   PiSSA (full SVD) over the fp32 base: PEFT re-decomposes the base when it loads the
          adapter (init_lora_weights "pissa"); and pissa_converted/, plain LoRA over the base.
Prints one JSON line per case and a summary; exit status 1 when a case misses its bound.
"""
import json
import os
import subprocess
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ZT, WORK = sys.argv[1], sys.argv[2]
DEVICE = sys.argv[3] if len(sys.argv) > 3 else "cpu"
LLAMA = "tests/fixtures/models/llama"
BOUND = {"qlora": 2e-5, "qdora": 2e-5, "dora": 2e-5, "pissa": 1e-4, "pissa_converted": 1e-4}


def run(*cmd):
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def main():
    os.makedirs(WORK, exist_ok=True)
    bnb = os.path.join(WORK, "bnb")
    run(sys.executable, "tests/tools/bnb_reference.py", "folder", LLAMA, bnb, "nf4", "double")
    data = os.path.join(WORK, "ids.jsonl")
    with open(data, "w") as f:
        for r in range(24):
            f.write(json.dumps({"input_ids": [(r * 7 + t * 5) % 120 + 3 for t in range(12)]}) + "\n")
    common = ["--train_file", data, "--finetuning_type", "lora", "--lora_r", "4",
              "--max_steps", "6", "--learning_rate", "1e-2", "--logging_steps", "1",
              "--save_steps", "100", "--device", DEVICE,
              "--deepspeed", '{"zero_optimization": {"stage": 3}}']
    cases = {
        "qlora": (bnb, []),
        "qdora": (bnb, ["--use_dora", "true"]),
        "dora": (LLAMA, ["--use_dora", "true"]),
        "pissa": (LLAMA, ["--pissa_init", "true", "--pissa_iter", "-1", "--pissa_convert", "true"]),
    }
    dequantized = load_file(os.path.join(bnb, "expected.safetensors"))
    ids = torch.randint(3, 120, (2, 16), generator=torch.Generator().manual_seed(7))
    failed = []
    for name, (base_dir, extra) in cases.items():
        out, merged = os.path.join(WORK, name), os.path.join(WORK, name + "_merged")
        run(ZT, "train", "--model_name_or_path", base_dir, "--output_dir", out, *common, *extra)
        run(ZT, "merge", out, merged, "--dtype", "fp32", "--base_model", base_dir)
        want = logits(load(merged), ids)
        checks = {name: out}
        if name == "pissa":
            checks["pissa_converted"] = os.path.join(out, "pissa_converted")
        for check, adapter in checks.items():
            base = load(LLAMA)
            if base_dir == bnb:  # PEFT over the 4-bit base's dequantized values
                state = base.state_dict()
                with torch.no_grad():
                    for key, value in dequantized.items():
                        state[key].copy_(value.reshape(state[key].shape))
            model = PeftModel.from_pretrained(base, adapter).eval()
            got = logits(model, ids)
            diff = float((got - want).abs().max())
            line = {"case": check, "max_abs_logits": diff, "bound": BOUND[check],
                    "peft_type": model.peft_config["default"].peft_type.value,
                    "use_dora": bool(model.peft_config["default"].use_dora),
                    "init_lora_weights": str(model.peft_config["default"].init_lora_weights),
                    "r": model.peft_config["default"].r}
            print(json.dumps(line), flush=True)
            if not diff < BOUND[check]:
                failed.append(check)
    print(json.dumps({"summary": "peft variants", "failed": failed}))
    sys.exit(1 if failed else 0)


main()
