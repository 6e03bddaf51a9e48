// Logits processors and the sampler (see sampling.hpp). The processors follow transformers'
// RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
// TopPLogitsWarper and MinPLogitsWarper (docs/generation.md restates them), keeping at least
// one token each.
#include "model/sampling.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "zerotrain/error.hpp"

namespace zt::model {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

void check_generation_options(const GenerationOptions& o) {
  if (o.max_new_tokens < 0) {
    throw InvalidArgument(
        fmt::format("max_new_tokens {}: the completion's length is ≥ 0", o.max_new_tokens));
  }
  if (!(o.temperature > 0) || !std::isfinite(o.temperature)) {
    throw InvalidArgument(fmt::format(
        "temperature {}: a finite number > 0 (greedy decoding: do_sample false)", o.temperature));
  }
  if (o.top_k < 0) throw InvalidArgument(fmt::format("top_k {}: ≥ 0 (0: off)", o.top_k));
  if (!(o.top_p > 0 && o.top_p <= 1)) {
    throw InvalidArgument(fmt::format("top_p {}: in (0, 1] (1: off)", o.top_p));
  }
  if (!(o.min_p >= 0 && o.min_p <= 1)) {
    throw InvalidArgument(fmt::format("min_p {}: in [0, 1] (0: off)", o.min_p));
  }
  if (!(o.repetition_penalty > 0) || !std::isfinite(o.repetition_penalty)) {
    throw InvalidArgument(
        fmt::format("repetition_penalty {}: a finite number > 0 (1: off)", o.repetition_penalty));
  }
}

at::Tensor process_logits(const at::Tensor& logits, const at::Tensor& seen,
                          const GenerationOptions& o) {
  at::Tensor s = logits.to(at::kFloat);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  if (o.repetition_penalty != 1.0 && seen.defined()) {
    const at::Tensor penalized =
        at::where(s < 0, s * o.repetition_penalty, s / o.repetition_penalty);
    s = at::where(seen, penalized, s);
  }
  if (!o.do_sample) return s;
  if (o.temperature != 1.0) s = s / o.temperature;
  const int64_t vocab = s.size(-1);
  if (o.top_k > 0 && o.top_k < vocab) {
    const at::Tensor kth = std::get<0>(s.topk(o.top_k, -1)).narrow(-1, o.top_k - 1, 1);
    s = s.masked_fill(s < kth, minus_inf);
  }
  if (o.top_p < 1.0) {
    auto [sorted, order] = s.sort(-1, /*descending=*/false);
    at::Tensor remove = sorted.softmax(-1).cumsum(-1) <= (1.0 - o.top_p);
    remove.narrow(-1, vocab - 1, 1).fill_(false);
    s = s.masked_fill(remove.scatter(-1, order, remove), minus_inf);
  }
  if (o.min_p > 0.0) {
    const at::Tensor probs = s.softmax(-1);
    at::Tensor remove = probs < probs.amax(-1, true) * o.min_p;
    // The most likely token stays (transformers keeps min_tokens_to_keep = 1 of the sorted).
    const at::Tensor best = s.argmax(-1, true);
    remove = remove.scatter(-1, best, false);
    s = s.masked_fill(remove, minus_inf);
  }
  return s;
}

at::Tensor uniform_draws(uint64_t seed, const std::vector<uint64_t>& streams, int64_t step) {
  at::Tensor u = at::empty({static_cast<int64_t>(streams.size())}, at::kDouble);
  double* out = u.data_ptr<double>();
  for (size_t i = 0; i < streams.size(); ++i) {
    const uint64_t h =
        splitmix64(splitmix64(splitmix64(seed) ^ streams[i]) ^ static_cast<uint64_t>(step));
    out[i] = (static_cast<double>(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);  // (0, 1)
  }
  return u;
}

at::Tensor sample_tokens(const at::Tensor& scores, const at::Tensor& u) {
  const at::Tensor probs = scores.to(at::kDouble).softmax(-1);
  const at::Tensor cum = probs.cumsum(-1);
  const at::Tensor target = u.to(cum.device()).unsqueeze(1) * cum.narrow(-1, cum.size(-1) - 1, 1);
  // The first index whose cumulative probability reaches the target: a token of positive
  // probability, since the target is above 0.
  at::Tensor index = cum.lt(target).sum(-1);
  return index.clamp_max(scores.size(-1) - 1);
}

}  // namespace zt::model
