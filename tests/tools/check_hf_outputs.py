#!/usr/bin/env python3
"""Reads what zerotrain wrote with the user's own tools on the GPU machine (transformers,
tokenizers, tensorboard) and reports what they make of it.

    python3 tests/tools/check_hf_outputs.py IN_DIR REAL_TOKENIZERS_DIR OUT_DIR

IN_DIR is what `zt_tests "tool: write run outputs for the transformers checks"` wrote:
models/<name>/ (exported HF folders with zerotrain's logits), run/ (trainer_state.json,
TensorBoard events under run/tb), chat/<package>_<template>.json (ids and labels zerotrain made
for chat/conversations.jsonl with a real tokenizer). OUT_DIR/report.json gets, per item, the
differences found; OUT_DIR/training_arguments.json the fields of this transformers'
TrainingArguments and TrainerState (names, types, defaults).
"""
import dataclasses
import json
import os
import sys

import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerState, TrainingArguments

IN, REAL, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(OUT, exist_ok=True)
report = {"versions": {"transformers": transformers.__version__, "torch": torch.__version__}}

# Exported models: transformers loads them, and gives zerotrain's logits.
models = {}
for name in sorted(os.listdir(os.path.join(IN, "models"))):
    d = os.path.join(IN, "models", name)
    try:
        config = AutoConfig.from_pretrained(d)
        # Gemma 3 as published: the multimodal class, its vision tower compared with the base's.
        cls = AutoModelForCausalLM
        if config.model_type == "gemma3":
            cls = transformers.Gemma3ForConditionalGeneration
        model = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        ours = load_file(os.path.join(d, "zerotrain_logits.safetensors"))
        with torch.no_grad():
            logits = model(input_ids=ours["input_ids"]).logits
        models[name] = {"max_abs_diff": (logits - ours["logits"]).abs().max().item(),
                        "rope_parameters": getattr(config, "rope_parameters", None),
                        "dtype": str(getattr(config, "dtype", None))}
        if config.model_type == "gemma3":
            base = cls.from_pretrained("tests/fixtures/models/gemma3", dtype=torch.float32).state_dict()
            tower = {k: v for k, v in model.state_dict().items()
                     if "vision_tower" in k or "multi_modal_projector" in k}
            models[name]["vision_tensors"] = len(tower)
            models[name]["vision_max_abs_diff"] = max(
                (v - base[k]).abs().max().item() for k, v in tower.items())
    except Exception as e:  # noqa: BLE001 - the report says what failed
        models[name] = {"error": f"{type(e).__name__}: {e}"}
    print("model", name, models[name], flush=True)
report["models"] = models

# trainer_state.json through HF's own reader.
try:
    state = TrainerState.load_from_json(os.path.join(IN, "run", "trainer_state.json"))
    report["trainer_state"] = {"global_step": state.global_step, "epoch": state.epoch,
                               "log_history_entries": len(state.log_history),
                               "best_metric": state.best_metric}
except Exception as e:  # noqa: BLE001
    report["trainer_state"] = {"error": f"{type(e).__name__}: {e}"}
print("trainer_state", report["trainer_state"], flush=True)

