// GRPO's built-in rewards and the scoring of a generation batch (see rewards.hpp).
#include "train/rewards.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <set>

#include "config/training_options.hpp"
#include "util/pattern.hpp"
#include "zerotrain/error.hpp"

namespace zt::train {

namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

// The content of the last \boxed{...} (braces balanced), or nullopt.
std::optional<std::string> last_boxed(const std::string& text) {
  const size_t at = text.rfind("\\boxed");
  if (at == std::string::npos) return std::nullopt;
  size_t i = at + 6;
  while (i < text.size() && text[i] == ' ') ++i;
  if (i >= text.size() || text[i] != '{') return std::nullopt;
  int depth = 0;
  for (size_t j = i; j < text.size(); ++j) {
    if (text[j] == '{') ++depth;
    if (text[j] == '}' && --depth == 0) return text.substr(i + 1, j - i - 1);
  }
  return std::nullopt;  // unclosed
}

bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

// The last number of `text` ("-1,234.5", "3", ".5"), commas dropped; empty when none.
std::string last_number(const std::string& text) {
  std::string found;
  size_t i = 0;
  while (i < text.size()) {
    const bool starts =
        is_digit(text[i]) || (text[i] == '.' && i + 1 < text.size() && is_digit(text[i + 1]));
    if (!starts) {
      ++i;
      continue;
    }
    const size_t begin = i;
    std::string number;
    if (begin > 0 && text[begin - 1] == '-') number = "-";
    bool dot = false;
    while (i < text.size()) {
      const char c = text[i];
      if (is_digit(c)) {
        number += c;
      } else if (c == ',' && !dot && i + 1 < text.size() && is_digit(text[i + 1])) {
        // a thousands separator
      } else if (c == '.' && !dot && i + 1 < text.size() && is_digit(text[i + 1])) {
        number += c;
        dot = true;
      } else {
        break;
      }
      ++i;
    }
    found = number;
  }
  return found;
}

// The text's value as a number: plain (commas, "$", "%" and spaces ignored), a/b, or
// \frac{a}{b} / \dfrac{a}{b}; nullopt otherwise.
std::optional<double> as_number(const std::string& raw) {
  std::string s;
  for (char c : raw) {
    if (c != ',' && c != '$' && c != ' ' && c != '%') s += c;
  }
  while (!s.empty() && s.back() == '.') s.pop_back();
  if (s.empty()) return std::nullopt;
  const auto plain = [](const std::string& t) -> std::optional<double> {
    if (t.empty()) return std::nullopt;
    char* end = nullptr;
    const double v = std::strtod(t.c_str(), &end);
    if (end != t.c_str() + t.size() || !std::isfinite(v)) return std::nullopt;
    // strtod also reads "inf", "nan" and hex: only decimal numbers count.
    for (char c : t) {
      if (!(is_digit(c) || c == '.' || c == '-' || c == '+' || c == 'e' || c == 'E'))
        return std::nullopt;
    }
    return v;
  };
  for (const char* frac : {"\\dfrac{", "\\frac{", "\\tfrac{"}) {
    const std::string f = frac;
    if (s.rfind(f, 0) == 0 || s.rfind("-" + f, 0) == 0) {
      const bool neg = s[0] == '-';
      const size_t open = (neg ? 1 : 0) + f.size();
      const size_t close = s.find('}', open);
      if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != '{' ||
          s.back() != '}')
        return std::nullopt;
      const auto num = plain(s.substr(open, close - open));
      const auto den = plain(s.substr(close + 2, s.size() - close - 3));
      if (!num || !den || *den == 0) return std::nullopt;
      return (neg ? -1 : 1) * *num / *den;
    }
  }
  const size_t slash = s.find('/');
  if (slash != std::string::npos) {
    const auto num = plain(s.substr(0, slash));
    const auto den = plain(s.substr(slash + 1));
    if (!num || !den || *den == 0) return std::nullopt;
    return *num / *den;
  }
  return plain(s);
}

std::string canonical_text(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (!std::isspace(static_cast<unsigned char>(c)) && c != '$') out += c;
  }
  while (!out.empty() && out.back() == '.') out.pop_back();
  return out;
}

