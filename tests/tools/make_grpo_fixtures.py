#!/usr/bin/env python3
"""GRPO reference fixtures computed by TRL's own code, committed as tests/fixtures/grpo/*.json and
checked by tests/test_grpo.cpp in CI.

    python3 tests/tools/make_grpo_fixtures.py TRL_SOURCE_DIR OUT_DIR

TRL_SOURCE_DIR holds TRL's trl/trainer/grpo_trainer.py and trl/trainer/utils.py (TRL itself
need not be installed: its dependencies are not on the GPU machine). This script takes from
them, unchanged, the method GRPOTrainer._compute_loss, the block of
GRPOTrainer._generate_and_score_completions that turns rewards into advantages, and nanstd, and
runs them on a stand-in `self` that carries the options (one process, no accumulation, no
vLLM, no entropy masking or bonus). The per-token log-probabilities are a leaf tensor, so the
fixture records the loss and its gradient with respect to them.

Writes OUT_DIR/loss.json: {"trl_commit", "cases": [{options, logps, old_logps, ref_logps,
mask, advantages, entropies, loss, grad, metrics}]} and OUT_DIR/advantages.json:
{"cases": [{num_generations, scale_rewards, weights, rewards_per_func (null = None), rewards,
advantages, std_zero}]}. All fp64 on the CPU.
"""
import ast
import collections
import json
import math
import os
import sys
import textwrap
import types

import torch

SRC, OUT = sys.argv[1], sys.argv[2]
COMMIT = sys.argv[3] if len(sys.argv) > 3 else "unknown"
os.makedirs(OUT, exist_ok=True)
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

trainer_src = open(os.path.join(SRC, "grpo_trainer.py")).read()
utils_src = open(os.path.join(SRC, "utils.py")).read()


def function_source(src, name, cls=None):
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and cls and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return textwrap.dedent(ast.get_source_segment(src, item))
        if cls is None and isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(src, node)
    raise SystemExit(f"{name} not found in TRL's source")


ns = {"torch": torch}
for helper in ("nanstd", "nanmin", "nanmax"):
    exec(function_source(utils_src, helper), ns)
exec(function_source(trainer_src, "_compute_loss", "GRPOTrainer"), ns)
compute_loss = ns["_compute_loss"]

# The advantages block, as the method writes it.
start = trainer_src.index('        if self.multi_objective_aggregation == "sum_then_normalize":')
end = trainer_src.index("        advantages = torch.nan_to_num(advantages, nan=0.0)")
end = trainer_src.index("\n", end) + 1
advantages_block = textwrap.dedent(trainer_src[start:end])


class Accelerator:
    num_processes = 1

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x


def stand_in(options, logps, entropies):
    s = types.SimpleNamespace()
    s.loss_type = options["loss_type"]
    s.beta = options["beta"]
    s.epsilon_low = options["epsilon"]
    s.epsilon_high = options["epsilon_high"]
    s.importance_sampling_level = options["importance_sampling_level"]
    s.max_completion_length = options["max_completion_length"]
    s.top_entropy_quantile = 1.0
    s.off_policy_mask_threshold = None
    s.use_vllm = False
    s.vllm_importance_sampling_correction = False
    s._entropy_bonus_enabled = False
    s.aux_loss_enabled = False
    s.current_gradient_accumulation_steps = 1
    s.model = types.SimpleNamespace(training=True)
    s.args = types.SimpleNamespace(delta=options.get("delta"),
                                   use_bias_correction_kl=options.get("use_bias_correction_kl", False),
                                   sapo_temperature_pos=options.get("sapo_temperature_pos", 1.0),
                                   sapo_temperature_neg=options.get("sapo_temperature_neg", 1.05))
    s.accelerator = Accelerator()
    s._metrics = collections.defaultdict(lambda: collections.defaultdict(list))
    s._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    return s


def listed(t):
    return t.detach().tolist()


