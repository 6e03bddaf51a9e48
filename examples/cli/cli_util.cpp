// Small helpers of the `zerotrain` program.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "commands.hpp"
#include "zerotrain/error.hpp"

namespace zt::cli {

std::string self_path() {
  char buf[4096] = {0};
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw InvalidArgument("cannot resolve /proc/self/exe");
  return std::string(buf, static_cast<size_t>(n));
}

long parse_integer(const std::string& flag, const std::string& text, long min, long max) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE || v < min || v > max) {
    throw ConfigError("--" + flag + ": expected an integer in [" + std::to_string(min) + ", " +
                      std::to_string(max) + "], found \"" + text + "\"");
  }
  return v;
}

bool wants_help(const Args& args) {
  for (const std::string& a : args) {
    if (a == "--") return false;  // what follows belongs to another program (launch)
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

std::optional<std::string> take_option(Args& args, const std::string& name) {
  const std::string flag = "--" + name;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == flag) {
      if (i + 1 >= args.size()) throw ConfigError(flag + " needs a value");
      std::string value = args[i + 1];
      args.erase(args.begin() + static_cast<long>(i), args.begin() + static_cast<long>(i) + 2);
      return value;
    }
    if (args[i].rfind(flag + "=", 0) == 0) {
      std::string value = args[i].substr(flag.size() + 1);
      args.erase(args.begin() + static_cast<long>(i));
      return value;
    }
  }
  return std::nullopt;
}

bool take_switch(Args& args, const std::string& name) {
  const auto end = std::remove(args.begin(), args.end(), "--" + name);
  const bool found = end != args.end();
  args.erase(end, args.end());
  return found;
}

std::vector<std::pair<double, double>> pair_log_probs(CausalLM& model, const Dataset& pairs,
                                                      int32_t pad_id, int64_t batch) {
  at::NoGradGuard no_grad;
  model.eval();
  std::vector<std::pair<double, double>> out;
  const int64_t n = pairs.size() / 2;
  for (int64_t lo = 0; lo < n; lo += batch) {
    std::vector<int64_t> rows;
    for (int64_t p = lo; p < std::min(n, lo + batch); ++p) rows.push_back(2 * p);
    for (int64_t p = lo; p < std::min(n, lo + batch); ++p) rows.push_back(2 * p + 1);
    const Batch b = collate(pairs, rows, pad_id);
    const at::Tensor lp = model.label_log_probs(b.input_ids, b.labels).sum(1).to(at::kDouble);
    const int64_t k = static_cast<int64_t>(rows.size()) / 2;
    for (int64_t i = 0; i < k; ++i)
      out.emplace_back(lp[i].item<double>(), lp[k + i].item<double>());
  }
  return out;
}

}  // namespace zt::cli