double parse_number(const std::string& text, const std::string& what) {
  const std::optional<double> v = config::parse_double_text(text);  // decimal, as flags are
  if (!v) throw ConfigError(fmt::format("{}: '{}' is not a decimal number", what, text));
  return *v;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out{""};
  for (char c : s) {
    if (c == sep) {
      out.emplace_back();
    } else {
      out.back() += c;
    }
  }
  return out;
}

}  // namespace

std::string completion_answer(const std::string& text) {
  if (auto boxed = last_boxed(text)) return trim(*boxed);
  return last_number(text);
}

std::string reference_answer(const std::string& text) {
  const size_t hashes = text.rfind("####");
  if (hashes != std::string::npos) return trim(text.substr(hashes + 4));
  if (auto boxed = last_boxed(text)) return trim(*boxed);
  return trim(text);
}

bool same_answer(const std::string& a, const std::string& b) {
  const auto x = as_number(a), y = as_number(b);
  if (x && y) return std::abs(*x - *y) <= 1e-6 * std::max(1.0, std::abs(*y));
  const std::string ca = canonical_text(a), cb = canonical_text(b);
  return !ca.empty() && ca == cb;
}

}  // namespace zt::train

namespace zt {

using train::completion_answer;
using train::parse_number;
using train::reference_answer;
using train::same_answer;
using train::split;

RewardFunction builtin_reward(const std::string& spec, const std::string& what) {
  const auto fail = [&](const std::string& why) {
    return ConfigError(
        fmt::format("{}: '{}' {}; the built-in rewards are accuracy, think_format, format:PATTERN, "
                    "overlong:MAX:CACHE and repetition:N:PENALTY (docs/grpo.md)",
                    what, spec, why));
  };
  if (spec == "accuracy") {
    return {"accuracy", [](const std::vector<RewardInput>& in) {
              std::vector<std::optional<double>> out;
              for (const RewardInput& r : in) {
                auto col = r.columns.find("answer");
                if (col == r.columns.end()) col = r.columns.find("solution");
                const std::string gold =
                    col == r.columns.end() ? std::string() : reference_answer(col->second);
                if (gold.empty()) {
                  out.push_back(std::nullopt);
                } else {
                  out.push_back(same_answer(completion_answer(r.completion), gold) ? 1.0 : 0.0);
                }
              }
              return out;
            }};
  }
  if (spec == "think_format") {
    return {"think_format", [](const std::vector<RewardInput>& in) {
              std::vector<std::optional<double>> out;
              for (const RewardInput& r : in) {
                const std::string& c = r.completion;
                const std::string rest = c.rfind("<think>", 0) == 0 ? c.substr(7) : std::string();
                const bool ok = c.rfind("<think>", 0) == 0 &&
                                rest.find("<think>") == std::string::npos &&
                                rest.find("</think>") != std::string::npos;
                out.push_back(ok ? 1.0 : 0.0);
              }
              return out;
            }};
  }
  if (spec.rfind("format:", 0) == 0) {
    const std::string pattern = spec.substr(7);
    if (pattern.empty()) throw fail("has no pattern");
    auto compiled = std::make_shared<Pattern>("(?s)" + pattern, what);
    return {"format", [compiled](const std::vector<RewardInput>& in) {
              std::vector<std::optional<double>> out;
              for (const RewardInput& r : in)
                out.push_back(compiled->prefix_match(r.completion) ? 1.0 : 0.0);
              return out;
            }};
  }
  if (spec.rfind("overlong:", 0) == 0) {
    const auto parts = split(spec.substr(9), ':');
    if (parts.size() != 2) throw fail("needs MAX and CACHE");
    const double max = parse_number(parts[0], what), cache = parse_number(parts[1], what);
    if (!(max >= 1) || !(cache >= 0) || cache > max)
      throw fail("needs MAX ≥ 1 and 0 ≤ CACHE ≤ MAX");
    return {"overlong", [max, cache](const std::vector<RewardInput>& in) {
              std::vector<std::optional<double>> out;
              for (const RewardInput& r : in) {
                const double n = static_cast<double>(r.completion_ids.size());
                if (n <= max - cache) {
                  out.push_back(0.0);
                } else if (n <= max) {
                  out.push_back((max - cache - n) / cache);
                } else {
                  out.push_back(-1.0);
                }
              }
              return out;
            }};
  }
  if (spec.rfind("repetition:", 0) == 0) {
    const auto parts = split(spec.substr(11), ':');
    if (parts.size() != 2) throw fail("needs N and PENALTY");
    const double n = parse_number(parts[0], what), penalty = parse_number(parts[1], what);
    if (!(n >= 1) || n != std::floor(n) || n > 64) throw fail("needs a whole N in [1, 64]");
    if (penalty > 0) throw fail("needs PENALTY ≤ 0");
    const auto size = static_cast<size_t>(n);
    return {"repetition", [size, penalty](const std::vector<RewardInput>& in) {
              std::vector<std::optional<double>> out;
              for (const RewardInput& r : in) {
                const auto& ids = r.completion_ids;
                if (ids.size() < size) {
                  out.push_back(0.0);
                  continue;
                }
                std::set<std::vector<int64_t>> unique;
                const size_t total = ids.size() - size + 1;
                for (size_t i = 0; i < total; ++i)
                  unique.emplace(ids.begin() + static_cast<std::ptrdiff_t>(i),
                                 ids.begin() + static_cast<std::ptrdiff_t>(i + size));
                const double scaling =
                    1.0 - static_cast<double>(unique.size()) / static_cast<double>(total);
                out.push_back(scaling != 0 ? scaling * penalty : 0.0);
              }
              return out;
            }};
  }
  throw fail("is not a built-in reward");
}

}  // namespace zt

