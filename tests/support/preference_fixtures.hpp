// The preference fixtures of tests/tools/make_preference_fixtures.py (TRL's and LLaMA-Factory's
// formulas over transformers + PEFT), checked on a device: the CPU in CI (test_preference.cpp),
// CUDA on the GPU machine (gpu/test_preference_gpu.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>

#include "zerotrain/model.hpp"

namespace zt::test {

/// The committed tiny model tests/fixtures/models/<family> (llama, qwen2, glm) with its weights,
/// fp32 on the CPU.
std::shared_ptr<CausalLM> fixture_model(const std::string& family);

/// Checks the DPO-family cases of `family`'s fixture (tests/fixtures/preference/<family>:
/// expected.safetensors, cases.json) on `device`: the reference's and the policy's sequence
/// log-probs, each case's loss, metrics and adapter gradients, within tolerances × `slack`.
/// Catch assertions; returns the number of cases checked.
int check_pair_fixture(const std::string& family, const at::Device& device, double slack = 1);
/// The same for its KTO cases (kto.safetensors): the sequences' and KL sequences' log-probs,
/// z0, each case's loss, metrics and gradients.
int check_kto_fixture(const std::string& family, const at::Device& device, double slack = 1);

}  // namespace zt::test
