#!/usr/bin/env python3
"""Loads adapters zerotrain wrote into HF PEFT and records the logits PEFT gives with them.

    cd REPO_ROOT && python3 tests/tools/check_peft_loads.py ADAPTERS_DIR OUT_DIR

ADAPTERS_DIR holds one folder per adapter, as `zt_tests "tool: write zerotrain adapters for the
PEFT check"` writes them (adapter_config.json, adapter_model.safetensors and the logits zerotrain
computed, zerotrain_logits.safetensors). Each adapter names its base as a path relative to the
repository root (tests/fixtures/models/...), which PEFT resolves from the current directory;
a null base is the tiny llama fixture. For each adapter, OUT_DIR/<name>/ receives the adapter
files plus peft_logits.safetensors (the inputs and PEFT's logits), and report.json lists the
largest difference from zerotrain's logits on real tokens and whether PEFT, saving what it
loaded, writes the same tensors under the same keys. It also saves PEFT's own adapter for
`target_modules="all-linear"` on the tiny llama (2 and 3 layers) and records which names PEFT
wrote, beside the names zerotrain wrote for the same default, and writes OUT_DIR/peft_made/: LoRA
adapters PEFT makes with trainable biases (bias "all" and "lora_only") on the qwen2 fixture, with
PEFT's logits, for zerotrain's tests. Runs in fp32 on the CPU, with eager attention, like
make_fixtures.py.
"""
import json
import os
import shutil
import sys
import tempfile

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

SRC, OUT = sys.argv[1], sys.argv[2]
LLAMA = "tests/fixtures/models/llama"
torch.set_num_threads(4)


