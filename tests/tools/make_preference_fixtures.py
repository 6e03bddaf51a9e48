#!/usr/bin/env python3
"""Reference fixtures for preference training (DPO family, ORPO, SimPO), made on the GPU machine
with transformers, PEFT and safetensors, committed under tests/fixtures/preference/ and checked
by tests/test_preference.cpp in CI.

    python3 tests/tools/make_preference_fixtures.py OUT_DIR [--logits]

For each committed tiny model tests/fixtures/models/{llama,qwen2,glm}, with a PEFT LoRA adapter
(r 4, alpha 8, all linear layers, lora_B moved off zero so that it matters) and a batch of 3
pairs (rows: chosen 0..2 then rejected 0..2, each prompt + completion, right-padded with id 0,
labels -100 on prompt and padding), writes OUT_DIR/preference/<family>/:
  adapter/               the adapter as PEFT's save_pretrained writes it
  expected.safetensors   input_ids, attention_mask, labels (int64); policy_logps, ref_logps [6]
                         (summed completion log-probs; the reference is the same model under
                         disable_adapter()); completion_tokens [6]; and per loss case k:
                         loss.<k> [1], metrics.<k> [6] (rewards chosen, rewards rejected,
                         accuracy, margin, logps chosen, logps rejected, means over the pairs)
                         and grad.<k>.<parameter> for every trainable LoRA parameter
  cases.json             each case's options (pref_loss, beta, label_smoothing, simpo_gamma,
                         pref_ftx, reference), and under "kto_cases" the KTO cases' (pref_loss,
                         beta, desirable_weight, undesirable_weight, pref_ftx)
  kto.safetensors        KTO (unpaired examples): input_ids, labels of 4 sequences (prompt +
                         completion) and of their KL sequences (prompt i + completion i - 1, the
                         first taking the last's), desirable [4]; policy_logps, ref_logps,
                         kl_policy_logps, kl_ref_logps [4]; kl (z0); and per KTO case k: loss.<k>,
                         metrics.<k> [5] (rewards chosen, logps chosen, rewards rejected, logps
                         rejected, margin) and grad.<k>.<parameter>. The batch is drawn until its
                         KL estimate is positive, so that z0 matters.
and OUT_DIR/preference/VERSIONS.json. With --logits, only logits.safetensors per family
(make_logits below: TRL's logits/chosen and logits/rejected), from the committed fixtures.
The loss and metric formulas are those that
docs/preference_reference.md restates from TRL and LLaMA-Factory; they are written here from
those formulas, not copied from either project's code. Everything is fp32 on the CPU, with
deterministic algorithms, so the numbers are reproducible.
"""
import importlib
import json
import os
import sys

import torch
import torch.nn.functional as F

OUT = sys.argv[1]
MODELS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                       "fixtures", "models"))
FAMILIES = ("llama", "qwen2", "glm")
torch.use_deterministic_algorithms(True)
torch.set_num_threads(4)

# name, pref_loss, beta, label_smoothing, simpo_gamma, pref_ftx
CASES = [dict(name=n, pref_loss=l, beta=b, label_smoothing=e, simpo_gamma=g, pref_ftx=f,
              reference=l not in ("orpo", "simpo"))
         for n, l, b, e, g, f in [("sigmoid", "sigmoid", 0.1, 0.0, 0.5, 0.0),
                                  ("sigmoid_smooth", "sigmoid", 0.1, 0.1, 0.5, 0.0),
                                  ("sigmoid_beta", "sigmoid", 0.5, 0.0, 0.5, 0.3),
                                  ("ipo", "ipo", 0.1, 0.0, 0.5, 0.0),
                                  ("hinge", "hinge", 0.1, 0.0, 0.5, 0.0),
                                  ("robust", "robust", 0.1, 0.1, 0.5, 0.0),
                                  ("orpo", "orpo", 0.1, 0.0, 0.5, 0.0),
                                  ("simpo", "simpo", 2.0, 0.0, 0.5, 0.0)]]
