// GRPO steps (stage grpo): the options check, and Trainer::train_grpo_step — generation with
// the weights being trained, rewards, group-relative advantages and the clipped policy loss
// over micro-batches (train/grpo.hpp has the formulas, train/rewards.hpp the rewards).
#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "config/training_options.hpp"
#include "data/chat_templates.hpp"
#include "model/blocks.hpp"
#include "model/sampling.hpp"
#include "train/grpo.hpp"
#include "train/objective.hpp"
#include "train/reward_process.hpp"
#include "train/rewards.hpp"
#include "train/trainer_impl.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"

namespace zt {

namespace {

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a * 0x9E3779B97F4A7C15ULL ^ (b + 0x632BE59BD9B4E019ULL);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// The items of a comma list (none when it is empty): reward_funcs' specs, reward_weights.
std::vector<std::string> comma_items(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (!list.empty() && start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    out.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// reward_weights: a comma list of decimal numbers, one per reward function in their order
// (empty: all 1). With `more_to_come` (at creation, before the host adds its own functions) only
// fewer weights than `functions` is refused.
std::vector<double> parse_weights(const std::string& text, size_t functions,
                                  bool more_to_come = false) {
  std::vector<double> out;
  for (const std::string& item : comma_items(text)) {
    const std::optional<double> v = config::parse_double_text(item);  // decimal, as flags are
    if (!v) throw ConfigError(fmt::format("reward_weights: '{}' is not a decimal number", item));
    out.push_back(*v);
  }
  if (!out.empty() && (out.size() < functions || (out.size() > functions && !more_to_come))) {
    throw ConfigError(fmt::format(
        "reward_weights: {} weights for {} reward functions (reward_funcs, then reward_command, "
        "then the host's in the order it added them)",
        out.size(), functions));
  }
  return out;
}

// A column of a prompt row as the rewards see it: strings as they are, anything else as JSON.
std::string column_text(const rapidjson::Value& v) {
  return v.IsString() ? std::string(v.GetString(), v.GetStringLength()) : json::dump(v);
}

}  // namespace

std::vector<GrpoPrompt> read_grpo_prompts(const std::string& path, const Tokenizer& tokenizer,
                                          const std::string& template_name,
                                          int64_t max_prompt_length, int64_t max_tokens,
                                          int64_t* dropped) {
  // A regular file only (never a FIFO, device or folder), read whole: prompt files are small.
  const std::string text = files::read_text(path, "GRPO prompts", files::kMaxTokenizerBytes);
  std::vector<GrpoPrompt> prompts;
  int64_t number = 0;
  if (dropped != nullptr) *dropped = 0;
  for (size_t at = 0; at < text.size();) {
    size_t eol = text.find('\n', at);
    if (eol == std::string::npos) eol = text.size();
    const std::string line = text.substr(at, eol - at);
    at = eol + 1;
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("'{}' line {}", path, number);
    const rapidjson::Document row = json::parse(line, where);
    if (!row.IsObject() || !row.HasMember("prompt")) {
      throw ConfigError(fmt::format(
          "{}: a GRPO row is an object with a \"prompt\" (text, or a list of messages as TRL's "
          "conversational prompts), and any other columns for the rewards",
          where));
    }
    const rapidjson::Value& p = row["prompt"];
    std::vector<int32_t> ids;
    if (p.IsString()) {
      // TRL's standard prompts: the text as it is, no special tokens added.
      ids = tokenizer.encode(std::string_view(p.GetString(), p.GetStringLength()));
    } else if (p.IsArray()) {
      data::Chat chat;
      for (const auto& m : p.GetArray()) {
        if (!m.IsObject() || !m.HasMember("role") || !m["role"].IsString() ||
            !m.HasMember("content") || !m["content"].IsString()) {
          throw ConfigError(fmt::format(
              "{}: \"prompt\" messages are objects with a string \"role\" and \"content\"", where));
        }
        const std::string role = m["role"].GetString();
        const std::string content = m["content"].GetString();
        if (role == "system" && chat.messages.empty() && !chat.system) {
          chat.system = content;
        } else if (role == "user" || role == "assistant") {
          chat.messages.push_back({role, content, ""});
        } else {
          throw ConfigError(fmt::format(
              "{}: message role '{}': system (first), then user and assistant", where, role));
        }
      }
      if (chat.messages.empty() || chat.messages.back().role != "user") {
        throw ConfigError(fmt::format(
            "{}: a conversational prompt ends with a user message (the completion answers it)",
            where));
      }
      // apply_chat_template(add_generation_prompt=True), encoded as one text.
      const data::ChatTemplate& t = data::chat_template(template_name);
      const std::string text = t.prompt(chat);
      ids = tokenizer.encode(text);
      if (!t.whole_text()) {
        const std::vector<int32_t> prefix = tokenizer.prefix_ids();
        ids.insert(ids.begin(), prefix.begin(), prefix.end());
      }
    } else {
      throw ConfigError(fmt::format("{}: \"prompt\" is {}; expected text or a list of messages",
                                    where, json::type_name(p)));
    }
    if (max_prompt_length > 0 && static_cast<int64_t>(ids.size()) > max_prompt_length) {
      // TRL ≤ 0.28: a prompt keeps its last max_prompt_length tokens.
      ids.erase(ids.begin(), ids.end() - max_prompt_length);
    }
    if (ids.empty()) continue;
    if (max_tokens > 0 && static_cast<int64_t>(ids.size()) > max_tokens) {
      if (dropped != nullptr) ++*dropped;
      continue;
    }
    GrpoPrompt g;
    g.ids.assign(ids.begin(), ids.end());
    for (auto it = row.MemberBegin(); it != row.MemberEnd(); ++it) {
      const std::string name(it->name.GetString(), it->name.GetStringLength());
      if (name != "prompt") g.columns[name] = column_text(it->value);
    }
    prompts.push_back(std::move(g));
  }
  return prompts;
}

namespace train {

namespace {

// Mixed into an evaluation's sampling seed, so that its draws are not a training step's.
constexpr uint64_t kEvaluationDraws = 0x6576616c75617465ULL;  // "evaluate"

// Completions [first, first + count) of a generation batch as one micro-batch: each prompt
// (`rows`) and its completion right-padded with `pad` to the longest, the completion's tokens
// labelled (none of a truncated one's with `mask_truncated`). The ids on `device`, the labels
// on the host.
std::pair<at::Tensor, at::Tensor> completion_batch(const std::vector<std::vector<int64_t>>& rows,
                                                   const std::vector<Generated>& done,
                                                   int64_t first, int64_t count,
                                                   bool mask_truncated, int64_t pad,
                                                   const at::Device& device) {
  int64_t width = 0;
  for (int64_t i = first; i < first + count; ++i) {
    const auto c = static_cast<size_t>(i);
    width = std::max<int64_t>(width, static_cast<int64_t>(rows[c].size() + done[c].tokens.size()));
  }
  at::Tensor ids = at::full({count, width}, pad, at::kLong);
  at::Tensor labels = at::full({count, width}, kIgnoreLabel, at::kLong);
  for (int64_t b = 0; b < count; ++b) {
    const auto c = static_cast<size_t>(first + b);
    const auto& p = rows[c];
    const auto& t = done[c].tokens;
    const auto np = static_cast<int64_t>(p.size()), nt = static_cast<int64_t>(t.size());
    ids[b].narrow(0, 0, np).copy_(at::tensor(p, at::kLong));
    if (nt == 0) continue;
    ids[b].narrow(0, np, nt).copy_(at::tensor(t, at::kLong));
    if (done[c].stopped || !mask_truncated)
      labels[b].narrow(0, np, nt).copy_(at::tensor(t, at::kLong));
  }
  return {ids.to(device), labels};
}

// A mean and sample standard deviation (torch.std's n − 1) from a sum, a sum of squares and a
// count: NaN where they are undefined.
std::pair<double, double> reward_mean_std(double sum, double squares, double n) {
  const double mean = n > 0 ? sum / n : NAN;
  const double var = n > 1 ? (squares - n * mean * mean) / (n - 1) : NAN;
  return {mean, std::sqrt(std::max(0.0, var))};
}

// TRL's reward and completion metrics from the sums over every rank's completions (as
// sample_and_score lays them out: the reward's sum, squares and count, the same for each
// function, then lengths, terminated count, terminated lengths, counted tokens and the groups
// of zero std) and the extremes (−min length, max length, −min and max terminated length), of
// `completions` completions.
std::map<std::string, double> completion_metrics(const std::vector<double>& global,
                                                 const std::vector<double>& extremes,
                                                 const std::vector<RewardFunction>& rewards,
                                                 double completions, const std::string& scale) {
  std::map<std::string, double> m;
  const auto [reward_mean, reward_std] = reward_mean_std(global[0], global[1], global[2]);
  m["reward"] = reward_mean;
  m["reward_std"] = reward_std;
  const size_t f = rewards.size();
  for (size_t j = 0; j < f; ++j) {
    const auto [mean, std] =
        reward_mean_std(global[3 + 3 * j], global[4 + 3 * j], global[5 + 3 * j]);
    m["rewards/" + rewards[j].name + "/mean"] = mean;
    m["rewards/" + rewards[j].name + "/std"] = std;
  }
  const size_t k = 3 + 3 * f;
  const double all_terminated = global[k + 1];
  m["completions/mean_length"] = global[k] / completions;
  m["completions/min_length"] = -extremes[0];
  m["completions/max_length"] = extremes[1];
  m["completions/clipped_ratio"] = 1.0 - all_terminated / completions;
  m["completions/mean_terminated_length"] =
      all_terminated > 0 ? global[k + 2] / all_terminated : 0.0;
  m["completions/min_terminated_length"] = all_terminated > 0 ? -extremes[2] : 0.0;
  m["completions/max_terminated_length"] = all_terminated > 0 ? extremes[3] : 0.0;
  m["frac_reward_zero_std"] =
      scale == "batch" ? (reward_std == 0.0 ? 1.0 : 0.0) : global[k + 4] / completions;
  return m;
}

// Stage grpo: each step trains on completions sampled for its prompts (a generation batch feeds
// cycle_steps() steps), through train_step; the window averages each metric over the steps
// that gave it (TRL's).
class GrpoObjective final : public Objective {
 public:
  /// Checks the loss's and the sampling's options, and what GRPO does not run with yet
  /// (ConfigError naming the option); the reward functions' specs, before any weight is read.
  explicit GrpoObjective(Trainer::Impl& trainer);
  const char* sample_name() const override { return "completions"; }
  bool uses_reference() const override { return options_.beta != 0.0; }
  /// When a run starts: at least one reward function, the same count on every rank, and
  /// reward_weights one per function. Collective.
  void check_ready() override;
  /// The prompts of train_file (read by every rank), and the reward functions reward_funcs and
  /// reward_command name.
  bool load_own_data() override;
  void check_global_batch() const override { generation_slices(); }
  /// A generation batch holds the prompts of steps_per_generation micro-batches and feeds
  /// cycle_steps() steps, num_iterations times each slice (TRL repeats its prompts so).
  int64_t steps_per_epoch(bool drop_last) const override {
    return zt::steps_per_epoch(t_.train_samples, t_.batch.size() * generation_slices(), drop_last) *
           cycle_steps();
  }

  // An order of the prompts, each standing for its num_generations completions.
  std::vector<int64_t> epoch_order(int64_t epoch, bool shuffle, int64_t megabatch) const override {
    (void)megabatch;
    return zt::epoch_order(t_.train_samples / options_.num_generations, t_.data_seed, epoch,
                           shuffle, nullptr, 0);
  }

  Trainer::Impl::StepResult step(const std::vector<int64_t>& order) override;

  LossSum forward(const std::vector<int64_t>& samples, Split split) override {
    (void)samples;
    (void)split;
    throw InvalidArgument(
        "stage grpo scores completions it samples for prompts: it has no forward over stored "
        "samples (its evaluation samples too: evaluate)");
  }

  std::map<std::string, double> take_window_metrics() override {
    std::map<std::string, double> out;
    for (const auto& [name, sum] : sums_) out[name] = sum / static_cast<double>(counts_[name]);
    sums_.clear();
    counts_.clear();
    return out;
  }

  /// The evaluation prompts, num_generations completions each, sampled and scored in batches
  /// of per_device_eval_batch_size completions a rank; the loss at ratio 1 (TRL's evaluation)
  /// and the metrics over the whole evaluation set. Collective.
  double evaluate() override;
  std::map<std::string, double> evaluation_metrics() const override { return eval_metrics_; }

  void check_token_steps() const override {
    throw InvalidArgument(
        "train_step: a run with stage grpo trains on completions it samples for prompts, not "
        "next-token losses: train() from train_file, or give its prompts to train_grpo_step");
  }

  /// Trainer::train_grpo_step's work. `cycle_step`: the step's place in its generation cycle
  /// when train() knows it (a run resumed mid-cycle), else −1.
  GrpoStepStats train_step(const std::vector<GrpoPrompt>& prompts,
                           const std::vector<RewardFunction>& rewards, int64_t cycle_step = -1);
  /// Trainer::add_reward's work.
  void add_reward(RewardFunction reward);

 private:
  /// A generation batch's completions on this rank, sampled and scored.
  struct Scored {
    std::vector<std::vector<int64_t>> rows;  ///< a prompt per completion
    std::vector<Generated> done;
    at::Tensor rewards;     ///< [completions] fp64 (CPU), NaN where no function scored
    at::Tensor advantages;  ///< [completions] fp64 (CPU)
    std::vector<std::string> completions;  ///< decoded
    /// TRL's reward and completion metrics over every rank's completions (reward, reward_std,
    /// rewards/<name>/mean and /std, completions/*, frac_reward_zero_std).
    std::map<std::string, double> metrics;
    int64_t counted_tokens = 0;  ///< the loss's tokens over every rank's completions
    /// What the metrics come from (completion_metrics), over every rank's completions.
    std::vector<double> sums, extremes;
  };
  /// Samples num_generations completions of each of `prompts` (generation options seeded with
  /// `seed`, completion c drawing from `streams[c]`) with the weights being trained, without
  /// dropout, the units held gathered under ZeRO-3; scores them with `rewards` (weighted by
  /// `weights`) and forms their advantages. `global_completions`: every rank's completions;
  /// with `counts` false this rank only takes part (its completions count in no metric).
  /// Collective.
  Scored sample_and_score(const std::vector<GrpoPrompt>& prompts,
                          const std::vector<RewardFunction>& rewards,
                          const std::vector<double>& weights, uint64_t seed,
                          const std::vector<uint64_t>& streams, int64_t global_completions,
                          bool counts);

 private:
  /// Optimizer steps one generation batch feeds: steps_per_generation ÷ the accumulation steps
  /// (its slices), and the steps of the cycle, slices × num_iterations. ConfigError when
  /// steps_per_generation is no multiple of the accumulation steps.
  int64_t generation_slices() const;
  int64_t cycle_steps() const { return generation_slices() * t_.args.num_iterations; }

  GrpoOptions options_;
  GenerationOptions sampling_;
  std::vector<GrpoPrompt> prompts_, eval_prompts_;
  std::vector<RewardFunction> rewards_;
  std::map<std::string, double> eval_metrics_;  ///< the last evaluation's, "eval_" names
  /// The generation batch that later steps train on (TRL's buffered inputs): made by the step
  /// that generates, it feeds cycle_steps() optimizer steps.
  struct Buffer;
  std::shared_ptr<Buffer> buffer_;
  /// The GRPO metrics of the logging window's steps, summed, and the steps that gave each.
  std::map<std::string, double> sums_;
  std::map<std::string, int64_t> counts_;
};

GrpoObjective::GrpoObjective(Trainer::Impl& trainer) : Objective(trainer) {
  Trainer::Impl& I = t_;
  const TrainingArguments& args = I.args;
  const ModelConfig& model_config = I.model_config;
  GrpoOptions& o = options_;
  const bool loss_given = args.is_given("pref_loss") || args.is_given("loss_type");
  o.loss_type = loss_given ? args.pref_loss : "dapo";  // TRL's default
  const bool beta_given = args.is_given("pref_beta") || args.is_given("beta");
  o.beta = beta_given ? args.pref_beta : 0.0;  // TRL's default: no reference model
  o.num_generations = args.num_generations;
  o.epsilon = args.epsilon;
  o.epsilon_high = args.epsilon_high.value_or(args.epsilon);
  o.delta = args.delta;
  o.importance_sampling_level = args.importance_sampling_level;
  o.scale_rewards = args.scale_rewards == "true"    ? "group"
                    : args.scale_rewards == "false" ? "none"
                                                    : args.scale_rewards;
  o.max_completion_length = args.max_completion_length;
  o.mask_truncated_completions = args.mask_truncated_completions;
  o.sapo_temperature_pos = args.sapo_temperature_pos;
  o.sapo_temperature_neg = args.sapo_temperature_neg;
  o.use_bias_correction_kl = args.use_bias_correction_kl;
  check_grpo_options(o);
  const auto refuse = [&](const std::string& what) {
    throw ConfigError(fmt::format("stage grpo: {} (docs/grpo.md)", what));
  };
  if (model_config.expert_shard.size > 1) {
    refuse("expert parallelism: generation does not drive the mixtures' all-to-all yet");
  }
  if (model::decoder_spec(model_config).router_aux_coef) {
    refuse("output_router_logits: the load-balancing loss is added to the sft loss only");
  }
  if (args.packing) refuse("packing: completions are scored per sequence; train without packing");
  if (args.precompute_ref_log_probs.value_or(false)) {
    refuse(
        "precompute_ref_log_probs: completions are new each step, so their reference "
        "log-probs cannot be computed before training");
  }
  if (args.temperature != 1.0 && model::decoder_spec(model_config).logit_softcap) {
    refuse(
        fmt::format("temperature {}: a model with final_logit_softcapping scores completions "
                    "at temperature 1 only so far",
                    args.temperature));
  }
  GenerationOptions& sampling = sampling_;
  sampling = GenerationOptions{};
  sampling.do_sample = true;
  sampling.temperature = args.temperature;
  sampling.top_p = args.top_p;
  sampling.top_k = args.top_k;
  sampling.min_p = args.min_p;
  sampling.repetition_penalty = args.repetition_penalty;
  sampling.max_new_tokens = args.max_completion_length;
  if (I.tokenizer->eos_id() >= 0) sampling.eos_token_ids.push_back(I.tokenizer->eos_id());
  if (model_config.eos_token_id && *model_config.eos_token_id != I.tokenizer->eos_id())
    sampling.eos_token_ids.push_back(*model_config.eos_token_id);
  try {
    const std::vector<std::string> stops = StopStrings::parse(args.stop_strings);
    if (!stops.empty()) {
      sampling.stop_strings =
          std::make_shared<StopStrings>(stops, StopStrings::token_texts(*I.tokenizer));
    }
    model::check_generation_options(sampling);
  } catch (const InvalidArgument& e) {
    throw ConfigError(e.what());
  }
  if (!args.reward_funcs.empty() || !args.reward_command.empty()) {
    // The specs are checked now, before any weight is read.
    size_t count = args.reward_command.empty() ? 0 : 1;
    for (const std::string& spec : comma_items(args.reward_funcs)) {
      builtin_reward(spec, "reward_funcs");
      ++count;
    }
    // More weights than these may be for the host's functions (checked when the run starts).
    parse_weights(args.reward_weights, count, /*more_to_come=*/true);
  }
}

bool GrpoObjective::load_own_data() {
  Trainer::Impl& I = t_;
  const TrainingArguments& args = I.args;
  const ModelConfig& model_config = I.model_config;
  // Without either file the host gives its prompts (Trainer::train_grpo_step).
  if (args.train_file.empty() && args.eval_file.empty()) return true;
  const int64_t g = options_.num_generations;
  const int64_t room = model_config.max_position_embeddings - options_.max_completion_length;
  const auto read = [&](const std::string& path, const char* what) {
    int64_t too_long = 0;
    std::vector<GrpoPrompt> prompts = read_grpo_prompts(path, *I.tokenizer, args.template_name,
                                                        args.max_prompt_length, room, &too_long);
    if (prompts.empty()) {
      throw ConfigError(
          fmt::format("'{}' has no prompt that fits: every prompt is empty or longer than "
                      "max_position_embeddings {} − max_completion_length {} tokens",
                      path, model_config.max_position_embeddings, options_.max_completion_length));
    }
    if (too_long > 0 && I.rank == 0) {
      log::warn(
          "'{}': {} prompts dropped, longer than max_position_embeddings {} − "
          "max_completion_length {} tokens (set max_prompt_length to keep their ends)",
          path, too_long, model_config.max_position_embeddings, options_.max_completion_length);
    }
    if (I.rank == 0) log::info("GRPO {}prompts '{}': {}", what, path, prompts.size());
    return prompts;
  };
  if (!args.train_file.empty()) {
    prompts_ = read(args.train_file, "");
    I.has_train = true;
    I.train_samples = static_cast<int64_t>(prompts_.size()) * g;
    I.train_rows = static_cast<int64_t>(prompts_.size());
  }
  if (!args.eval_file.empty()) {
    // An evaluation batch holds whole groups on each rank, as a generation batch does.
    if (args.per_device_eval_batch_size % g != 0) {
      throw ConfigError(fmt::format(
          "per_device_eval_batch_size {}: stage grpo evaluates whole groups of num_generations "
          "{} completions on each rank; set a multiple of {}",
          args.per_device_eval_batch_size, g, g));
    }
    eval_prompts_ = read(args.eval_file, "evaluation ");
    I.has_eval = true;
    I.eval_samples = static_cast<int64_t>(eval_prompts_.size()) * g;
  }
  // A run with neither is refused when it starts (check_ready): a host may still add its own
  // (Trainer::add_reward, zt_trainer_add_reward).
  for (const std::string& spec : comma_items(args.reward_funcs))
    rewards_.push_back(builtin_reward(spec));
  if (!args.reward_command.empty()) {
    rewards_.push_back(RewardProcess::function(args.reward_command, args.reward_timeout));
  }
  return true;
}

double GrpoObjective::evaluate() {
  Trainer::Impl& I = t_;
  at::NoGradGuard no_grad;
  const int64_t g = options_.num_generations;
  const int64_t per_rank = I.args.per_device_eval_batch_size / g;  // a rank's prompts a batch
  const int64_t per_batch = per_rank * I.world;
  const auto n = static_cast<int64_t>(eval_prompts_.size());
  const std::vector<double> weights = parse_weights(I.args.reward_weights, rewards_.size());
  // Draws of the evaluation's own, from the seed and the step: the same completions at any
  // world size, and the training's draws untouched.
  const uint64_t seed = mix(mix(static_cast<uint64_t>(I.args.seed), kEvaluationDraws),
                            static_cast<uint64_t>(I.state.global_step));
  const double temperature = I.args.temperature;
  const at::Device device = I.comm->device();
  std::vector<double> sums, extremes;  // completion_metrics's, over every batch
  // The loss's metric sums and numerator, this rank's, kept on the device.
  at::Tensor loss_sums = at::zeros({kGrpoSums + 1}, at::TensorOptions(at::kDouble).device(device));
  int64_t counted_tokens = 0;
  double micro_batches = 0;  // this rank's that count
  I.model->eval();
  for (int64_t first = 0; first < n; first += per_batch) {
    // This rank's prompts of the batch, rank-major; a rank with none left samples the batch's
    // first prompt only to take part in the collectives (ZeRO-3's gathers, the reductions).
    const int64_t begin = std::min(n, first + I.rank * per_rank);
    const int64_t count = std::min(per_rank, n - begin);
    const bool counts = count > 0;
    std::vector<GrpoPrompt> mine(eval_prompts_.begin() + begin,
                                 eval_prompts_.begin() + begin + count);
    if (!counts) mine.push_back(eval_prompts_[static_cast<size_t>(first)]);
    std::vector<uint64_t> streams;  // each completion's index in the whole evaluation
    for (int64_t c = 0; c < static_cast<int64_t>(mine.size()) * g; ++c) {
      streams.push_back(static_cast<uint64_t>(begin * g + c));
    }
    const int64_t batch_completions = std::min(per_batch, n - first) * g;
    Scored scored =
        sample_and_score(mine, rewards_, weights, seed, streams, batch_completions, counts);
    if (sums.empty()) {
      sums = scored.sums;
      extremes = scored.extremes;
    } else {
      for (size_t k = 0; k < sums.size(); ++k) sums[k] += scored.sums[k];
      for (size_t k = 0; k < extremes.size(); ++k)
        extremes[k] = std::max(extremes[k], scored.extremes[k]);
    }
    counted_tokens += scored.counted_tokens;
    // The loss as TRL evaluates it: the policy's own log-probs as the sampling policy's (ratio
    // 1), this rank's completions as one micro-batch.
    const auto [ids, labels] =
        completion_batch(scored.rows, scored.done, 0, static_cast<int64_t>(scored.rows.size()),
                         options_.mask_truncated_completions, I.pad_id, device);
    GrpoInputs in;
    in.logps =
        I.model->label_log_probs(ids, labels, {}, 1024, {}, nullptr, temperature, &in.entropies);
    in.mask = labels.ne(kIgnoreLabel).to(at::kFloat).to(device);
    in.advantages = scored.advantages.to(at::kFloat).to(device);
    if (options_.beta != 0.0) in.ref_logps = reference_token_log_probs(ids, labels, temperature);
    const GrpoLoss l = grpo_loss(options_, in);
    if (counts) {
      loss_sums.narrow(0, 0, kGrpoSums) += l.sums;
      loss_sums[kGrpoSums] += l.numerator.to(at::kDouble);
      micro_batches += 1;
    }
  }
  I.model->train();
  const at::Tensor host = loss_sums.to(at::kCPU);
  std::vector<double> local(host.data_ptr<double>(), host.data_ptr<double>() + kGrpoSums + 1);
  local.push_back(micro_batches);
  const std::vector<double> all = comm::reduce_scalars(*I.comm, local);
  GrpoStepCounts whole;  // the evaluation as one generation batch
  whole.completions = n * g;
  whole.micro_batches = static_cast<int64_t>(all.back());
  whole.generation_tokens = counted_tokens;
  const double loss = all[kGrpoSums] / grpo_divisor(options_, whole);
  std::map<std::string, double> metrics = completion_metrics(
      sums, extremes, rewards_, static_cast<double>(n * g), options_.scale_rewards);
  for (const auto& [name, value] : grpo_metrics(
           options_, std::vector<double>(all.begin(), all.begin() + kGrpoSums), true, "")) {
    metrics[name] = value;
  }
  eval_metrics_.clear();
  for (const auto& [name, value] : metrics) eval_metrics_["eval_" + name] = value;
  return loss;
}

int64_t GrpoObjective::generation_slices() const {
  const int64_t k = t_.args.steps_per_generation, a = t_.batch.accumulation;
  if (k == 0) return 1;  // TRL's default: gradient_accumulation_steps
  if (a <= 0 || k % a != 0) {
    throw ConfigError(fmt::format(
        "steps_per_generation {}: a multiple of gradient_accumulation_steps {}, so that a "
        "generation batch feeds whole optimizer steps (docs/grpo.md)",
        k, a));
  }
  return k / a;
}

void GrpoObjective::check_ready() {
  const auto count = static_cast<double>(rewards_.size());
  // Every rank scores with the same functions: the metrics are reduced function by function.
  const std::vector<double> most = comm::reduce_scalars(*t_.comm, {count, -count}, ReduceOp::kMax);
  if (most[0] != count || -most[1] != count) {
    throw InvalidArgument(fmt::format(
        "stage grpo: rank {} has {} reward functions, but the ranks have from {} to {}: every "
        "rank adds the same ones, in the same order",
        t_.rank, rewards_.size(), -most[1], most[0]));
  }
  if (rewards_.empty()) {
    throw ConfigError(
        "reward_funcs: stage grpo from train_file needs reward functions, e.g. --reward_funcs "
        "accuracy,think_format (docs/grpo.md lists the built-ins), a reward_command, or the "
        "host's own (Trainer::add_reward, zt_trainer_add_reward)");
  }
  parse_weights(t_.args.reward_weights, rewards_.size());
}

void GrpoObjective::add_reward(RewardFunction reward) {
  // The name is a metric's key (rewards/<name>/mean in the logs, TensorBoard and JSON files).
  const bool plain = std::all_of(reward.name.begin(), reward.name.end(), [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) || std::strchr("_-.:", ch) != nullptr;
  });
  if (reward.name.empty() || reward.name.size() > 64 || !plain) {
    const bool printable = std::all_of(reward.name.begin(), reward.name.end(),
                                       [](char ch) { return ch >= 0x20 && ch < 0x7f; });
    throw InvalidArgument(fmt::format(
        "add_reward: the reward function name {} is not 1 to 64 letters, digits, '_', '-', '.' "
        "or ':' (it names the metrics rewards/<name>/mean and /std)",
        printable && reward.name.size() <= 80 ? "'" + reward.name + "'"
                                              : fmt::format("of {} bytes", reward.name.size())));
  }
  if (!reward.fn) {
    throw InvalidArgument(
        fmt::format("add_reward: reward function '{}' has no function to call", reward.name));
  }
  for (const RewardFunction& r : rewards_) {
    if (r.name == reward.name) {
      throw InvalidArgument(
          fmt::format("add_reward: a reward function named '{}' is already there (its metrics are "
                      "rewards/{}/mean and /std): give each its own name",
                      reward.name, reward.name));
    }
  }
  rewards_.push_back(std::move(reward));
}

Trainer::Impl::StepResult GrpoObjective::step(const std::vector<int64_t>& order) {
  Trainer::Impl& I = t_;
  const int64_t g = options_.num_generations;
  const int64_t n = static_cast<int64_t>(order.size());
  const int64_t s = I.state.steps_in_epoch;
  // A generation batch's prompts: the prompts of generation_slices() steps in order (wrapping to
  // the epoch's start when they run out), each step's rank-major; a rank takes its share of every
  // step's, step by step. The cycle_steps() steps in a row that it feeds take the same prompts
  // (the first generates).
  const int64_t cycle = cycle_steps();
  const int64_t per_step = I.batch.size() / g;  // prompts
  const int64_t per_generation = per_step * generation_slices();
  const int64_t per_rank = per_step / I.world;
  const int64_t batch_index = s / cycle;
  // A cycle's first step generates, whatever is buffered: a run resumed inside a cycle
  // generated anew for its rest, and that buffer must not outlive the cycle.
  if (s % cycle == 0) buffer_.reset();
  std::vector<GrpoPrompt> mine;
  int64_t prompt_tokens = 0;
  for (int64_t q = 0; q < per_generation; ++q) {
    const GrpoPrompt& p = prompts_[static_cast<size_t>(
        order[static_cast<size_t>((batch_index * per_generation + q) % n)])];
    prompt_tokens += static_cast<int64_t>(p.ids.size()) * g;
    if ((q % per_step) / per_rank == I.rank) mine.push_back(p);
  }
  const GrpoStepStats st = train_step(mine, rewards_, s % cycle);
  for (const auto& [name, value] : st.metrics) {
    sums_[name] += value;
    counts_[name] += 1;
  }
  // Tokens are counted when they are generated (TRL's num_input_tokens_seen): a step that
  // trains again on a generation batch adds none.
  const bool generated = st.metrics.count("completions/mean_length") > 0;
  Trainer::Impl::StepResult out;
  // The window sums its steps' losses over the ranks: each rank holds its share of the step's.
  out.loss = at::scalar_tensor(st.loss / static_cast<double>(I.world),
                               at::TensorOptions().dtype(at::kFloat).device(I.comm->device()));
  out.tokens =
      !generated ? 0
                 : prompt_tokens + static_cast<int64_t>(std::llround(
                                       st.metrics.at("completions/mean_length") *
                                       static_cast<double>(I.batch.size() * generation_slices())));
  return out;
}

// A generation batch as its steps train on it: its rows (prompt then completion), which tokens
// count, the advantages and the loss's divisor; when it feeds more than one step (its slices,
// steps_per_generation; num_iterations) also each micro-batch's log-probs under the policy that
// sampled (TRL's old_per_token_logps), and how many steps used it.
struct GrpoObjective::Buffer {
  std::vector<std::vector<int64_t>> prompts;  // the batch's prompts (the calls that reuse it)
  std::vector<std::vector<int64_t>> rows;     // a prompt per completion
  std::vector<Generated> done;
  at::Tensor advantages;  // [completions] fp64 (CPU)
  double divisor = 1.0;
  std::vector<at::Tensor> old_logps;  // per micro-batch (more than one step)
  int64_t uses = 0;
};

GrpoObjective::Scored GrpoObjective::sample_and_score(const std::vector<GrpoPrompt>& prompts,
                                                      const std::vector<RewardFunction>& rewards,
                                                      const std::vector<double>& weights,
                                                      uint64_t seed,
                                                      const std::vector<uint64_t>& streams,
                                                      int64_t global_completions, bool counts) {
  Trainer::Impl& I = t_;
  const int64_t g = options_.num_generations;
  const int64_t n = static_cast<int64_t>(prompts.size()) * g;
  Scored result;
  // 1. Completions, sampled by the weights being trained, without dropout. Under ZeRO-3 the
  // units are gathered once for the whole generation (hold_units), so a rank decodes as many
  // tokens as its own completions need, with no collective per token.
  GenerationOptions sampling_now = sampling_;
  sampling_now.seed = seed;
  std::vector<std::vector<int64_t>> rows;
  for (const GrpoPrompt& p : prompts) {
    for (int64_t k = 0; k < g; ++k) rows.push_back(p.ids);
  }
  std::vector<Generated> done;
  {
    const bool training = I.model->is_training();
    I.model->eval();
    I.engine->hold_units();
    try {
      done = I.model->generate_batch(rows, sampling_now, streams);
    } catch (...) {
      I.engine->release_units();
      if (training) I.model->train();
      throw;
    }
    I.engine->release_units();
    if (training) I.model->train();
  }

  // 2. Rewards for this rank's completions.
  std::vector<RewardInput> inputs(static_cast<size_t>(n));
  for (int64_t c = 0; c < n; ++c) {
    const GrpoPrompt& p = prompts[static_cast<size_t>(c / g)];
    RewardInput& r = inputs[static_cast<size_t>(c)];
    const auto& tokens = done[static_cast<size_t>(c)].tokens;
    r.prompt = I.tokenizer->decode(std::vector<int32_t>(p.ids.begin(), p.ids.end()));
    r.completion = I.tokenizer->decode(std::vector<int32_t>(tokens.begin(), tokens.end()));
    r.completion_ids = tokens;
    r.columns = p.columns;
    result.completions.push_back(r.completion);
  }
  // The ranks agree on the scoring (one small all-reduce): a reward function that fails or asks
  // to stop on one rank stops the step on every rank at once, none waiting out the collective
  // timeout while that rank's process lives on (a host that handles the error).
  at::Tensor per_function;  // [n, F]
  comm::on_every_rank(*I.comm, "scoring the completions (a reward function)",
                      [&] { per_function = score_completions(rewards, inputs, g); });

  // 3. Advantages: groups are whole on this rank; the batch's std (scale_rewards batch) and
  // the logged statistics are over every rank's completions.
  const std::string scale = options_.scale_rewards;
  GroupAdvantages adv =
      group_advantages(per_function, weights, g, scale == "batch" ? std::string("none") : scale);
  const at::Tensor r = adv.rewards;  // [n] fp64, NaN: unscored
  const at::Tensor scored = r.isnan().logical_not();
  const at::Tensor r0 = at::where(scored, r, at::zeros_like(r));
  const int64_t f = per_function.size(1);
  std::vector<double> sums{r0.sum().item<double>(), r0.pow(2).sum().item<double>(),
                           scored.sum().item<double>()};
  for (int64_t j = 0; j < f; ++j) {
    const at::Tensor col = per_function.select(1, j);
    const at::Tensor ok = col.isnan().logical_not();
    const at::Tensor c0 = at::where(ok, col, at::zeros_like(col));
    sums.push_back(c0.sum().item<double>());
    sums.push_back(c0.pow(2).sum().item<double>());
    sums.push_back(ok.sum().item<double>());
  }
  // Completion lengths and truncation, and the loss's counted tokens.
  double length_sum = 0, terminated_sum = 0, terminated = 0, counted = 0;
  double min_length = std::numeric_limits<double>::infinity(), max_length = 0;
  double min_terminated = std::numeric_limits<double>::infinity(), max_terminated = 0;
  for (const Generated& d : done) {
    const auto n = static_cast<double>(d.tokens.size());
    length_sum += n;
    min_length = std::min(min_length, n);
    max_length = std::max(max_length, n);
    if (d.stopped) {
      terminated += 1;
      terminated_sum += n;
      min_terminated = std::min(min_terminated, n);
      max_terminated = std::max(max_terminated, n);
    }
    if (d.stopped || !options_.mask_truncated_completions) counted += n;
  }
  sums.insert(sums.end(),
              {length_sum, terminated, terminated_sum, counted, adv.std_zero.sum().item<double>()});
  std::vector<double> ends{-min_length, max_length, -min_terminated, max_terminated};
  if (!counts) {  // a rank that only takes part: nothing of its completions counts
    std::fill(sums.begin(), sums.end(), 0.0);
    std::fill(ends.begin(), ends.end(), -std::numeric_limits<double>::infinity());
  }
  const std::vector<double> global = comm::reduce_scalars(*I.comm, sums);
  const std::vector<double> extremes = comm::reduce_scalars(*I.comm, ends, ReduceOp::kMax);
  const double reward_std = reward_mean_std(global[0], global[1], global[2]).second;
  at::Tensor advantages = adv.advantages;
  if (scale == "batch") {
    advantages = adv.advantages / (reward_std + 1e-4);
    advantages = at::nan_to_num(advantages, 0.0);
  }
  result.metrics =
      completion_metrics(global, extremes, rewards, static_cast<double>(global_completions), scale);
  result.sums = global;
  result.extremes = extremes;
  result.rewards = r;
  result.advantages = advantages;
  result.rows = std::move(rows);
  result.done = std::move(done);
  result.counted_tokens =
      static_cast<int64_t>(global[static_cast<size_t>(3 + 3 * per_function.size(1) + 3)]);
  return result;
}

GrpoStepStats GrpoObjective::train_step(const std::vector<GrpoPrompt>& prompts,
                                        const std::vector<RewardFunction>& rewards,
                                        int64_t cycle_step) {
  Trainer::Impl& I = t_;
  const int64_t g = options_.num_generations;
  const int64_t slices = generation_slices();
  const int64_t per_step = I.batch.micro_batch * I.batch.accumulation;  // a rank's completions
  const int64_t per_rank = per_step * slices;  // a rank's completions per generation batch
  if (per_rank % g != 0) {
    throw ConfigError(fmt::format(
        "num_generations {}: a rank's completions per generation, per_device_train_batch_size "
        "{} × steps_per_generation {} = {}, must be whole groups of num_generations",
        g, I.batch.micro_batch, I.batch.accumulation * slices, per_rank));
  }
  if (static_cast<int64_t>(prompts.size()) * g != per_rank) {
    throw InvalidArgument(fmt::format(
        "train_grpo_step: {} prompts × num_generations {} completions, but a generation batch "
        "takes per_device_train_batch_size × steps_per_generation = {} completions per rank: "
        "give {} prompts",
        prompts.size(), g, per_rank, per_rank / g));
  }
  if (rewards.empty()) throw InvalidArgument("train_grpo_step: give at least one reward function");
  const std::vector<double> weights = parse_weights(I.args.reward_weights, rewards.size());
  const int64_t vocab = I.model_config.vocab_size;
  const int64_t context = I.model_config.max_position_embeddings;
  for (size_t p = 0; p < prompts.size(); ++p) {
    const std::vector<int64_t>& ids = prompts[p].ids;
    if (ids.empty()) throw InvalidArgument(fmt::format("train_grpo_step: prompt {} is empty", p));
    for (int64_t t : ids) {
      if (t < 0 || t >= vocab) {
        throw InvalidArgument(fmt::format(
            "train_grpo_step: prompt {} holds token id {}, outside the vocabulary [0, {})", p, t,
            vocab));
      }
    }
    if (static_cast<int64_t>(ids.size()) + options_.max_completion_length > context) {
      throw InvalidArgument(fmt::format(
          "train_grpo_step: prompt {} is {} tokens; with max_completion_length {} that is beyond "
          "the model's context of {} tokens (max_position_embeddings); shorten it",
          p, ids.size(), options_.max_completion_length, context));
    }
  }

  const int64_t cycle = cycle_steps();
  const int64_t step = I.engine->global_step();
  const int64_t mb = I.batch.micro_batch;
  const int64_t accumulation = I.batch.accumulation;
  GrpoStepStats out;
  std::vector<std::vector<int64_t>> given;
  for (const GrpoPrompt& p : prompts) given.push_back(p.ids);
  std::shared_ptr<Buffer> buf = buffer_;
  if (buf && buf->uses < cycle) {
    // This step trains on a generation batch an earlier one made: its next slice (a
    // steps_per_generation batch) or again (num_iterations).
    if (buf->prompts != given) {
      throw InvalidArgument(fmt::format(
          "train_grpo_step: with steps_per_generation {} and num_iterations {} a generation "
          "batch feeds {} steps; this call trains on the completions of the call {} before it, "
          "whose prompts differ: give the same prompts {} calls in a row",
          slices * accumulation, I.args.num_iterations, cycle, buf->uses, cycle));
    }
  } else {
    buf = std::make_shared<Buffer>();
    buf->prompts = std::move(given);
    // A run resumed inside a cycle generates anew and trains on the cycle's remaining steps.
    buf->uses = cycle_step > 0 ? cycle_step % cycle : 0;
    // 1.–3. Completions sampled by the weights being trained, their rewards and advantages.
    // Each one's draws come from (seed, step, its index in the global generation batch: step
    // slice by step slice, each rank-major, so any world size draws alike).
    std::vector<uint64_t> streams;
    for (int64_t c = 0; c < per_rank; ++c) {
      const int64_t slice = c / per_step, within = c % per_step;
      streams.push_back(
          static_cast<uint64_t>(slice * per_step * I.world + I.rank * per_step + within));
    }
    Scored scored =
        sample_and_score(prompts, rewards, weights,
                         mix(static_cast<uint64_t>(I.args.seed), static_cast<uint64_t>(step)),
                         streams, per_rank * I.world, /*counts=*/true);
    out.metrics = std::move(scored.metrics);
    out.completions = std::move(scored.completions);
    for (int64_t c = 0; c < per_rank; ++c) out.rewards.push_back(scored.rewards[c].item<double>());
    buf->rows = std::move(scored.rows);
    buf->advantages = scored.advantages;
    buf->done = std::move(scored.done);
    // The divisors are a step's (its completions, its micro-batches) except dapo's and
    // cispo's, which count the tokens of the whole generation batch (TRL's num_items_in_batch).
    GrpoStepCounts counts;
    counts.completions = per_step * I.world;
    counts.micro_batches = accumulation * I.world;
    counts.generation_tokens = scored.counted_tokens;
    buf->divisor = grpo_divisor(options_, counts);
    buffer_ = cycle > 1 ? buf : nullptr;
  }
  // The slice of the generation batch this step trains on: micro-batches [first, first + a).
  const int64_t first = (buf->uses % slices) * accumulation;
  buf->uses += 1;

  // 4. The step: micro-batches of per_device_train_batch_size completions, each the prompt
  // and its completion right-padded, the completion's tokens labelled (none of a truncated
  // one's with mask_truncated_completions).
  const at::Device device = I.comm->device();
  const auto micro_batch = [&](int64_t a) {
    return completion_batch(buf->rows, buf->done, a * mb, mb, options_.mask_truncated_completions,
                            I.pad_id, device);
  };
  I.model->train();
  const double temperature = I.args.temperature;
  if (cycle > 1 && buf->old_logps.empty()) {
    // TRL's old_per_token_logps: the sampling policy's, for every micro-batch of the
    // generation batch before its first update.
    at::NoGradGuard no_grad;
    for (int64_t a = 0; a < slices * accumulation; ++a) {
      const auto [ids, labels] = micro_batch(a);
      buf->old_logps.push_back(
          I.model->label_log_probs(ids, labels, {}, 1024, {}, nullptr, temperature).detach());
    }
  }
  const double divisor = buf->divisor;
  // Kept on the device through the micro-batches and read once after them (no sync per
  // micro-batch): the metric sums, then the loss, −(low_min) and high_max.
  const auto on_device = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor sums_total = at::zeros({kGrpoSums}, on_device);
  at::Tensor tail = at::tensor({0.0, -std::numeric_limits<double>::infinity(), 0.0}).to(device);
  bool clip_extremes = false;
  for (int64_t a = first; a < first + accumulation; ++a) {
    const auto [dev_ids, labels] = micro_batch(a);
    GrpoInputs in;
    in.logps = I.model->label_log_probs(dev_ids, labels, {}, 1024, {}, nullptr, temperature,
                                        &in.entropies);
    if (cycle > 1) in.old_logps = buf->old_logps[static_cast<size_t>(a)];
    in.mask = labels.ne(kIgnoreLabel).to(at::kFloat).to(device);
    in.advantages = buf->advantages.narrow(0, a * mb, mb).to(at::kFloat).to(device);
    if (options_.beta != 0.0)
      in.ref_logps = reference_token_log_probs(dev_ids, labels, temperature);
    const GrpoLoss l = grpo_loss(options_, in);
    I.engine->backward(l.numerator, divisor);
    I.engine->step();
    tail[0] += l.numerator.detach().to(at::kDouble) / divisor;
    sums_total += l.sums;
    if (l.low_clipped.defined()) {
      clip_extremes = true;
      tail[1] = at::maximum(tail[1], -at::nan_to_num(l.low_clipped, 1.0).min().to(at::kDouble));
      tail[2] = at::maximum(tail[2], at::nan_to_num(l.high_clipped, 0.0).max().to(at::kDouble));
    }
  }
  const at::Tensor host = at::cat({sums_total, tail}).to(at::kCPU);
  const double* h = host.data_ptr<double>();
  const double low_min = -h[kGrpoSums + 1], high_max = h[kGrpoSums + 2];
  std::vector<double> step_sums(h, h + kGrpoSums);
  step_sums.push_back(h[kGrpoSums]);
  const std::vector<double> all = comm::reduce_scalars(*I.comm, step_sums);
  for (const auto& [name, value] :
       grpo_metrics(options_, std::vector<double>(all.begin(), all.end() - 1), true, "")) {
    out.metrics[name] = value;
  }
  if (clip_extremes) {
    const std::vector<double> e =
        comm::reduce_scalars(*I.comm, {-low_min, high_max}, ReduceOp::kMax);
    out.metrics["clip_ratio/low_min"] = -e[0];
    out.metrics["clip_ratio/high_max"] = e[1];
  }
  out.loss = all.back();
  out.global_step = I.engine->global_step();
  out.stepped = out.global_step > step;
  if (out.stepped) {
    out.skipped = I.engine->last_step_skipped();
    out.grad_norm = I.engine->last_grad_norm();
  }
  I.state.global_step = out.global_step;
  out.learning_rate = I.engine->learning_rate();
  out.loss_scale = I.engine->loss_scale();
  return out;
}

// The run's GRPO objective, for the host API of stage grpo: InvalidArgument naming `what` when
// the run has another stage.
GrpoObjective& grpo_of(Trainer::Impl& I, const char* what, const char* why) {
  auto* g = dynamic_cast<GrpoObjective*>(I.objective.get());
  if (g == nullptr) {
    throw InvalidArgument(fmt::format("{}: the run's stage is {}; {}", what, I.args.stage, why));
  }
  return *g;
}

}  // namespace

std::unique_ptr<Objective> make_grpo_objective(Trainer::Impl& trainer) {
  return std::make_unique<GrpoObjective>(trainer);
}

}  // namespace train

GrpoStepStats Trainer::train_grpo_step(const std::vector<GrpoPrompt>& prompts,
                                       const std::vector<RewardFunction>& rewards) {
  return impl_->posting_failures([&] {
    return train::grpo_of(*impl_, "train_grpo_step", "set stage grpo in its options")
        .train_step(prompts, rewards);
  });
}

void Trainer::add_reward(RewardFunction reward) {
  train::grpo_of(*impl_, "add_reward", "reward functions score stage grpo's completions")
      .add_reward(std::move(reward));
}

}  // namespace zt