def load_base(path):
    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type == "chatglm":
        return load_chatglm(path)
    if model_type == "gemma3":  # Gemma 3 as published: the multimodal class, tower and all
        from transformers import Gemma3ForConditionalGeneration
        return Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def load_chatglm(path):
    """A ChatGLM fixture in THUDM's remote code (ZT_CHATGLM_REMOTE: a folder with its
    configuration_chatglm.py and modeling_chatglm.py, as make_chatglm_fixture.py uses)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
    import make_chatglm_fixture as fixture  # noqa: E402 - its loader and transformers-5 shims
    fixture.REMOTE = os.environ["ZT_CHATGLM_REMOTE"]
    cfg_mod, model_mod = fixture.load_remote()
    with open(os.path.join(path, "config.json")) as f:
        conf = {k: v for k, v in json.load(f).items() if k in fixture.CONFIG}
    _, model = fixture.build(cfg_mod, model_mod, conf)
    model.load_state_dict(load_file(os.path.join(path, "model.safetensors")))
    model.forward_kwargs = {"use_cache": False, "return_dict": True}
    return model.eval()


report = {}
for name in sorted(os.listdir(SRC)):
    src = os.path.join(SRC, name)
    with open(os.path.join(src, "adapter_config.json")) as f:
        config = json.load(f)
    try:
        base = load_base(config.get("base_model_name_or_path") or LLAMA)
    except KeyError as e:  # a ChatGLM base without its remote code: said, and the others go on
        report[name] = {"skipped": f"the base needs {e} (its remote code)"}
        print(name, report[name], flush=True)
        continue
    try:
        model = PeftModel.from_pretrained(base, src).eval()
    except Exception as e:  # noqa: BLE001 - the report says what PEFT refused
        report[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, report[name], flush=True)
        continue
    ours = load_file(os.path.join(src, "zerotrain_logits.safetensors"))
    ids, mask = ours["input_ids"], ours["attention_mask"]
    with torch.no_grad():
        kwargs = getattr(base, "forward_kwargs", None)
        # ChatGLM's code reads a padding mask its own way (left padding): its rows are all real.
        logits = (model(input_ids=ids, **kwargs) if kwargs else
                  model(input_ids=ids, attention_mask=mask)).logits.contiguous()
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
    # PEFT saving what it loaded must write zerotrain's file again: the same keys and values.
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        theirs = load_file(os.path.join(tmp, "adapter_model.safetensors"))
    written = load_file(os.path.join(src, "adapter_model.safetensors"))
    resaved_same = sorted(theirs) == sorted(written) and all(torch.equal(theirs[k], written[k]) for k in theirs)
    report[name] = {"max_abs_diff_vs_zerotrain": diff, "logits_shape": list(logits.shape),
                    "peft_resaves_same_tensors": resaved_same,
                    "keys_only_peft_writes": sorted(set(theirs) - set(written)),
                    "keys_only_zerotrain_writes": sorted(set(written) - set(theirs)),
                    "target_modules_read": sorted(model.peft_config["default"].target_modules)
                    if hasattr(model.peft_config["default"], "target_modules")
                    and model.peft_config["default"].target_modules is not None
                    and not isinstance(model.peft_config["default"].target_modules, str)
                    else model.peft_config["default"].__dict__.get("target_modules")}
    print(name, report[name], flush=True)

# What PEFT itself writes for all-linear: on the tiny llama (14 projections, under PEFT's 20)
# and on the same model with 3 layers (21, which PEFT condenses to suffixes).
def peft_all_linear(layers):
    base = load_base(LLAMA)
    if layers != base.config.num_hidden_layers:
        config = base.config
        config.num_hidden_layers = layers
        base = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    peft_model = get_peft_model(base, LoraConfig(target_modules="all-linear", task_type="CAUSAL_LM"))
    with tempfile.TemporaryDirectory() as tmp:
        peft_model.save_pretrained(tmp)
        with open(os.path.join(tmp, "adapter_config.json")) as f:
            written = json.load(f)["target_modules"]
    return sorted(written) if isinstance(written, list) else written


ours_path = os.path.join(SRC, "lora_all_linear", "adapter_config.json")
ours_written = json.load(open(ours_path))["target_modules"] if os.path.exists(ours_path) else None
peft_written = peft_all_linear(2)
report["all_linear"] = {"peft_writes": peft_written, "zerotrain_writes": ours_written,
                        "same_set": isinstance(peft_written, list) and isinstance(ours_written, list)
                        and set(peft_written) == set(ours_written),
                        "peft_writes_for_3_layers": peft_all_linear(3)}
print("all_linear", report["all_linear"], flush=True)

# Adapters PEFT itself makes with trainable biases on the qwen2 fixture (q/k/v biases):
# q_proj and v_proj wrapped (PEFT keys their bias base_layer.bias), k_proj not (its plain .bias,
# with bias "all"). Values nudged so each one matters; OUT_DIR/peft_made/<name> gets the adapter
# and the logits PEFT computes with it, for zerotrain's tests to load.
QWEN2 = "tests/fixtures/models/qwen2"
for made, bias in (("lora_bias_all", "all"), ("lora_bias_lora_only", "lora_only")):
    torch.manual_seed(7)
    peft_model = get_peft_model(load_base(QWEN2), LoraConfig(target_modules=["q_proj", "v_proj"], bias=bias,
                                                             r=4, lora_alpha=8, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p), alpha=0.05)
    peft_model.eval()
    dst = os.path.join(OUT, "peft_made", made)
    os.makedirs(dst, exist_ok=True)
    peft_model.save_pretrained(dst)
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 0, 0], [4, 8, 15, 16, 23, 42, 99, 3]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        logits = peft_model(input_ids=ids, attention_mask=mask).logits.contiguous()
    save_file({"input_ids": ids, "attention_mask": mask, "logits": logits},
              os.path.join(dst, "peft_logits.safetensors"))
    report["peft_made_" + made] = {"keys": sorted(load_file(os.path.join(dst, "adapter_model.safetensors")))}
    print("peft_made", made, report["peft_made_" + made], flush=True)

import peft
import transformers
report["versions"] = {"peft": peft.__version__, "transformers": transformers.__version__,
                      "torch": torch.__version__}
with open(os.path.join(OUT, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
    f.write("\n")