# KTO: name, pref_loss, beta, desirable_weight, undesirable_weight, pref_ftx
KTO_CASES = [dict(name=n, pref_loss=l, beta=b, desirable_weight=wd, undesirable_weight=wu,
                  pref_ftx=f)
             for n, l, b, wd, wu, f in [("kto", "kto", 0.1, 1.0, 1.0, 0.0),
                                        ("kto_weighted", "kto", 0.5, 1.33, 0.7, 0.2),
                                        ("apo_zero", "apo_zero_unpaired", 0.1, 1.0, 1.0, 0.0)]]
KTO_DESIRABLE = [True, False, True, True]


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.write("\n")


def our_name(peft_name):
    """base_model.model.X.lora_A.default.weight -> X.lora_A.weight (zerotrain's names)."""
    n = peft_name.replace("base_model.model.", "", 1).replace(".default", "")
    n = n.replace(".base_layer.", ".")
    if n.endswith(".lora_magnitude_vector.weight"):  # PEFT's DoraLinearLayer.weight
        n = n[:-len(".weight")]
    return n


def pad_rows(rows):
    """(prompt, answer) rows right-padded with id 0: ids, attention mask, labels (-100 on the
    prompt and the padding)."""
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)  # pad id 0
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    labels = torch.full((len(rows), width), -100, dtype=torch.int64)
    for i, (p, a) in enumerate(rows):
        n = len(p) + len(a)
        ids[i, :n] = torch.cat([p, a])
        mask[i, :n] = 1
        labels[i, len(p):n] = a
    return ids, mask, labels


def make_batch():
    """Rows [chosen_0, chosen_1, chosen_2, rejected_0, rejected_1, rejected_2], right-padded."""
    g = torch.Generator().manual_seed(4321)
    draw = lambda n: torch.randint(3, 128, (n,), generator=g, dtype=torch.int64)  # noqa: E731
    prompts = [draw(n) for n in (4, 6, 3)]
    chosen = [draw(n) for n in (5, 3, 7)]
    rejected = [draw(n) for n in (6, 4, 2)]
    return pad_rows(list(zip(prompts, chosen)) + list(zip(prompts, rejected)))


def row_logps(model, ids, mask, labels):
    """TRL's definition: logits[:, :-1] score labels[:, 1:]; sum over labels != -100."""
    logits = model(input_ids=ids, attention_mask=mask).logits.to(torch.float32)
    target = labels[:, 1:]
    scored = target != -100
    logprobs = torch.log_softmax(logits[:, :-1, :], dim=-1)
    picked = torch.gather(logprobs, 2, target.clamp_min(0).unsqueeze(2)).squeeze(2)
    logp = torch.where(scored, picked, torch.zeros_like(picked)).sum(dim=1)
    return logp, scored.sum(dim=1).to(torch.int64)


