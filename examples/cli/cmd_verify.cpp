// zerotrain verify MODEL_DIR --prompt "..." [--template T | --raw] [--max_new_tokens N]: load a
// model folder (or a LoRA / prompt adapter folder over its base) and generate — the seed's habit
// of checking every checkpoint by asking it something.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>

#include <fmt/format.h>

#include "commands.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/tokenizer.hpp"

namespace zt::cli {

namespace {

constexpr const char* kUsage =
    "usage: zerotrain verify MODEL_DIR (--prompt \"...\" | --compare PAIRS.jsonl) "
    "[--template NAME | --raw] [--max_new_tokens N] [--base_model DIR]\n\n"
    "Loads an HF model folder (or a PEFT adapter folder over its base model) and generates a "
    "reply.\n"
    "  --template NAME     the prompt template (default: the one the run recorded in MODEL_DIR,\n"
    "                      else the model's own chat format, else alpaca_zh; a run whose\n"
    "                      records no template formatted recorded raw: --raw)\n"
    "  --raw               send the prompt as it is, without a template\n"
    "  --max_new_tokens N  at most N new tokens [default: 64]\n"
    "  --base_model DIR    an adapter's base model folder, in place of the one its\n"
    "                      adapter_config.json names\n"
    "  --compare PAIRS     instead of generating, score preference pairs (docs/preference.md):\n"
    "                      how often the model finds the chosen answer more likely than the\n"
    "                      rejected one, and for an adapter how often its reward (log-prob\n"
    "                      gain over the model the run started from, its DPO reference) is\n"
    "                      larger\n"
    "An adapter folder is scored as the run trained it: over its 4-bit base when it had one,\n"
    "PiSSA over the residual its saved start (pissa_init/) leaves.\n";

// --compare: the pairs of `path` tokenized as training tokenizes them (the template the run
// recorded, else the model's own), scored by the model and, for an adapter, by the model the
// run started from (its reference in preference training).
int compare_pairs(TrainedModel& trained, const Tokenizer& tok, const std::string& path,
                  const std::optional<std::string>& template_name, const std::string& dir) {
  CausalLM& model = *trained.model;
  const std::string& model_dir = trained.base_dir;
  DataOptions o;
  o.preference = true;
  o.max_length = model.config().max_position_embeddings;
  // A run that applied no template trained on text pairs, which no template formats.
  std::string name = template_name ? *template_name : recorded_template(dir).value_or("auto");
  if (name == kRawTemplate) name = "auto";
  o.template_name = resolve_template(name, model_dir, tok);
  const Dataset pairs = tokenize_preference_jsonl(path, tok, o);
  const int32_t pad = tok.pad_id() >= 0 ? tok.pad_id() : std::max(0, tok.eos_id());
  const std::vector<std::pair<double, double>> policy = pair_log_probs(model, pairs, pad);
  const double n = static_cast<double>(policy.size());
  int prefers = 0;
  double margin = 0;
  for (const auto& [c, r] : policy) {
    prefers += c > r;
    margin += c - r;
  }
  std::printf(
      "%zu pairs of %s (template %s): the model prefers the chosen answer in %.1f%% "
      "(mean log-prob margin %.3f)\n",
      policy.size(), path.c_str(), o.template_name.c_str(), 100.0 * prefers / n, margin / n);
  if (trained.adapter) {
    // The start: its values swapped in (and back), the adapters off where it is the base.
    swap_parameter_values(model, trained.start);
    model.set_adapters_enabled(!trained.start_adapters_off);
    std::vector<std::pair<double, double>> base;
    try {
      base = pair_log_probs(model, pairs, pad);
    } catch (...) {
      model.set_adapters_enabled(true);
      swap_parameter_values(model, trained.start);
      throw;
    }
    model.set_adapters_enabled(true);
    swap_parameter_values(model, trained.start);
    int accurate = 0;
    double reward_margin = 0;
    for (size_t i = 0; i < policy.size(); ++i) {
      const double m = (policy[i].first - base[i].first) - (policy[i].second - base[i].second);
      accurate += m > 0;
      reward_margin += m;
    }
    std::printf(
        "against its start (%s): rewards/accuracies %.1f%%, mean reward margin %.3f (beta 1)\n",
        trained.start_description.c_str(), 100.0 * accurate / n, reward_margin / n);
  }
  return 0;
}

}  // namespace

int cmd_verify(const Args& in) {
  if (wants_help(in)) {
    std::printf("%s", kUsage);
    return 0;
  }
  Args args = in;
  std::optional<std::string> prompt = take_option(args, "prompt");
  std::optional<std::string> template_name = take_option(args, "template");
  const std::optional<std::string> compare = take_option(args, "compare");
  const std::string base_model = take_option(args, "base_model").value_or("");
  const std::string max_text = take_option(args, "max_new_tokens").value_or("64");
  char* end = nullptr;
  errno = 0;
  const long max_new = std::strtol(max_text.c_str(), &end, 10);
  if (max_text.empty() || *end != '\0' || errno == ERANGE || max_new < 1 || max_new > (1L << 20)) {
    throw ConfigError(fmt::format("--max_new_tokens: expected an integer in [1, {}], found \"{}\"",
                                  1L << 20, max_text));
  }
  const bool raw = take_switch(args, "raw");
  if (args.size() != 1 || !prompt == !compare)
    throw ConfigError(std::string(kUsage).substr(0, std::string(kUsage).find('\n')));
  std::string dir = args[0];
  const ReadLock reading(dir);  // a checkpoint being read is kept by rotation
  // The model the run trained, as it trained it: its 4-bit base, PiSSA's saved start, ...
  TrainedModel trained = load_trained_model(dir, base_model);
  CausalLM& model = *trained.model;
  const ModelConfig& config = model.config();
  const bool adapter = trained.adapter;
  const std::string& base = trained.base_dir;
  std::shared_ptr<Tokenizer> tok = load_tokenizer(base, config.vocab_size);
  check_tokenizer_fits(*tok, config.vocab_size);
  if (compare) return compare_pairs(trained, *tok, *compare, template_name, dir);
  std::vector<int32_t> ids;
  std::string text = *prompt;
  // What the run trained with, as it recorded it; else what training would pick now. A run whose
  // records no template formatted (plain text, token ids) recorded "raw": prompts as they are.
  std::string name = template_name ? *template_name : recorded_template(dir).value_or("auto");
  if (raw || name == kRawTemplate) {
    ids = tok->encode(text);
    const std::vector<int32_t> prefix = tok->prefix_ids();
    ids.insert(ids.begin(), prefix.begin(), prefix.end());
  } else {
    name = resolve_template(name, adapter ? base : dir, *tok);
    text = render_prompt(name, *prompt);
    ids = encode_prompt(name, *tok, *prompt);
  }
  if (ids.empty()) {
    throw ConfigError(
        "the prompt gives no tokens (an empty prompt, and the tokenizer adds no BOS token): "
        "generation needs at least one; give a non-empty --prompt");
  }
  // The model's context bounds prompt + reply (a longer one would ask attention for memory no
  // machine has).
  if (static_cast<int64_t>(ids.size()) + max_new > config.max_position_embeddings) {
    throw ConfigError(fmt::format(
        "the prompt is {} tokens; with --max_new_tokens {} that is beyond the model's context "
        "of {} tokens (max_position_embeddings); shorten the prompt",
        ids.size(), max_new, config.max_position_embeddings));
  }
  at::Tensor input =
      at::tensor(std::vector<int64_t>(ids.begin(), ids.end()), at::kLong).unsqueeze(0);
  GenerationOptions g;
  g.max_new_tokens = max_new;
  if (tok->eos_id() >= 0) g.eos_token_ids = {tok->eos_id()};
  if (config.eos_token_id && *config.eos_token_id != tok->eos_id())
    g.eos_token_ids.push_back(*config.eos_token_id);
  at::NoGradGuard no_grad;
  at::Tensor out = model.generate(input, g)[0].contiguous();
  std::vector<int32_t> new_ids(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel());
  std::printf("%s%s\n", text.c_str(), tok->decode(new_ids).c_str());
  return 0;
}

}  // namespace zt::cli
