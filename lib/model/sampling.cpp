// Logits processors and the sampler (see sampling.hpp). The processors follow transformers'
// RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
// TopPLogitsWarper and MinPLogitsWarper (docs/generation.md restates them), keeping at least
// one token each.
#include "model/sampling.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>

#include "util/json.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/tokenizer.hpp"

namespace zt {

// transformers' StopStringCriteria (generation/stopping_criteria.py) restated: a token ends the
// sequence when its text holds a stop string's last character (anything may follow it in the
// token) and the texts before it hold the rest. A stop string entirely in earlier tokens does
// not count (it would have stopped the sequence there, or it lies in the prompt).
StopStrings::StopStrings(std::vector<std::string> strings,
                         std::shared_ptr<const std::vector<std::string>> token_texts)
    : strings_(std::move(strings)), texts_(std::move(token_texts)) {
  if (strings_.empty()) throw InvalidArgument("stop_strings: give at least one string");
  for (const std::string& s : strings_) {
    if (s.empty()) throw InvalidArgument("stop_strings: a stop string is empty");
    longest_ = std::max(longest_, s.size());
  }
  if (!texts_) throw InvalidArgument("stop_strings: no token texts to match them against");
}

std::vector<std::string> StopStrings::parse(const std::string& text, const std::string& what) {
  if (text.empty()) return {};
  if (text.front() != '[') return {text};
  rapidjson::Document d;
  try {
    d = json::parse(text, what);
  } catch (const Error& e) {
    throw InvalidArgument(fmt::format("{}: not a JSON list of strings ({})", what, e.what()));
  }
  if (!d.IsArray()) throw InvalidArgument(fmt::format("{}: not a JSON list of strings", what));
  std::vector<std::string> out;
  for (const auto& v : d.GetArray()) {
    if (!v.IsString() || v.GetStringLength() == 0) {
      throw InvalidArgument(
          fmt::format("{}: every item of the list is a non-empty string; item {} is {}", what,
                      out.size(), v.IsString() ? "empty" : json::type_name(v)));
    }
    out.emplace_back(v.GetString(), v.GetStringLength());
  }
  if (out.empty()) throw InvalidArgument(fmt::format("{}: the list is empty", what));
  return out;
}

std::shared_ptr<const std::vector<std::string>> StopStrings::token_texts(
    const Tokenizer& tokenizer) {
  // transformers' clean_tokenizer_vocab: each token decoded after the tokens of "abcdef", the
  // prefix's text cut off, so that a leading space (SentencePiece's ▁) is kept.
  static constexpr std::string_view kPrefix = "abcdef";
  const std::vector<int32_t> base = tokenizer.encode(kPrefix);
  auto texts = std::make_shared<std::vector<std::string>>();
  const int64_t n = tokenizer.vocab_size();
  texts->reserve(static_cast<size_t>(n));
  std::vector<int32_t> ids = base;
  ids.push_back(0);
  for (int64_t id = 0; id < n; ++id) {
    ids.back() = static_cast<int32_t>(id);
    const std::string text = tokenizer.decode(ids);
    const size_t at = text.find(kPrefix);
    texts->push_back(at == std::string::npos ? std::string() : text.substr(at + kPrefix.size()));
  }
  return texts;
}

const std::string& StopStrings::text(int64_t id) const {
  static const std::string none;
  return id >= 0 && id < static_cast<int64_t>(texts_->size()) ? (*texts_)[static_cast<size_t>(id)]
                                                              : none;
}

bool StopStrings::completes(const std::vector<int64_t>& prompt,
                            const std::vector<int64_t>& tokens) const {
  if (tokens.empty()) return false;
  const std::string& last = text(tokens.back());
  if (last.empty()) return false;
  // The texts before the last token, back to longest_ − 1 bytes (enough for any string's
  // rest), then the last token's.
  std::vector<const std::string*> before;
  size_t have = 0;
  const auto total = static_cast<int64_t>(prompt.size() + tokens.size());
  for (int64_t i = total - 2; i >= 0 && have + 1 < longest_; --i) {
    const auto u = static_cast<size_t>(i);
    const std::string& t = text(u >= prompt.size() ? tokens[u - prompt.size()] : prompt[u]);
    before.push_back(&t);
    have += t.size();
  }
  std::string tail;
  tail.reserve(have + last.size());
  for (auto it = before.rbegin(); it != before.rend(); ++it) tail += **it;
  const size_t split = tail.size();
  tail += last;
  for (const std::string& s : strings_) {
    // An occurrence that ends inside the last token: it starts at split + 1 − |s| or later.
    const size_t from = split + 1 >= s.size() ? split + 1 - s.size() : 0;
    if (tail.find(s, from) != std::string::npos) return true;
  }
  return false;
}

}  // namespace zt

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
