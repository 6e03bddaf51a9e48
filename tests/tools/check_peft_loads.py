#!/usr/bin/env python3
"""Loads adapters zerotrain wrote into HF PEFT and records the logits PEFT gives with them.

    python3 tests/tools/check_peft_loads.py ADAPTERS_DIR OUT_DIR

ADAPTERS_DIR holds one folder per adapter, as `zt_tests "tool: write zerotrain adapters for the
PEFT check"` writes them (adapter_config.json, adapter_model.safetensors and the logits zerotrain
computed, zerotrain_logits.safetensors). The base model is the tiny llama fixture. For each
adapter, OUT_DIR/<name>/ receives the adapter files plus peft_logits.safetensors (the inputs
and PEFT's logits), and report.json lists the largest difference from zerotrain's logits on real
tokens. Runs in fp32 on the CPU, with eager attention, like make_fixtures.py.
"""
import json
import os
import shutil
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

SRC, OUT = sys.argv[1], sys.argv[2]
BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "models", "llama")
torch.set_num_threads(4)

report = {}
for name in sorted(os.listdir(SRC)):
    src = os.path.join(SRC, name)
    base = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32,
                                                attn_implementation="eager")
    model = PeftModel.from_pretrained(base, src).eval()
    ours = load_file(os.path.join(src, "zerotrain_logits.safetensors"))
    ids, mask = ours["input_ids"], ours["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.contiguous()
    extra = logits.shape[1] - ids.shape[1]
    real = torch.cat([torch.ones(ids.shape[0], extra, dtype=mask.dtype), mask], 1).bool()
    diff = (logits[real] - ours["logits"][real]).abs().max().item() \
        if logits.shape == ours["logits"].shape else float("inf")
    dst = os.path.join(OUT, name)
    os.makedirs(dst, exist_ok=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(os.path.join(src, f), dst)
    save_file({"input_ids": ids, "attention_mask": mask, "logits": logits},
              os.path.join(dst, "peft_logits.safetensors"))
    report[name] = {"max_abs_diff_vs_zerotrain": diff, "logits_shape": list(logits.shape)}
    print(name, report[name], flush=True)

import peft
import transformers
report["versions"] = {"peft": peft.__version__, "transformers": transformers.__version__,
                      "torch": torch.__version__}
with open(os.path.join(OUT, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
    f.write("\n")