# TensorBoard reads the events.
try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(os.path.join(IN, "run", "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    report["tensorboard"] = {"scalars": {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags}}
except Exception as e:  # noqa: BLE001
    report["tensorboard"] = {"error": f"{type(e).__name__}: {e}"}
print("tensorboard", report["tensorboard"], flush=True)

# Chat formats: zerotrain's ids against apply_chat_template with the model's own tokenizer and
# (for the formats checked with a tokenizer that has no template of its own) the reference text.
# The tool writes them only with ZT_REAL_TOKENIZERS set; without, the chat check is skipped.
have_chat = os.path.exists(os.path.join(IN, "chat", "conversations.jsonl"))
if not have_chat:
    print("chat: not checked (the outputs were written without ZT_REAL_TOKENIZERS)", flush=True)
conversations = ([json.loads(l)["messages"] for l in open(os.path.join(IN, "chat", "conversations.jsonl"))]
                 if have_chat else [])
refs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data", "chat_templates")
chat = {}
for f in sorted(os.listdir(os.path.join(IN, "chat"))) if have_chat else []:
    if not f.endswith(".json"):
        continue
    job = json.load(open(os.path.join(IN, "chat", f)))
    tok = AutoTokenizer.from_pretrained(os.path.join(REAL, job["package"]))
    template = None if job["asked"] == "auto" else open(os.path.join(refs, job["template"] + ".jinja")).read()
    if template is None and not getattr(tok, "chat_template", None):
        # The folder has no template of its own: zerotrain's `auto` picked a named format, which
        # is checked by its reference text where there is one.
        ref = os.path.join(refs, job["template"] + ".jinja")
        if not os.path.exists(ref):
            chat[f] = {"template": job["template"], "skipped": "no chat template in the folder"}
            print("chat", f, chat[f], flush=True)
            continue
        template = open(ref).read()
    results = []
    for messages, ex in zip(conversations, job["examples"]):
        hf = tok.apply_chat_template(messages, tokenize=True, chat_template=template)
        hf = hf["input_ids"] if isinstance(hf, dict) or hasattr(hf, "keys") else hf
        trained = tok.decode([l for l in ex["labels"] if l != -100])
        first = next((i for i, (a, b) in enumerate(zip(hf, ex["ids"])) if a != b), None)
        result = {"same_ids": list(hf) == ex["ids"], "hf_len": len(hf), "ours_len": len(ex["ids"]),
                  "first_difference": first, "trained_text": trained}
        if list(hf) != ex["ids"]:
            # Where they part: the tokens on both sides, the text, and what the tokenizer.json
            # pipeline alone (tokenizers, without transformers' own handling) makes of it.
            at = first if first is not None else min(len(hf), len(ex["ids"]))
            text = tok.apply_chat_template(messages, tokenize=False, chat_template=template)
            raw = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
            # The file itself through tokenizers: transformers 5 replaces some files' pipelines
            # (a byte-level tokenizer.json labelled LlamaTokenizerFast gets Metaspace, which drops
            # every space: DeepSeek-V3, transformers issue #45488), zerotrain follows the file.
            import tokenizers
            file = tokenizers.Tokenizer.from_file(os.path.join(REAL, job["package"], "tokenizer.json"))
            result["tokenizer_json_same_as_ours"] = (
                file.encode(text, add_special_tokens=False).ids == ex["ids"])
            result.update({"hf_tokens": tok.convert_ids_to_tokens(list(hf)[max(0, at - 3):at + 6]),
                           "ours_tokens": tok.convert_ids_to_tokens(ex["ids"][max(0, at - 3):at + 6]),
                           "text_start": text[:120], "tokenizers_alone_same_as_hf": raw == list(hf),
                           "tokenizers_alone_same_as_ours": raw == ex["ids"]})
        results.append(result)
    gen = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=True,
                                  add_generation_prompt=True, chat_template=template)
    gen = gen["input_ids"] if hasattr(gen, "keys") else gen
    chat[f] = {"template": job["template"], "examples": results, "prompt_same_ids": list(gen) == job["prompt_ids"]}
    if not all(r["same_ids"] for r in results):
        backend = json.loads(tok.backend_tokenizer.to_str())
        chat[f]["tokenizer"] = {"class": type(tok).__name__, "normalizer": backend.get("normalizer"),
                                "pre_tokenizer": backend.get("pre_tokenizer"),
                                "legacy": getattr(tok, "legacy", None),
                                "add_prefix_space": getattr(tok, "add_prefix_space", None)}
    print("chat", f, chat[f], flush=True)
report["chat"] = chat

# The llama2 fixture tokenizer with legacy true (tokenizer_config.json): transformers 5's ids for
# the fixture texts, for tests/test_tokenizer.cpp (tests/fixtures/tokenizers/llama2/cases_legacy_true.json).
import shutil
import tempfile
fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "tokenizers", "llama2")
with tempfile.TemporaryDirectory() as tmp:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(fixture, name), tmp)
    config = json.load(open(os.path.join(tmp, "tokenizer_config.json")))
    config["legacy"] = True
    json.dump(config, open(os.path.join(tmp, "tokenizer_config.json"), "w"))
    legacy = AutoTokenizer.from_pretrained(tmp)
    cases = [{"text": c["text"], "transformers_ids": legacy(c["text"])["input_ids"]}
             for c in json.load(open(os.path.join(fixture, "cases.json")))]
with open(os.path.join(OUT, "cases_legacy_true.json"), "w") as f:
    json.dump(cases, f, indent=1, ensure_ascii=False)
    f.write("\n")
report["llama2_legacy_true"] = {"class": type(legacy).__name__,
                                "pre_tokenizer": json.loads(legacy.backend_tokenizer.to_str()).get("pre_tokenizer"),
                                "cases": len(cases)}
print("llama2_legacy_true", report["llama2_legacy_true"], flush=True)


def described(field):
    default = field.default if field.default is not dataclasses.MISSING else (
        field.default_factory() if field.default_factory is not dataclasses.MISSING else None)
    try:
        json.dumps(default)
    except TypeError:
        default = str(default)
    return {"name": field.name, "type": str(field.type), "default": default,
            "help": field.metadata.get("help", "") if field.metadata else ""}


with open(os.path.join(OUT, "training_arguments.json"), "w") as f:
    json.dump({"transformers": transformers.__version__,
               "TrainingArguments": [described(x) for x in dataclasses.fields(TrainingArguments) if x.init],
               "TrainerState": [x.name for x in dataclasses.fields(TrainerState)]}, f, indent=1)
with open(os.path.join(OUT, "report.json"), "w") as f:
    json.dump(report, f, indent=1, default=str)
