#!/usr/bin/env python3
"""Loads the HF folder zt_model_dump wrote with transformers (bf16, SDPA, GPU), runs the same
inputs, and compares every layer's hidden state with zerotrain's. Prints one RESULT line.

    python3 tests/tools/compare_hidden_states.py DIR [TOLERANCE]

The relative error of a layer is ||zt - hf|| / ||hf|| over all positions. bf16 differences
(kernel choice, accumulation order) put it near 1e-2; a wrong RoPE, mask or bias would be ~1.
"""
import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

path = sys.argv[1]
tol = float(sys.argv[2]) if len(sys.argv) > 2 else 3e-2
zt = load_file(f"{path}/zt_hidden.safetensors")
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
model.eval()
with torch.no_grad():
    out = model(input_ids=zt["input_ids"].cuda(), output_hidden_states=True)
errors = []
n = len(out.hidden_states)
for i in range(n - 1):  # HF's last entry is after the final norm; zt's is before it
    a = zt[f"hidden_states.{i}"].float().cuda()
    b = out.hidden_states[i].float()
    errors.append(float((a - b).norm() / b.norm()))
result = {"tool": "compare_hidden_states", "layers": len(errors), "max_rel_error": max(errors),
          "per_layer": [round(e, 5) for e in errors], "tolerance": tol, "ok": max(errors) < tol}
print("RESULT " + json.dumps(result), flush=True)
sys.exit(0 if result["ok"] else 1)
