#!/usr/bin/env python3
"""The ChatGLM reference: a tiny random ChatGLM3-6B-shaped model run by THUDM's own remote code
(modeling_chatglm.py from a public copy, e.g. liucongg/ChatGLM-Finetuning's glm3/ — a test tool,
not committed), on the GPU machine with transformers 5.x. Writes OUT/models/chatglm/:

  config.json, model.safetensors   the remote model's own config and state dict (ChatGLM names)
  expected.safetensors             logits, per-layer hidden states ([batch, seq, hidden]), the
                                   mean loss and gradients, in fp32 on the CPU; plus, for P-Tuning
                                   v2 (pre_seq_len 4, prefix_projection), the prefix encoder's
                                   weights as `prefix.<name>` and its loss as `prefix_loss`
  tokenizer.model, tokenizer_config.json   the tiny SentencePiece model given as TOKENIZER

    python3 tests/tools/make_chatglm_fixture.py REMOTE_DIR TOKENIZER OUT

REMOTE_DIR holds configuration_chatglm.py and modeling_chatglm.py. If the remote code no longer
runs with this transformers, the failure is printed and the script exits 3 (the caller then
compares through transformers' own chatglm -> glm mapping instead).
"""
import importlib.util
import json
import os
import shutil
import sys
import traceback

import torch

REMOTE, TOKENIZER, OUT = (sys.argv[1:4] + [None] * 3)[:3]  # imported by check_peft_loads.py
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.set_num_threads(4)


def load_remote():
    pkg = "chatglm_remote"
    sys.path.insert(0, os.path.dirname(os.path.abspath(REMOTE)))
    spec = importlib.util.spec_from_file_location(
        pkg, os.path.join(REMOTE, "__init__.py"), submodule_search_locations=[REMOTE])
    if not os.path.exists(os.path.join(REMOTE, "__init__.py")):
        open(os.path.join(REMOTE, "__init__.py"), "w").close()
    module = importlib.util.module_from_spec(spec)
    sys.modules[pkg] = module
    spec.loader.exec_module(module)
    import importlib as il
    return il.import_module(pkg + ".configuration_chatglm"), il.import_module(pkg + ".modeling_chatglm")


CONFIG = dict(num_layers=2, padded_vocab_size=416, hidden_size=64, ffn_hidden_size=80,
              kv_channels=16, num_attention_heads=4, seq_length=128, hidden_dropout=0.0,
              attention_dropout=0.0, layernorm_epsilon=1e-5, rmsnorm=True,
              apply_residual_connection_post_layernorm=False, post_layer_norm=True,
              add_bias_linear=False, add_qkv_bias=True, bias_dropout_fusion=True,
              multi_query_attention=True, multi_query_group_num=2,
              apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True,
              fp32_residual_connection=False, quantization_bit=0, original_rope=True,
              eos_token_id=2, pad_token_id=0, torch_dtype="float32")


def randomize(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.copy_(0.02 * torch.randn_like(p))


# Config members the 2023 remote code reads that transformers 5 no longer defines; given their
# 4.x values (the code itself is run unchanged).
SHIMS = {"max_length": CONFIG["seq_length"], "use_cache": False, "output_hidden_states": False,
         "use_return_dict": True, "return_dict": True, "output_attentions": False}


def build(cfg_mod, model_mod, conf):
    config = cfg_mod.ChatGLMConfig(**conf)
    for _ in range(len(SHIMS) + 1):
        try:
            return config, model_mod.ChatGLMForConditionalGeneration(config, empty_init=False).float()
        except AttributeError as e:
            missing = [k for k in SHIMS if f"'{k}'" in str(e)]
            if not missing:
                raise
            print("shim: config." + missing[0])
            object.__setattr__(config, missing[0], SHIMS[missing[0]])
    raise RuntimeError("could not build the remote model")


def run(model, **kwargs):
    for _ in range(len(SHIMS) + 1):
        try:
            return model(**kwargs)
        except AttributeError as e:
            missing = [k for k in SHIMS if f"'{k}'" in str(e)]
            if not missing:
                raise
            print("shim: config." + missing[0])
            object.__setattr__(model.config, missing[0], SHIMS[missing[0]])
    raise RuntimeError("could not run the remote model")


def main():
    try:
        cfg_mod, model_mod = load_remote()
        config, model = build(cfg_mod, model_mod, CONFIG)
    except Exception:
        traceback.print_exc()
        print("the remote ChatGLM code does not run with this transformers")
        sys.exit(3)
    from safetensors.torch import save_file
    d = os.path.join(OUT, "models", "chatglm")
    os.makedirs(d, exist_ok=True)
    randomize(model)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    conf = config.to_dict()
    conf.update({"model_type": "chatglm", "architectures": ["ChatGLMModel"],
                 "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                              "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
                              "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"}})
    conf = {k: v for k, v in conf.items() if not k.startswith("_")}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(conf, f, indent=1, default=str)
        f.write("\n")
    shutil.copy(TOKENIZER, os.path.join(d, "tokenizer.model"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "ChatGLMTokenizer", "remove_space": False,
                   "do_lower_case": False, "padding_side": "left",
                   "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLMTokenizer", None]}}, f, indent=1)
        f.write("\n")

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 400, (2, 16), generator=g)
    mask = torch.ones_like(ids)  # ChatGLM-Finetuning's collator passes no mask; no padding here
    labels = ids.clone()
    labels[0, :3] = -100
    model.train()  # dropout is 0; gradients are wanted
    out = run(model, input_ids=ids, labels=labels, output_hidden_states=True, use_cache=False,
              return_dict=True)
    out.loss.backward()
    expected = {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "logits": out.logits.detach().float(), "loss": out.loss.detach().reshape(1)}
    for i, h in enumerate(out.hidden_states[:-1] if len(out.hidden_states) > CONFIG["num_layers"] else out.hidden_states):
        expected[f"hidden_states.{i}"] = h.detach().transpose(0, 1).contiguous()  # [s,b,h] -> [b,s,h]
    for pname, p in model.named_parameters():
        if any(k in pname for k in ("word_embeddings", "layers.0.self_attention.query_key_value",
                                     "layers.1.mlp.dense_4h_to_h", "layers.0.mlp.dense_h_to_4h",
                                     "final_layernorm", "output_layer", "layers.1.self_attention.dense")):
            expected["grad." + pname] = p.grad.detach().clone()
    print("chatglm loss", float(out.loss), "hidden states", len(out.hidden_states))

    # P-Tuning v2 the ChatGLM way: the same weights plus a prefix encoder, in eval mode (no
    # prefix dropout), loss only.
    pconf, pmodel = build(cfg_mod, model_mod, dict(CONFIG, pre_seq_len=4, prefix_projection=True))
    missing = pmodel.load_state_dict(state, strict=False)
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in pmodel.transformer.prefix_encoder.named_parameters():
            p.copy_(0.5 * torch.randn_like(p))
            expected["prefix." + name] = p.detach().clone()
    pmodel.eval()
    with torch.no_grad():
        pout = run(pmodel, input_ids=ids, labels=labels, use_cache=False, return_dict=True)
    expected["prefix_loss"] = pout.loss.detach().reshape(1)
    print("chatglm prefix loss", float(pout.loss), "missing", missing.missing_keys)
    save_file({k: v.contiguous() for k, v in expected.items()}, os.path.join(d, "expected.safetensors"))


if __name__ == "__main__":
    main()