B, T = 6, 9
loss_cases = []
for name, opts in [
    ("grpo", dict(loss_type="grpo")),
    ("grpo_beta", dict(loss_type="grpo", beta=0.04)),
    ("grpo_beta_bias", dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=True)),
    ("bnpo", dict(loss_type="bnpo", beta=0.02)),
    ("dr_grpo", dict(loss_type="dr_grpo", max_completion_length=12)),
    ("dapo", dict(loss_type="dapo", epsilon_high=0.28)),
    ("dapo_delta", dict(loss_type="dapo", epsilon_high=0.28, delta=1.3, beta=0.01)),
    ("gspo", dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4,
                  epsilon_high=4e-4)),
    ("gspo_beta", dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.05)),
    ("cispo", dict(loss_type="cispo", epsilon_high=1.1)),
    ("sapo", dict(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)),
    ("luspo", dict(loss_type="luspo", importance_sampling_level="sequence")),
]:
    o = dict(loss_type="grpo", beta=0.0, epsilon=0.2, epsilon_high=0.2, delta=None,
             importance_sampling_level="token", max_completion_length=T)
    o.update(opts)
    lengths = torch.randint(1, T + 1, (B,))
    lengths[0] = T
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    old = -torch.rand(B, T) * 3
    # Ratios both inside and outside the clip range.
    spread = 0.6 if o["importance_sampling_level"] == "token" else 0.002
    logps = (old + (torch.rand(B, T) - 0.5) * spread).requires_grad_(True)
    ref = old + (torch.rand(B, T) - 0.5) * 0.5
    adv = torch.randn(B)
    entropies = torch.rand(B, T) * 2
    num_items = mask.sum()
    inputs = dict(prompt_ids=torch.zeros(B, 1, dtype=torch.long),
                  prompt_mask=torch.ones(B, 1, dtype=torch.long),
                  completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=mask,
                  advantages=adv, old_per_token_logps=old, ref_per_token_logps=ref,
                  num_items_in_batch=num_items)
    s = stand_in(o, logps, entropies)
    loss = compute_loss(s, None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in s._metrics["train"].items()}
    loss_cases.append(dict(name=name, options=o, logps=listed(logps), old_logps=listed(old),
                           ref_logps=listed(ref), mask=listed(mask), advantages=listed(adv),
                           entropies=listed(entropies), loss=loss.item(),
                           grad=listed(logps.grad), metrics=metrics))

adv_cases = []
for name, g, scale, weights, n_func in [("group", 4, "group", None, 1),
                                          ("group_weighted", 3, "group", [1.0, 0.5], 2),
                                          ("batch", 4, "batch", [2.0, -1.0], 2),
                                          ("none", 2, "none", None, 1),
                                          ("group_none_rewards", 4, "group", [1.0, 1.0], 2)]:
    groups = 3
    r = torch.randn(groups * g, n_func).round(decimals=1)
    r[:g, 0] = 0.5  # a group whose only (first) function agrees: std 0
    if n_func > 1:
        r[:g, 1] = 0.25
    if name == "group_none_rewards":
        r[1, 0] = float("nan")
        r[2, :] = float("nan")  # unscorable
        r[g:2 * g, 1] = float("nan")
    rewards_per_func = r
    s = types.SimpleNamespace(multi_objective_aggregation="sum_then_normalize",
                              scale_rewards=scale,
                              reward_weights=torch.tensor(weights or [1.0] * n_func),
                              reward_funcs=[None] * n_func)
    local = dict(self=s, torch=torch, nanstd=ns["nanstd"], rewards_per_func=rewards_per_func,
                 device="cpu", num_generations=g,
                 unscorable_mask=torch.isnan(rewards_per_func).all(dim=1))
    exec(advantages_block, local)
    adv_cases.append(dict(
        name=name, num_generations=g, scale_rewards=scale, weights=weights or [1.0] * n_func,
        rewards_per_func=[[None if math.isnan(v) else v for v in row] for row in r.tolist()],
        rewards=[None if math.isnan(v) else v for v in local["rewards"].tolist()],
        advantages=local["advantages"].tolist(),
        std_zero=local["is_std_zero"].tolist()))

with open(os.path.join(OUT, "loss.json"), "w") as f:
    json.dump(dict(trl_commit=COMMIT, torch=torch.__version__, cases=loss_cases), f)
with open(os.path.join(OUT, "advantages.json"), "w") as f:
    json.dump(dict(trl_commit=COMMIT, torch=torch.__version__, cases=adv_cases), f)
print(f"wrote {len(loss_cases)} loss cases, {len(adv_cases)} advantage cases")
