// Token choice for generation: transformers' logits processors (repetition penalty,
// temperature, top-k, top-p, min-p, in the order its `generate` applies them) and a sampler
// whose draws depend only on a sequence's own seed and step, not on the batch it shares.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "zerotrain/model.hpp"

namespace zt::model {

/// Scores [B, V] fp32 as transformers' processors leave them for sampling (-inf: filtered out)
/// from the raw logits [B, V] (`seen` [B, V] bool: the tokens of each row's prompt and
/// completion so far, for the repetition penalty; may be undefined when it is 1). With
/// do_sample false only the repetition penalty applies (greedy takes the argmax).
at::Tensor process_logits(const at::Tensor& logits, const at::Tensor& seen,
                          const GenerationOptions& o);

/// One uniform draw in (0, 1) per row for step `step`: a hash of (seed, the row's stream,
/// step), so that a sequence's draws are the same whatever batch, rank or order it is generated
/// in. [B] fp64 on the host.
at::Tensor uniform_draws(uint64_t seed, const std::vector<uint64_t>& streams, int64_t step);

/// Inverse-CDF sampling: per row the first token whose cumulative probability reaches
/// u · total (`scores` [B, V] as process_logits gives them, `u` [B] in (0, 1)). [B] int64.
at::Tensor sample_tokens(const at::Tensor& scores, const at::Tensor& u);

/// Checks sampling options before any generation: InvalidArgument naming the option.
void check_generation_options(const GenerationOptions& o);

}  // namespace zt::model