def pair_losses(case, pol, ref, counts):
    """Per-pair losses [3] and the six metrics [6] (means over the pairs, detached)."""
    b = pol.shape[0] // 2
    beta, eps, kind = case["beta"], case["label_smoothing"], case["pref_loss"]
    n_c, n_r = counts[:b].to(torch.float32), counts[b:].to(torch.float32)
    lp_c, lp_r = pol[:b], pol[b:]
    a_c, a_r = lp_c / n_c, lp_r / n_r
    if case["reference"]:
        rho_c, rho_r = lp_c - ref[:b], lp_r - ref[b:]
        delta = rho_c - rho_r
        if kind == "sigmoid":  # cDPO when eps > 0
            loss = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
        elif kind == "ipo":
            loss = (rho_c / n_c - rho_r / n_r - 1 / (2 * beta)) ** 2
        elif kind == "hinge":
            loss = torch.relu(1 - beta * delta)
        elif kind == "robust":
            loss = (-(1 - eps) * F.logsigmoid(beta * delta)
                    + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
        else:
            raise ValueError(kind)
        if kind == "ipo":  # LLaMA-Factory averages policy and reference logps for ipo
            rewards_c, rewards_r = beta * rho_c / n_c, beta * rho_r / n_r
        else:
            rewards_c, rewards_r = beta * rho_c, beta * rho_r
    elif kind == "orpo":
        log_odds = (a_c - a_r) - (torch.log1p(-torch.exp(a_c)) - torch.log1p(-torch.exp(a_r)))
        loss = -a_c + beta * (-F.logsigmoid(log_odds))
        rewards_c, rewards_r = beta * a_c, beta * a_r
    elif kind == "simpo":
        loss = -F.logsigmoid(beta * (a_c - a_r) - case["simpo_gamma"])
        rewards_c, rewards_r = beta * a_c, beta * a_r
    else:
        raise ValueError(kind)
    if case["pref_ftx"] > 0:  # LLaMA-Factory: length-averaged NLL of the chosen completion
        loss = loss + case["pref_ftx"] * (-a_c)
    averaged = kind in ("ipo", "orpo", "simpo")
    logps_c, logps_r = (a_c, a_r) if averaged else (lp_c, lp_r)
    rewards_c, rewards_r = rewards_c.detach(), rewards_r.detach()
    metrics = torch.stack([rewards_c.mean(), rewards_r.mean(),
                           (rewards_c > rewards_r).to(torch.float32).mean(),
                           (rewards_c - rewards_r).mean(),
                           logps_c.detach().mean(), logps_r.detach().mean()])
    return loss, metrics.to(torch.float32)


def make_kto_batch(seed):
    """4 sequences (prompt + completion) and their KL sequences (prompt i + completion i - 1)."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, 128, (n,), generator=g, dtype=torch.int64)  # noqa: E731
    prompts = [draw(n) for n in (4, 6, 3, 5)]
    completions = [draw(n) for n in (5, 3, 7, 4)]
    own = list(zip(prompts, completions))
    kl = [(prompts[i], completions[i - 1]) for i in range(4)]  # i - 1 = -1: the last
    return pad_rows(own), pad_rows(kl)


def kto_losses(case, pol, ref, kl, desirable, counts):
    """TRL's kto_loss (and apo_zero_unpaired) per example, weighted; LLaMA-Factory's pref_ftx
    term; the metrics [5] (TRL: means over the desirable / undesirable examples)."""
    beta = case["beta"]
    rho = pol - ref
    z0 = kl if case["pref_loss"] == "kto" else 0.0
    if case["pref_loss"] == "kto":
        d_loss, u_loss = 1 - torch.sigmoid(beta * (rho - z0)), 1 - torch.sigmoid(beta * (z0 - rho))
    else:
        d_loss, u_loss = 1 - torch.sigmoid(beta * rho), torch.sigmoid(beta * rho)
    losses = torch.cat([case["desirable_weight"] * d_loss[desirable],
                        case["undesirable_weight"] * u_loss[~desirable]])
    loss = losses.nanmean()
    n_d = int(desirable.sum())
    if case["pref_ftx"] > 0 and n_d > 0:  # LLaMA-Factory: rescaled by batch / desirable count
        sft = -(pol / counts.to(torch.float32))[desirable]
        loss = loss + case["pref_ftx"] * sft.nanmean() / n_d * len(pol)
    reward = (beta * rho).detach()
    rc, rr = reward[desirable].mean(), reward[~desirable].mean()
    metrics = torch.stack([rc, pol.detach()[desirable].mean(), rr,
                           pol.detach()[~desirable].mean(), rc - rr])
    return loss, metrics.to(torch.float32)


def make_kto(family, model, trainable, d):
    from safetensors.torch import save_file
    desirable = torch.tensor(KTO_DESIRABLE)
    for seed in range(1000, 1100):
        (ids, mask, labels), (kl_ids, kl_mask, kl_labels) = make_kto_batch(seed)
        with torch.no_grad():
            with model.disable_adapter():
                ref, counts = row_logps(model, ids, mask, labels)
                kl_ref, _ = row_logps(model, kl_ids, kl_mask, kl_labels)
            policy, _ = row_logps(model, ids, mask, labels)
            kl_policy, _ = row_logps(model, kl_ids, kl_mask, kl_labels)
        z0 = float((kl_policy - kl_ref).mean().clamp_min(0))
        if z0 > 1e-3:
            break
    assert z0 > 1e-3, (family, "no batch with a positive KL estimate")
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels, "kl_input_ids": kl_ids,
           "kl_attention_mask": kl_mask, "kl_labels": kl_labels,
           "desirable": desirable.to(torch.int64),
           "policy_logps": policy.to(torch.float32), "ref_logps": ref.to(torch.float32),
           "kl_policy_logps": kl_policy.to(torch.float32), "kl_ref_logps": kl_ref.to(torch.float32),
           "kl": torch.tensor([z0], dtype=torch.float32)}
    losses = []
    for case in KTO_CASES:
        k = case["name"]
        model.zero_grad(set_to_none=True)
        pol, _ = row_logps(model, ids, mask, labels)
        loss, metrics = kto_losses(case, pol, ref, z0, desirable, counts)
        assert torch.isfinite(loss) and torch.isfinite(metrics).all(), (family, k)
        loss.backward()
        out["loss." + k] = loss.detach().reshape(1)
        out["metrics." + k] = metrics
        for name, p in trainable:
            assert p.grad is not None and torch.isfinite(p.grad).all(), (family, k, name)
            out["grad." + k + "." + our_name(name)] = p.grad.detach().clone()
        losses.append(f"{k} {loss.item():.6f}")
    model.zero_grad(set_to_none=True)
    save_file({key: v.contiguous() for key, v in out.items()}, os.path.join(d, "kto.safetensors"))
    print(family, "kto (z0 %.5f):" % z0, ", ".join(losses), flush=True)


def make(family):
    from peft import LoraConfig, TaskType, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    d = os.path.join(OUT, "preference", family)
    os.makedirs(d, exist_ok=True)
    base, info = AutoModelForCausalLM.from_pretrained(
        os.path.join(MODELS, family), dtype=torch.float32, attn_implementation="eager",
        output_loading_info=True)
    missing = [k for k in info.get("missing_keys", ()) if not (
        base.config.tie_word_embeddings and k.startswith("lm_head."))]
    assert not missing, (family, "weights not in the checkpoint", missing)
    base = base.to("cpu").to(torch.float32)
    base.config._attn_implementation = "eager"
    rel = "tests/fixtures/models/" + family  # not the local path of the machine it ran on
    base.config._name_or_path = rel
    cfg = LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, lora_dropout=0.0,
                     bias="none", target_modules="all-linear")
    torch.manual_seed(77)
    model = get_peft_model(base, cfg)
    model.peft_config["default"].base_model_name_or_path = rel
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))
    # No embedding layer is adapted; "auto" would look the base model up (on the Hub if the
    # relative path does not resolve from the current directory).
    model.save_pretrained(os.path.join(d, "adapter"), save_embedding_layers=False)
    model.eval()
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name, _ in trainable), family

    ids, mask, labels = make_batch()
    with torch.no_grad():
        with model.disable_adapter():
            ref, counts = row_logps(model, ids, mask, labels)
        policy, counts_pol = row_logps(model, ids, mask, labels)
    assert torch.equal(counts, counts_pol)
    assert counts.tolist() == [5, 3, 7, 6, 4, 2], counts.tolist()
    assert (policy - ref).abs().min() > 1e-4, ("the adapter must change every row", policy, ref)
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels,
           "policy_logps": policy.to(torch.float32), "ref_logps": ref.to(torch.float32),
           "completion_tokens": counts}
    losses = []
    for case in CASES:
        k = case["name"]
        model.zero_grad(set_to_none=True)
        pol, _ = row_logps(model, ids, mask, labels)  # with grad, fresh graph per case
        assert torch.allclose(pol.detach(), policy, rtol=1e-6, atol=1e-5), k
        per_pair, metrics = pair_losses(case, pol, ref, counts)
        loss = per_pair.mean()
        assert torch.isfinite(loss), (family, k)
        assert torch.isfinite(metrics).all(), (family, k)
        loss.backward()
        out["loss." + k] = loss.detach().reshape(1)
        out["metrics." + k] = metrics
        nonzero = False
        for name, p in trainable:
            assert p.grad is not None, (family, k, name)
            assert torch.isfinite(p.grad).all(), (family, k, name)
            nonzero = nonzero or bool((p.grad != 0).any())
            out["grad." + k + "." + our_name(name)] = p.grad.detach().clone()
        assert nonzero, (family, k, "every gradient is zero")
        losses.append(f"{k} {loss.item():.6f}")
    model.zero_grad(set_to_none=True)
    save_file({key: v.contiguous() for key, v in out.items()},
              os.path.join(d, "expected.safetensors"))
    write_json(os.path.join(d, "cases.json"), {"cases": CASES, "kto_cases": KTO_CASES})
    print(family, "loss:", ", ".join(losses), flush=True)
    make_kto(family, model, trainable, d)


def mean_answer_logits(model, ids, mask, labels):
    """TRL's DPO logits metric of a set of rows: the logits that score labels[:, 1:] at the
    answers' positions, averaged over those positions and the vocabulary."""
    logits = model(input_ids=ids, attention_mask=mask).logits.to(torch.float32)[:, :-1, :]
    return logits[labels[:, 1:] != -100].mean()


def make_logits(family):
    """logits.safetensors beside the committed fixtures of `family` (read from FIXTURES): TRL's
    logits/chosen and logits/rejected of the pair batch (chosen, rejected), and the same mean of
    the KTO batch's desirable and undesirable rows (kto_chosen, kto_rejected), under the
    committed adapter."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    d = os.path.join(FIXTURES, family)
    base = AutoModelForCausalLM.from_pretrained(os.path.join(MODELS, family), dtype=torch.float32,
                                                attn_implementation="eager").to("cpu")
    model = PeftModel.from_pretrained(base, os.path.join(d, "adapter")).eval()
    out = {}
    with torch.no_grad():
        pairs = load_file(os.path.join(d, "expected.safetensors"))
        n = pairs["input_ids"].shape[0] // 2
        for key, rows in (("chosen", slice(0, n)), ("rejected", slice(n, 2 * n))):
            out[key] = mean_answer_logits(model, pairs["input_ids"][rows],
                                          pairs["attention_mask"][rows], pairs["labels"][rows])
        kto = load_file(os.path.join(d, "kto.safetensors"))
        desirable = kto["desirable"].to(torch.bool)
        for key, rows in (("kto_chosen", desirable), ("kto_rejected", ~desirable)):
            out[key] = mean_answer_logits(model, kto["input_ids"][rows],
                                          kto["attention_mask"][rows], kto["labels"][rows])
    save_file({k: v.reshape(1).contiguous() for k, v in out.items()},
              os.path.join(OUT, "preference", family, "logits.safetensors"))
    print(family, "logits:", {k: round(v.item(), 6) for k, v in out.items()}, flush=True)


FIXTURES = os.path.join(os.path.dirname(MODELS), "preference")


def main():
    if len(sys.argv) > 2 and sys.argv[2] == "--logits":
        # Only the logits metrics, from the committed fixtures (their models and batches).
        for family in FAMILIES:
            os.makedirs(os.path.join(OUT, "preference", family), exist_ok=True)
            make_logits(family)
        return
    for family in FAMILIES:
        make(family)
    versions = {}
    for mod in ("torch", "transformers", "peft", "safetensors"):
        versions[mod] = importlib.import_module(mod).__version__
    write_json(os.path.join(OUT, "preference", "VERSIONS.json"), versions)


if __name__ == "__main__":
    main()