namespace zt::train {

namespace {

// `error` again with `message`, its class kept: a host's cancel or bad argument stays one.
[[noreturn]] void rethrow_as(const std::exception& error, const std::string& message) {
  if (dynamic_cast<const CancelledError*>(&error)) throw CancelledError(message);
  if (dynamic_cast<const InvalidArgument*>(&error)) throw InvalidArgument(message);
  if (dynamic_cast<const ConfigError*>(&error)) throw ConfigError(message);
  if (dynamic_cast<const IoError*>(&error)) throw IoError(message);
  if (dynamic_cast<const DistributedError*>(&error)) throw DistributedError(message);
  if (dynamic_cast<const OutOfMemoryError*>(&error)) throw OutOfMemoryError(message);
  if (dynamic_cast<const NumericError*>(&error)) throw NumericError(message);
  throw Error(message);
}

}  // namespace

at::Tensor score_completions(const std::vector<RewardFunction>& functions,
                             const std::vector<RewardInput>& inputs, int64_t num_generations) {
  const auto n = static_cast<int64_t>(inputs.size());
  const auto f = static_cast<int64_t>(functions.size());
  if (f == 0) throw ConfigError("reward_funcs: GRPO needs at least one reward function");
  at::Tensor out = at::empty({n, f}, at::kDouble);
  double* o = out.data_ptr<double>();
  const int64_t g = std::max<int64_t>(1, num_generations);
  for (int64_t j = 0; j < f; ++j) {
    const RewardFunction& fn = functions[static_cast<size_t>(j)];
    std::vector<std::optional<double>> r;
    try {
      r = fn.fn(inputs);
    } catch (const std::exception& e) {
      rethrow_as(e, fmt::format("reward function '{}' failed on a batch of {} completions: {}",
                                fn.name, n, e.what()));
    }
    if (static_cast<int64_t>(r.size()) != n) {
      throw InvalidArgument(fmt::format(
          "reward function '{}' returned {} rewards for {} completions (one each, or None)",
          fn.name, r.size(), n));
    }
    for (int64_t i = 0; i < n; ++i) {
      const auto& v = r[static_cast<size_t>(i)];
      if (v && !std::isfinite(*v)) {
        throw InvalidArgument(fmt::format(
            "reward function '{}' returned {} for completion {} (prompt {} of the batch): a "
            "reward is a finite number, or None to leave the completion unscored",
            fn.name, *v, i, i / g));
      }
      o[i * f + j] = v ? *v : NAN;
    }
  }
  return out;
}

}  // namespace zt::train
