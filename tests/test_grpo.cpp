// GRPO's losses and advantages against TRL's own code (fixtures by
// tests/tools/make_grpo_fixtures.py, which runs GRPOTrainer._compute_loss and its advantage
// block unchanged), for every loss_type; and the step's loss independent of how the batch is
// cut into micro-batches and ranks.
#include "support/catch.hpp"

#include <ATen/ATen.h>
#include <sys/stat.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <tuple>

#include <fmt/format.h>

#include "support/jobs.hpp"
#include "support/ranks.hpp"
#include "train/grpo.hpp"
#include "train/reward_process.hpp"
#include "train/rewards.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/trainer.hpp"

using namespace zt;
using train::GrpoOptions;

namespace {

// A GRPO prompt file of `count` prompts in `dir` (below); its path.
std::string write_prompts(const std::string& dir, int count);

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

// A JSON array of numbers or of arrays of numbers as an fp64 tensor (null: NaN).
at::Tensor tensor_of(const rapidjson::Value& a) {
  std::vector<double> flat;
  std::vector<int64_t> shape{static_cast<int64_t>(a.Size())};
  for (const auto& v : a.GetArray()) {
    if (v.IsArray()) {
      if (shape.size() == 1) shape.push_back(v.Size());
      for (const auto& x : v.GetArray()) flat.push_back(x.IsNull() ? NAN : x.GetDouble());
    } else {
      flat.push_back(v.IsNull() ? NAN : v.GetDouble());
    }
  }
  return at::tensor(flat, at::kDouble).view(shape);
}

GrpoOptions options_of(const rapidjson::Value& o) {
  GrpoOptions g;
  g.loss_type = o["loss_type"].GetString();
  g.beta = o["beta"].GetDouble();
  g.epsilon = o["epsilon"].GetDouble();
  g.epsilon_high = o["epsilon_high"].GetDouble();
  if (o.HasMember("delta") && !o["delta"].IsNull()) g.delta = o["delta"].GetDouble();
  g.importance_sampling_level = o["importance_sampling_level"].GetString();
  g.max_completion_length = o["max_completion_length"].GetInt64();
  if (o.HasMember("use_bias_correction_kl"))
    g.use_bias_correction_kl = o["use_bias_correction_kl"].GetBool();
  if (o.HasMember("sapo_temperature_pos"))
    g.sapo_temperature_pos = o["sapo_temperature_pos"].GetDouble();
  if (o.HasMember("sapo_temperature_neg"))
    g.sapo_temperature_neg = o["sapo_temperature_neg"].GetDouble();
  return g;
}

struct Case {
  std::string name;
  GrpoOptions o;
  train::GrpoInputs in;
  at::Tensor logps;
};

Case load_case(const rapidjson::Value& c) {
  Case k;
  k.name = c["name"].GetString();
  k.o = options_of(c["options"]);
  k.logps = tensor_of(c["logps"]).requires_grad_(true);
  k.in.logps = k.logps;
  k.in.old_logps = tensor_of(c["old_logps"]);
  k.in.ref_logps = tensor_of(c["ref_logps"]);
  k.in.mask = tensor_of(c["mask"]);
  k.in.advantages = tensor_of(c["advantages"]);
  k.in.entropies = tensor_of(c["entropies"]);
  return k;
}

}  // namespace

TEST_CASE("every GRPO loss_type gives TRL's loss, gradient and metrics", "[grpo]") {
  const rapidjson::Document doc =
      json::parse(files::read_text(fixture("grpo/loss.json")), "loss.json");
  int cases = 0;
  for (const auto& c : doc["cases"].GetArray()) {
    Case k = load_case(c);
    INFO(k.name);
    train::check_grpo_options(k.o);
    const train::GrpoLoss l = train::grpo_loss(k.o, k.in);
    // One micro-batch on one rank: the step's counts are this batch's.
    train::GrpoStepCounts counts{k.in.mask.size(0), 1, k.in.mask.sum().item<int64_t>()};
    const at::Tensor loss = l.numerator / train::grpo_divisor(k.o, counts);
    CHECK(loss.item<double>() == Approx(c["loss"].GetDouble()).epsilon(1e-10).margin(1e-12));
    loss.backward();
    const at::Tensor want = tensor_of(c["grad"]);
    CHECK((k.logps.grad() - want).abs().max().item<double>() < 1e-12);
    std::vector<double> sums(l.sums.data_ptr<double>(), l.sums.data_ptr<double>() + l.sums.numel());
    const auto metrics = train::grpo_metrics(k.o, sums, true, "");
    const auto& want_metrics = c["metrics"];
    for (const auto& [name, value] : metrics) {
      INFO(name);
      REQUIRE(want_metrics.HasMember(name.c_str()));
      CHECK(value == Approx(want_metrics[name.c_str()].GetDouble()).epsilon(1e-6).margin(1e-7));
    }
    for (const char* name : {"clip_ratio/low_min", "clip_ratio/high_max"}) {
      if (!want_metrics.HasMember(name)) continue;
      const at::Tensor& per =
          std::string(name) == "clip_ratio/low_min" ? l.low_clipped : l.high_clipped;
      const double v = std::string(name) == "clip_ratio/low_min" ? per.min().item<double>()
                                                                 : per.max().item<double>();
      CHECK(v == Approx(want_metrics[name].GetDouble()).epsilon(1e-6).margin(1e-7));
    }
    // Every metric TRL logged (entropy, kl, clip ratios) is one of ours.
    for (const auto& m : want_metrics.GetObject()) {
      const std::string name = m.name.GetString();
      if (name == "clip_ratio/low_min" || name == "clip_ratio/high_max") continue;
      CHECK(metrics.count(name) == 1);
    }
    ++cases;
  }
  CHECK(cases >= 12);
}

TEST_CASE("GRPO advantages are TRL's for every scale_rewards, weights and missing rewards",
          "[grpo]") {
  const rapidjson::Document doc =
      json::parse(files::read_text(fixture("grpo/advantages.json")), "advantages.json");
  for (const auto& c : doc["cases"].GetArray()) {
    INFO(c["name"].GetString());
    std::vector<double> weights;
    for (const auto& w : c["weights"].GetArray()) weights.push_back(w.GetDouble());
    const auto a =
        train::group_advantages(tensor_of(c["rewards_per_func"]), weights,
                                c["num_generations"].GetInt64(), c["scale_rewards"].GetString());
    const at::Tensor want = tensor_of(c["advantages"]);
    CHECK((a.advantages - want).abs().max().item<double>() < 1e-9);
    const at::Tensor rewards = tensor_of(c["rewards"]);
    CHECK(at::equal(a.rewards.isnan(), rewards.isnan()));
    CHECK(at::allclose(at::nan_to_num(a.rewards, 0.0), at::nan_to_num(rewards, 0.0)));
    std::vector<int64_t> zero;
    for (const auto& z : c["std_zero"].GetArray()) zero.push_back(z.GetBool());
    CHECK(at::equal(a.std_zero.to(at::kLong), at::tensor(zero, at::kLong)));
  }
}

TEST_CASE("a GRPO step's loss is the same however its completions are cut into micro-batches",
          "[grpo]") {
  const rapidjson::Document doc =
      json::parse(files::read_text(fixture("grpo/loss.json")), "loss.json");
  for (const auto& c : doc["cases"].GetArray()) {
    Case k = load_case(c);
    if (k.o.loss_type == "bnpo") continue;  // TRL's bnpo is a mean of micro-batch token means
    INFO(k.name);
    const int64_t b = k.in.mask.size(0);
    const train::GrpoStepCounts counts{b, 1, k.in.mask.sum().item<int64_t>()};
    const double whole =
        (train::grpo_loss(k.o, k.in).numerator / train::grpo_divisor(k.o, counts)).item<double>();
    for (int64_t parts : {2, 3, 6}) {
      INFO(parts << " micro-batches");
      const train::GrpoStepCounts cut{b, parts, counts.generation_tokens};
      double sum = 0;
      for (int64_t p = 0; p < parts; ++p) {
        train::GrpoInputs in;
        const int64_t n = b / parts;
        in.logps = k.in.logps.narrow(0, p * n, n);
        in.old_logps = k.in.old_logps.narrow(0, p * n, n);
        in.ref_logps = k.in.ref_logps.narrow(0, p * n, n);
        in.mask = k.in.mask.narrow(0, p * n, n);
        in.advantages = k.in.advantages.narrow(0, p * n, n);
        sum += (train::grpo_loss(k.o, in).numerator / train::grpo_divisor(k.o, cut)).item<double>();
      }
      CHECK(sum == Approx(whole).epsilon(1e-12).margin(1e-14));
    }
  }
}

TEST_CASE("GRPO options out of range are refused with the option named", "[grpo]") {
  const auto refused = [](GrpoOptions o, const std::string& what) {
    CHECK_THROWS_AS(train::check_grpo_options(o), ConfigError);
    CHECK_THROWS_WITH(train::check_grpo_options(o), Catch::Contains(what));
  };
  GrpoOptions o;
  o.loss_type = "ppo";
  refused(o, "loss_type 'ppo'");
  o = {};
  o.loss_type = "vespo";
  refused(o, "vespo");
  o = {};
  o.num_generations = 1;
  refused(o, "num_generations 1");
  o = {};
  o.importance_sampling_level = "batch";
  refused(o, "importance_sampling_level");
  o = {};
  o.scale_rewards = "yes";
  refused(o, "scale_rewards");
  o = {};
  o.beta = -1;
  refused(o, "beta");
  o = {};
  o.epsilon = 1.5;
  refused(o, "epsilon 1.5");
  o = {};
  o.delta = 0.0;
  refused(o, "delta");
  o = {};
  o.loss_type = "luspo";
  refused(o, "importance_sampling_level sequence");
  o = {};
  CHECK_NOTHROW(train::check_grpo_options(o));
  // Rewards that are not whole groups, or weights that do not match the functions.
  CHECK_THROWS_WITH(train::group_advantages(at::zeros({5, 1}, at::kDouble), {}, 2, "group"),
                    Catch::Contains("num_generations 2"));
  CHECK_THROWS_WITH(train::group_advantages(at::zeros({4, 2}, at::kDouble), {1.0}, 2, "group"),
                    Catch::Contains("reward_weights"));
}

namespace {

std::vector<std::optional<double>> score(const std::string& spec,
                                         const std::vector<train::RewardInput>& in) {
  return builtin_reward(spec, "reward_funcs").fn(in);
}

train::RewardInput completion(const std::string& text, std::vector<int64_t> ids = {},
                              std::map<std::string, std::string> columns = {}) {
  train::RewardInput r;
  r.completion = text;
  r.completion_ids = std::move(ids);
  r.columns = std::move(columns);
  return r;
}

}  // namespace

TEST_CASE("the built-in rewards score as TRL's and DAPO's definitions", "[grpo][rewards]") {
  // TRL's repetition_penalty_reward docstring: n-grams of 2, max_penalty -1.
  auto r = score("repetition:2:-1", {completion("", {1, 2, 3, 4}), completion("", {5, 5, 5, 5, 5}),
                                     completion("", {7})});
  CHECK(*r[0] == 0.0);
  CHECK(*r[1] == Approx(-0.75));
  CHECK(*r[2] == 0.0);
  // TRL's think_format_reward docstring, and a second <think>.
  r = score("think_format",
            {completion("<think>\nThis is my reasoning.\n</think>\nThis is my answer."),
             completion("<think>\nThis is my reasoning.\nThis is my answer."),
             completion("<think>a</think><think>b</think>"), completion(" <think>a</think>")});
  CHECK(*r[0] == 1.0);
  CHECK(*r[1] == 0.0);
  CHECK(*r[2] == 0.0);
  CHECK(*r[3] == 0.0);
  // DAPO's soft overlong punishment, MAX 100, CACHE 20: 0 to 80 tokens, then linear to -1.
  r = score("overlong:100:20",
            {completion("", std::vector<int64_t>(80)), completion("", std::vector<int64_t>(90)),
             completion("", std::vector<int64_t>(100)), completion("", std::vector<int64_t>(101))});
  CHECK(*r[0] == 0.0);
  CHECK(*r[1] == Approx(-0.5));
  CHECK(*r[2] == Approx(-1.0));
  CHECK(*r[3] == -1.0);
  // A format pattern, matched from the start with "." across lines.
  r = score(
      "format:<think>.*?</think>\\s*<answer>.*?</answer>$",
      {completion("<think>\nx\n</think>\n<answer>4</answer>"), completion("<answer>4</answer>"),
       completion("junk <think>x</think><answer>4</answer>")});
  CHECK(*r[0] == 1.0);
  CHECK(*r[1] == 0.0);
  CHECK(*r[2] == 0.0);
}

TEST_CASE("the accuracy reward reads GSM8K, boxed and plain answers", "[grpo][rewards]") {
  const std::map<std::string, std::string> gsm{
      {"answer", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,072"}};
  auto r = score(
      "accuracy",
      {completion("So the total is 1072.", {}, gsm), completion("It is 1,072 clips.", {}, gsm),
       completion("The answer is \\boxed{1072}. Check: 5 + 5 = 10", {}, gsm),
       completion("I think 1072, no wait, 1071", {}, gsm), completion("no idea", {}, gsm),
       completion("\\boxed{\\frac{1}{2}}", {}, {{"solution", "The result is $\\boxed{0.5}$"}}),
       completion("\\boxed{x^2 + 1}", {}, {{"solution", "\\boxed{x^2+1}"}}),
       completion("12", {}, {}), completion("-3.50", {}, {{"answer", "-3.5"}})});
  CHECK(*r[0] == 1.0);
  CHECK(*r[1] == 1.0);
  CHECK(*r[2] == 1.0);  // the boxed answer, not the last number
  CHECK(*r[3] == 0.0);
  CHECK(*r[4] == 0.0);
  CHECK(*r[5] == 1.0);
  CHECK(*r[6] == 1.0);
  CHECK_FALSE(r[7].has_value());  // no reference: unscored
  CHECK(*r[8] == 1.0);
  CHECK(train::reference_answer("a\n#### 18") == "18");
  CHECK(train::completion_answer("costs $1,234.50 total") == "1234.50");
  CHECK_FALSE(train::same_answer("", ""));
}

TEST_CASE("a reward function that fails is named with the completion and prompt",
          "[grpo][rewards]") {
  std::vector<train::RewardInput> in(6);
  const auto fn = [](std::function<std::vector<std::optional<double>>(size_t)> f) {
    return train::RewardFunction{
        "mine", [f](const std::vector<train::RewardInput>& x) { return f(x.size()); }};
  };
  // NaN at completion 4: prompt 2 with 2 generations each.
  auto nan_at_4 = fn([](size_t n) {
    std::vector<std::optional<double>> v(n, 1.0);
    v[4] = NAN;
    return v;
  });
  CHECK_THROWS_WITH(
      train::score_completions({nan_at_4}, in, 2),
      Catch::Contains("'mine'") && Catch::Contains("completion 4") && Catch::Contains("prompt 2"));
  auto short_list = fn([](size_t n) { return std::vector<std::optional<double>>(n - 1, 0.0); });
  CHECK_THROWS_WITH(train::score_completions({short_list}, in, 2),
                    Catch::Contains("returned 5 rewards for 6"));
  auto throws = fn([](size_t) -> std::vector<std::optional<double>> {
    throw std::runtime_error("service down");
  });
  CHECK_THROWS_WITH(train::score_completions({throws}, in, 2), Catch::Contains("service down"));
  auto infinite = fn([](size_t n) {
    std::vector<std::optional<double>> v(n, 0.0);
    v[0] = INFINITY;
    return v;
  });
  CHECK_THROWS_WITH(train::score_completions({infinite}, in, 3), Catch::Contains("prompt 0"));
  // None is a NaN entry; the other function's rewards stay.
  auto none_at_1 = fn([](size_t n) {
    std::vector<std::optional<double>> v(n, 2.0);
    v[1] = std::nullopt;
    return v;
  });
  const at::Tensor s =
      train::score_completions({none_at_1, builtin_reward("repetition:2:-1", "x")}, in, 2);
  CHECK(s.sizes() == at::IntArrayRef({6, 2}));
  CHECK(std::isnan(s[1][0].item<double>()));
  CHECK(s[0][0].item<double>() == 2.0);
  CHECK(s[1][1].item<double>() == 0.0);
  // Spec errors name the option.
  CHECK_THROWS_WITH(builtin_reward("overlong:10", "reward_funcs"),
                    Catch::Contains("reward_funcs") && Catch::Contains("MAX and CACHE"));
  CHECK_THROWS_WITH(builtin_reward("repetition:3:0.5", "reward_funcs"), Catch::Contains("PENALTY"));
  CHECK_THROWS_WITH(builtin_reward("format:a(?=x)", "reward_funcs"), Catch::Contains("RE2"));
  CHECK_THROWS_WITH(builtin_reward("magic", "reward_funcs"), Catch::Contains("accuracy"));
}

namespace {

// GRPO runs of the tiny byte-level model (kTinyModel): 4 prompts a step, 2 completions each.
std::vector<std::string> grpo_flags(const std::string& dir, int64_t micro, int64_t accum,
                                    const std::vector<std::string>& extra) {
  std::vector<std::string> f{"--model_config",
                             test::kTinyModel,
                             "--output_dir",
                             dir,
                             "--stage",
                             "grpo",
                             "--num_generations",
                             "2",
                             "--max_completion_length",
                             "6",
                             "--max_steps",
                             "3",
                             "--learning_rate",
                             "0.02",
                             "--seed",
                             "4",
                             "--max_grad_norm",
                             "0",
                             "--per_device_train_batch_size",
                             std::to_string(micro),
                             "--gradient_accumulation_steps",
                             std::to_string(accum),
                             "--logging_steps",
                             "1",
                             "--save_steps",
                             "100"};
  f.insert(f.end(), extra.begin(), extra.end());
  return f;
}

// Step s's prompts (the global batch's, in order): byte ids of a short question.
std::vector<GrpoPrompt> grpo_prompts(int64_t step) {
  std::vector<GrpoPrompt> out;
  for (int64_t p = 0; p < 4; ++p) {
    const std::string q = fmt::format("Q{}: {} + {} =", step, p + 2, 3 * p + step);
    GrpoPrompt g;
    g.ids.push_back(256);  // bos
    for (unsigned char c : q) g.ids.push_back(c);
    if (p % 2 == 1) g.ids.push_back('?');  // prompts of different lengths
    g.columns["answer"] = std::to_string(p + 2 + 3 * p + step);
    out.push_back(std::move(g));
  }
  return out;
}

// A reward that sees the completion's tokens: the share of them below 128 (ASCII).
RewardFunction ascii_share() {
  return {"ascii", [](const std::vector<RewardInput>& batch) {
            std::vector<std::optional<double>> out;
            for (const RewardInput& r : batch) {
              double n = 0;
              for (int64_t t : r.completion_ids) n += t < 128;
              out.push_back(r.completion_ids.empty() ? 0.0 : n / r.completion_ids.size());
            }
            return out;
          }};
}

}  // namespace

TEST_CASE("rank: grpo steps", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  const int world = comm->world_size(), rank = comm->rank();
  const int64_t micro = std::atoi(std::getenv("ZT_MICRO"));
  const int64_t per_rank = 8 / world, accum = per_rank / micro;
  TrainingArguments args;
  apply_training_flags(args, grpo_flags(std::getenv("ZT_DIR"), micro, accum,
                                        test::split_flags(std::getenv("ZT_FLAGS"))));
  Trainer trainer(args, comm);
  std::ofstream out;
  if (rank == 0) out.open(std::string(std::getenv("ZT_DIR")) + "/steps.txt");
  for (int64_t step = 0; step < 3; ++step) {
    const std::vector<GrpoPrompt> all = grpo_prompts(step);
    const int64_t mine = 4 / world;
    const std::vector<GrpoPrompt> prompts(all.begin() + rank * mine,
                                          all.begin() + (rank + 1) * mine);
    const GrpoStepStats s =
        trainer.train_grpo_step(prompts, {ascii_share(), builtin_reward("repetition:2:-1")});
    CHECK(s.stepped);
    CHECK(s.completions.size() == static_cast<size_t>(per_rank));
    if (rank == 0) {
      out << fmt::format("{:.12g}", s.loss);
      for (const auto& [name, value] : s.metrics) out << fmt::format(" {}={:.10g}", name, value);
      out << "\n";
    }
  }
  trainer.export_model(std::string(std::getenv("ZT_DIR")) + "/model");
}

TEST_CASE("GRPO steps are the same at world 1, 2 and 4 and under ZeRO 0-3",
          "[grpo][trainer][slow]") {
  if (test::skip_cpu_world(4)) return;
  const std::string dir = test::temp_dir("grpo-worlds");
  for (const std::string& setting :
       {std::string("--finetuning_type full --pref_beta 0.05 --loss_type grpo"),
        std::string("--finetuning_type lora --lora_r 4 --pref_beta 0.1 --loss_type dapo"),
        std::string("--finetuning_type full --loss_type bnpo --scale_rewards batch"),
        std::string("--finetuning_type lora --lora_r 4 --loss_type dr_grpo "
                    "--importance_sampling_level sequence --mask_truncated_completions true")}) {
    INFO(setting);
    std::string reference_steps;
    std::map<std::string, at::Tensor> reference_model;
    // bnpo averages micro-batch token means (TRL's definition), so it compares runs of one
    // micro-batch size; the other losses any split.
    const bool bnpo = setting.find("bnpo") != std::string::npos;
    const std::vector<std::tuple<int, int64_t, int>> runs =
        bnpo ? std::vector<std::tuple<int, int64_t, int>>{{1, 2, 0}, {2, 2, 2}, {4, 2, 3}}
             : std::vector<std::tuple<int, int64_t, int>>{
                   {1, 2, 0}, {2, 2, 2}, {4, 1, 1}, {2, 1, 3}, {4, 1, 3}};
    for (const auto& [world, micro, stage] : runs) {
      INFO("world " << world << ", micro " << micro << ", stage " << stage);
      const std::string out = fmt::format("{}/w{}-m{}-s{}-{}", dir, world, micro, stage,
                                          std::hash<std::string>()(setting));
      std::vector<std::string> flags;
      std::istringstream words(setting);
      for (std::string w; words >> w;) flags.push_back(w);
      flags.push_back("--deepspeed");
      // Stage 3 shards every weight of the tiny model (the default persistence threshold would
      // keep them all whole on each rank).
      flags.push_back(
          stage == 3
              ? std::string(
                    R"({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}})")
              : fmt::format(R"({{"zero_optimization": {{"stage": {}}}}})", stage));
      test::run_ranks(world, "rank: grpo steps", std::chrono::seconds(240),
                      {{"ZT_DIR", out},
                       {"ZT_MICRO", std::to_string(micro)},
                       {"ZT_FLAGS", test::join_flags(flags)}});
      const std::string steps = files::read_text(out + "/steps.txt");
      std::map<std::string, at::Tensor> model;
      for (const std::string file : {"adapter_model.safetensors", "model.safetensors"}) {
        if (!std::filesystem::exists(out + "/model/" + file)) continue;
        const SafetensorsFile st(out + "/model/" + file);
        for (const std::string& name : st.names()) model[name] = st.load(name);
      }
      REQUIRE(!model.empty());
      if (reference_steps.empty()) {
        reference_steps = steps;
        reference_model = model;
        continue;
      }
      // The numbers agree to rounding: compare them field by field.
      std::istringstream a(reference_steps), b(steps);
      std::string x, y;
      while (a >> x && b >> y) {
        const auto ex = x.find('='), ey = y.find('=');
        CHECK(x.substr(0, ex + 1) == y.substr(0, ey + 1));
        const double vx = std::stod(x.substr(ex + 1)), vy = std::stod(y.substr(ey + 1));
        INFO(x << " vs " << y);
        CHECK(vy == Approx(vx).epsilon(1e-4).margin(1e-6));
      }
      for (const auto& [name, t] : reference_model) {
        INFO(name);
        REQUIRE(model.count(name) == 1);
        CHECK((model.at(name).to(at::kFloat) - t.to(at::kFloat)).abs().max().item<double>() < 1e-4);
      }
    }
  }
}

TEST_CASE("GRPO learns from a reward alone", "[grpo][trainer]") {
  // The reward: the share of a completion's tokens that are ASCII bytes (about half at the
  // start, for a random model over 259 ids).
  const std::string dir = test::temp_dir("grpo-learns");
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args, grpo_flags(dir, 8, 2,
                                        {"--num_generations", "4", "--max_completion_length", "8",
                                         "--learning_rate", "0.03", "--max_steps", "40",
                                         "--loss_type", "dr_grpo", "--scale_rewards", "none"}));
  Trainer trainer(args, comm);
  std::vector<double> rewards;
  for (int64_t step = 0; step < 24; ++step) {
    const GrpoStepStats s = trainer.train_grpo_step(grpo_prompts(step), {ascii_share()});
    rewards.push_back(s.metrics.at("reward"));
    CHECK(s.metrics.at("rewards/ascii/mean") == Approx(s.metrics.at("reward")));
  }
  const double first = (rewards[0] + rewards[1] + rewards[2] + rewards[3]) / 4;
  const double last = (rewards[20] + rewards[21] + rewards[22] + rewards[23]) / 4;
  INFO("mean reward " << first << " -> " << last);
  CHECK(last > first + 0.2);
}

TEST_CASE("a GRPO step refuses bad prompts, counts and rewards before it updates",
          "[grpo][trainer]") {
  const std::string dir = test::temp_dir("grpo-errors");
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args, grpo_flags(dir, 4, 2, {}));
  Trainer trainer(args, comm);
  const std::vector<GrpoPrompt> ok = grpo_prompts(0);
  CHECK_THROWS_WITH(trainer.train_grpo_step({ok[0], ok[1]}, {ascii_share()}),
                    Catch::Contains("give 4 prompts"));
  std::vector<GrpoPrompt> bad = ok;
  bad[2].ids.push_back(900);
  CHECK_THROWS_WITH(trainer.train_grpo_step(bad, {ascii_share()}),
                    Catch::Contains("prompt 2") && Catch::Contains("token id 900"));
  bad = ok;
  bad[1].ids.assign(125, 65);
  CHECK_THROWS_WITH(trainer.train_grpo_step(bad, {ascii_share()}),
                    Catch::Contains("prompt 1") && Catch::Contains("max_completion_length"));
  bad = ok;
  bad[3].ids.clear();
  CHECK_THROWS_WITH(trainer.train_grpo_step(bad, {ascii_share()}),
                    Catch::Contains("prompt 3 is empty"));
  CHECK_THROWS_WITH(trainer.train_grpo_step(ok, {}), Catch::Contains("reward function"));
  // The host's next-token batches and pairs are another objective's: refused, naming the stage.
  const at::Tensor ids = at::full({2, 6}, 65, at::kLong);
  CHECK_THROWS_WITH(trainer.train_step(ids, ids),
                    Catch::Contains("stage grpo") && Catch::Contains("train_grpo_step"));
  CHECK_THROWS_WITH(trainer.train_preference_step(ids, ids, ids, ids),
                    Catch::Contains("stage grpo") && Catch::Contains("stage dpo"));
  const RewardFunction nan_reward{"broken", [](const std::vector<RewardInput>& b) {
                                    std::vector<std::optional<double>> v(b.size(), 0.5);
                                    v[5] = NAN;
                                    return v;
                                  }};
  CHECK_THROWS_WITH(trainer.train_grpo_step(ok, {nan_reward}),
                    Catch::Contains("'broken'") && Catch::Contains("completion 5") &&
                        Catch::Contains("prompt 2"));
  // Nothing above stepped: the first good step is step 1.
  const GrpoStepStats s = trainer.train_grpo_step(ok, {ascii_share()});
  CHECK(s.global_step == 1);
  CHECK(s.metrics.count("completions/mean_length") == 1);
  CHECK(s.metrics.count("clip_ratio/region_mean") == 1);
  CHECK(s.metrics.count("kl") == 0);  // beta 0: no reference
}

TEST_CASE("stage grpo refuses options it does not run with, naming them", "[grpo][trainer]") {
  const std::string dir = test::temp_dir("grpo-options");
  auto comm = std::shared_ptr<Communicator>(test::join());
  const auto refused = [&](const std::vector<std::string>& extra, const std::string& what) {
    TrainingArguments args;
    apply_training_flags(
        args, grpo_flags(dir + "/" + std::to_string(std::hash<std::string>()(what)), 4, 2, extra));
    CHECK_THROWS_WITH(Trainer(args, comm), Catch::Contains(what));
  };
  {
    TrainingArguments args;  // refused as it is read
    CHECK_THROWS_WITH(apply_training_flags(
                          args, grpo_flags(dir + "/iterations", 4, 2, {"--num_iterations", "0"})),
                      Catch::Contains("num_iterations") && Catch::Contains("from 1"));
  }
  refused({"--loss_type", "sigmoid"}, "loss_type 'sigmoid'");
  refused({"--importance_sampling_level", "token", "--loss_type", "luspo"}, "luspo");
  refused({"--reward_funcs", "accuracy,nonsense"}, "nonsense");
  refused({"--reward_funcs", "accuracy,think_format", "--reward_weights", "1"}, "1 weights for 2");
  refused({"--reward_funcs", "accuracy", "--reward_weights", "0x10"}, "not a decimal number");
  refused({"--reward_funcs", "overlong:1e999:4"}, "not a decimal number");
  refused({"--eval_file", write_prompts(dir + "/eval", 2), "--per_device_eval_batch_size", "3"},
          "per_device_eval_batch_size 3");
  // And a preference run refuses GRPO's losses.
  TrainingArguments dpo;
  apply_training_flags(dpo,
                       grpo_flags(dir + "/dpo", 4, 2, {"--stage", "dpo", "--loss_type", "dapo"}));
  CHECK_THROWS_WITH(Trainer(dpo, comm), Catch::Contains("stage grpo"));
}

namespace {

// A GRPO prompt file: plain-text prompts and conversational ones, with an answer column.
std::string write_prompts(const std::string& dir, int count) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/prompts.jsonl";
  std::ofstream f(path);
  for (int i = 0; i < count; ++i) {
    if (i % 3 == 2) {
      f << fmt::format(
               R"({{"prompt": [{{"role": "user", "content": "What is {} + {}?"}}], "answer": "{}"}})",
               i, 2 * i, 3 * i)
        << "\n";
    } else {
      f << fmt::format(R"({{"prompt": "Q: {} + 4 =", "answer": "#### {}", "level": {}}})", i, i + 4,
                       i % 2)
        << "\n";
    }
  }
  return path;
}

std::vector<std::string> grpo_file_flags(const std::string& dir, const std::string& out,
                                         int world) {
  return {"--model_config",
          test::kTinyModel,
          "--train_file",
          dir + "/prompts.jsonl",
          "--output_dir",
          out,
          "--template",
          "alpaca",
          "--stage",
          "grpo",
          "--num_generations",
          "2",
          "--max_completion_length",
          "6",
          "--per_device_train_batch_size",
          "4",
          "--gradient_accumulation_steps",
          std::to_string(2 / world),
          "--max_steps",
          "4",
          "--logging_steps",
          "1",
          "--save_steps",
          "2",
          "--learning_rate",
          "0.02",
          "--seed",
          "7",
          "--reward_funcs",
          "accuracy,repetition:2:-1",
          "--reward_weights",
          "1,0.5",
          "--pref_beta",
          "0.05",
          "--finetuning_type",
          "lora",
          "--lora_r",
          "4"};
}

}  // namespace

TEST_CASE("rank: grpo run", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args, test::split_flags(std::getenv("ZT_FLAGS")));
  Trainer trainer(args, comm);
  CHECK(trainer.train().global_step == args.max_steps);
}

TEST_CASE("stage grpo trains from a prompt file alike at world 1 and 2, and resumes mid-run",
          "[grpo][trainer]") {
  if (test::skip_cpu_world(2)) return;
  const std::string dir = test::temp_dir("grpo-file");
  write_prompts(dir, 8);
  // Evaluated every 2 steps on 5 prompts, one a rank and batch: 5 batches at world 1, 3 at
  // world 2, whose last leaves rank 1 without a prompt.
  const std::string eval_prompts = write_prompts(dir + "/eval", 5);
  const auto run = [&](int world, const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> flags = grpo_file_flags(dir, dir + "/" + name, world);
    flags.insert(flags.end(), {"--eval_file", eval_prompts, "--eval_strategy", "steps",
                               "--eval_steps", "2", "--per_device_eval_batch_size", "2"});
    flags.insert(flags.end(), extra.begin(), extra.end());
    test::run_ranks(world, "rank: grpo run", std::chrono::seconds(240),
                    {{"ZT_FLAGS", test::join_flags(flags)}});
    return dir + "/" + name;
  };
  const std::string one = run(1, "one", {});
  const std::string two = run(2, "two", {});
  for (const char* key :
       {"loss", "reward", "reward_std", "rewards/accuracy/mean", "rewards/repetition/mean",
        "completions/mean_length", "kl", "clip_ratio/region_mean", "frac_reward_zero_std"}) {
    const auto want = test::logged(one, key), got = test::logged(two, key);
    INFO(key);
    REQUIRE(want.size() == 4);
    for (const auto& [step, value] : want) {
      INFO("step " << step);
      CHECK(got.at(step) == Approx(value).epsilon(1e-4).margin(1e-6));
    }
  }
  // The evaluations: TRL's metrics with eval_ names, over the whole evaluation set, the same at
  // either world size (the completions' draws are their places in the evaluation).
  for (const char* key :
       {"eval_loss", "eval_reward", "eval_reward_std", "eval_rewards/accuracy/mean",
        "eval_completions/mean_length", "eval_completions/clipped_ratio", "eval_kl", "eval_entropy",
        "eval_clip_ratio/region_mean", "eval_frac_reward_zero_std"}) {
    const auto want = test::logged(one, key), got = test::logged(two, key);
    INFO(key);
    REQUIRE(want.size() == 2);  // steps 2 and 4 (the final evaluation is step 4's)
    for (const auto& [step, value] : want) {
      INFO("step " << step);
      CHECK(got.at(step) == Approx(value).epsilon(1e-4).margin(1e-6));
    }
  }
  // The reward is the weighted sum of the functions' means (every completion scored by both).
  const auto reward = test::logged(one, "reward");
  const auto accuracy = test::logged(one, "rewards/accuracy/mean");
  const auto repetition = test::logged(one, "rewards/repetition/mean");
  for (const auto& [step, value] : reward) {
    CHECK(value == Approx(accuracy.at(step) + 0.5 * repetition.at(step)).margin(1e-9));
  }
  // Resumed from step 2 at the other world size: steps 3 and 4 as the whole run had them.
  std::filesystem::create_directories(dir + "/resumed");
  std::filesystem::copy(two + "/checkpoint-2", dir + "/resumed/checkpoint-2",
                        std::filesystem::copy_options::recursive);
  const std::string resumed =
      run(1, "resumed", {"--resume_from_checkpoint", dir + "/resumed/checkpoint-2"});
  CHECK(test::logged(resumed, "eval_reward").at(4) ==
        Approx(test::logged(one, "eval_reward").at(4)).epsilon(1e-4).margin(1e-6));
  for (const char* key : {"loss", "reward", "kl"}) {
    for (int64_t step = 3; step <= 4; ++step) {
      INFO(key << " at step " << step);
      CHECK(test::logged(resumed, key).at(step) ==
            Approx(test::logged(one, key).at(step)).epsilon(1e-4).margin(1e-6));
    }
  }
  // A bad row is named with its file and line.
  std::ofstream(dir + "/prompts.jsonl", std::ios::app) << R"({"question": "no prompt"})"
                                                       << "\n";
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args, grpo_file_flags(dir, dir + "/bad", 1));
  CHECK_THROWS_WITH(Trainer(args, comm),
                    Catch::Contains("prompts.jsonl' line 9") && Catch::Contains("\"prompt\""));
  // A FIFO as the prompt file is refused at once, never waited on.
  const std::string fifo = dir + "/fifo.jsonl";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::vector<std::string> fifo_flags = grpo_file_flags(dir, dir + "/fifo-out", 1);
  for (size_t i = 0; i + 1 < fifo_flags.size(); ++i)
    if (fifo_flags[i] == "--train_file") fifo_flags[i + 1] = fifo;
  TrainingArguments fifo_args;
  apply_training_flags(fifo_args, fifo_flags);
  CHECK_THROWS_WITH(Trainer(fifo_args, comm), Catch::Contains("FIFO"));
}

TEST_CASE("num_iterations trains a generation batch again, its ratio to the sampling policy",
          "[grpo][trainer]") {
  // TRL's μ: a batch is generated, then trained on μ optimizer steps in a row; the ratio is to
  // the log-probs of the policy that sampled (taken before the first update), so the first
  // update is num_iterations 1's and the later ones see the moved policy clipped.
  const std::string dir = test::temp_dir("grpo-iterations");
  auto comm = std::shared_ptr<Communicator>(test::join());
  const auto trainer_with = [&](const std::string& name, int mu) {
    TrainingArguments args;
    apply_training_flags(
        args, grpo_flags(dir + "/" + name, 4, 2,
                         {"--finetuning_type", "full", "--loss_type", "grpo", "--num_iterations",
                          std::to_string(mu), "--epsilon", "1e-6", "--max_steps", "6"}));
    return std::make_unique<Trainer>(args, comm);
  };
  const std::vector<RewardFunction> rewards{ascii_share(), builtin_reward("repetition:2:-1")};
  auto once = trainer_with("once", 1);
  auto twice = trainer_with("twice", 2);
  const GrpoStepStats a1 = once->train_grpo_step(grpo_prompts(0), rewards);
  const GrpoStepStats b1 = twice->train_grpo_step(grpo_prompts(0), rewards);
  CHECK(b1.completions == a1.completions);
  CHECK(b1.rewards == a1.rewards);
  CHECK(b1.loss == Approx(a1.loss).margin(1e-7));
  CHECK(b1.metrics.at("clip_ratio/region_mean") == 0.0);  // the ratio is 1
  // The same completions again: nothing generated, the policy moved by one update, so with
  // epsilon 1e-6 the tokens whose ratio moved with their advantage's sign are clipped.
  const GrpoStepStats b2 = twice->train_grpo_step(grpo_prompts(0), rewards);
  CHECK(b2.stepped);
  CHECK(b2.global_step == 2);
  CHECK(b2.completions.empty());
  CHECK(b2.metrics.count("reward") == 0);
  CHECK(b2.metrics.at("clip_ratio/region_mean") > 0.05);
  CHECK(b2.loss != Approx(b1.loss));
  // The third step generates for its own prompts; the fourth must repeat them.
  const GrpoStepStats b3 = twice->train_grpo_step(grpo_prompts(1), rewards);
  CHECK(b3.completions.size() == 8);
  CHECK(b3.metrics.count("reward") == 1);
  CHECK_THROWS_WITH(twice->train_grpo_step(grpo_prompts(2), rewards),
                    Catch::Contains("num_iterations 2") && Catch::Contains("same prompts"));

  // Through train(): each prompt batch trains num_iterations steps, generation metrics logged at
  // the steps that generated; the same at world 1 and 2.
  if (test::skip_cpu_world(2)) return;
  write_prompts(dir, 8);
  const auto run = [&](int world, const std::string& name) {
    std::vector<std::string> flags = grpo_file_flags(dir, dir + "/" + name, world);
    for (const char* f : {"--num_iterations", "2", "--epsilon", "0.01"}) flags.emplace_back(f);
    test::run_ranks(world, "rank: grpo run", std::chrono::seconds(240),
                    {{"ZT_FLAGS", test::join_flags(flags)}});
    return dir + "/" + name;
  };
  const std::string one = run(1, "run-one"), two = run(2, "run-two");
  const auto reward = test::logged(one, "reward");
  CHECK(reward.size() == 2);
  CHECK(reward.count(1) == 1);
  CHECK(reward.count(3) == 1);
  for (const char* key : {"loss", "reward", "clip_ratio/region_mean", "completions/mean_length"}) {
    const auto want = test::logged(one, key), got = test::logged(two, key);
    INFO(key);
    REQUIRE(!want.empty());
    for (const auto& [step, value] : want) {
      INFO("step " << step);
      CHECK(got.at(step) == Approx(value).epsilon(1e-4).margin(1e-6));
    }
  }
  CHECK(test::logged(one, "loss").size() == 4);
  // Resumed between a batch's two uses (step 1): the rest of that batch is generated anew, the
  // next batch's first step generates for its own prompts, and the run ends.
  std::vector<std::string> resume = grpo_file_flags(dir, dir + "/run-resumed", 1);
  for (const char* f : {"--num_iterations", "2", "--epsilon", "0.01", "--save_steps", "1"})
    resume.emplace_back(f);
  test::run_ranks(1, "rank: grpo run", std::chrono::seconds(240),
                  {{"ZT_FLAGS", test::join_flags(resume)}});
  std::vector<std::string> again = grpo_file_flags(dir, dir + "/run-again", 1);
  for (const std::string& f :
       {std::string("--num_iterations"), std::string("2"), std::string("--epsilon"),
        std::string("0.01"), std::string("--resume_from_checkpoint"),
        dir + "/run-resumed/checkpoint-1"})
    again.push_back(f);
  test::run_ranks(1, "rank: grpo run", std::chrono::seconds(240),
                  {{"ZT_FLAGS", test::join_flags(again)}});
  const auto resumed = test::logged(dir + "/run-again", "reward");
  CHECK(resumed.count(2) == 1);
  CHECK(resumed.count(3) == 1);
  CHECK(test::logged(dir + "/run-again", "loss").count(4) == 1);
}

TEST_CASE("rank: grpo host rewards", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args, test::split_flags(std::getenv("ZT_FLAGS")));
  const std::string mode = std::getenv("ZT_MODE");
  const std::string flag = std::string(std::getenv("ZT_DIR")) + "/rank0-failed";
  Trainer trainer(args, comm);
  const RewardFn ones = [](const std::vector<RewardInput>& b) {
    return std::vector<std::optional<double>>(b.size(), 1.0);
  };
  trainer.add_reward({"ones", ones});
  if (mode == "uneven") {
    if (comm->rank() == 1) trainer.add_reward({"more", ones});
    CHECK_THROWS_WITH(trainer.train(), Catch::Contains("every rank adds the same ones"));
    return;
  }
  // Rank 1's function asks to stop at its first call. Rank 1 then stays up until rank 0 has
  // its error, and the collectives' timeout is longer than the test's (ZT_TEST_TIMEOUT_MS): rank
  // 0 learns of it from the ranks' agreement, neither from a peer that went away nor a timeout.
  const RewardFn stops = [](const std::vector<RewardInput>&) -> std::vector<std::optional<double>> {
    throw CancelledError("the host stops");
  };
  trainer.add_reward({"stops", comm->rank() == 1 ? stops : ones});
  if (comm->rank() == 1) {
    CHECK_THROWS_AS(trainer.train(), CancelledError);
    for (int i = 0; i < 1200 && !std::filesystem::exists(flag); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CHECK(std::filesystem::exists(flag));
  } else {
    CHECK_THROWS_WITH(trainer.train(),
                      Catch::Contains("scoring the completions (a reward function) failed on "
                                      "rank(s) 1"));
    std::ofstream(flag) << "done\n";
  }
}

TEST_CASE("host reward functions: the same on every rank, and one that stops tells the others",
          "[grpo][trainer]") {
  if (test::skip_cpu_world(2)) return;
  const std::string dir = test::temp_dir("grpo-host");
  write_prompts(dir, 8);
  std::vector<std::string> flags = grpo_file_flags(dir, dir + "/out", 2);
  for (size_t i = 0; i + 1 < flags.size(); ++i) {
    if (flags[i] == "--reward_funcs") flags[i + 1] = "accuracy";
    if (flags[i] == "--reward_weights") flags[i + 1] = "";
  }
  for (const char* mode : {"uneven", "stops"}) {
    INFO(mode);
    test::run_ranks(2, "rank: grpo host rewards", std::chrono::seconds(240),
                    {{"ZT_FLAGS", test::join_flags(flags)},
                     {"ZT_MODE", mode},
                     {"ZT_DIR", dir},
                     {"ZT_TEST_TIMEOUT_MS", "600000"}});
  }
}

TEST_CASE("a host reward function joins the built-ins, weighted after them", "[grpo][trainer]") {
  const std::string dir = test::temp_dir("grpo-host-one");
  write_prompts(dir, 8);
  auto comm = std::shared_ptr<Communicator>(test::join());
  std::vector<std::string> flags = grpo_file_flags(dir, dir + "/out", 1);
  for (size_t i = 0; i + 1 < flags.size(); ++i) {
    if (flags[i] == "--max_steps") flags[i + 1] = "2";
    if (flags[i] == "--reward_weights") flags[i + 1] = "1,0.5,3";
  }
  TrainingArguments args;
  apply_training_flags(args, flags);
  Trainer trainer(args, comm);
  int64_t calls = 0, seen = 0;
  trainer.add_reward({"length", [&](const std::vector<RewardInput>& batch) {
                        ++calls;
                        std::vector<std::optional<double>> out;
                        for (const RewardInput& r : batch) {
                          ++seen;
                          CHECK(r.columns.count("answer") == 1);
                          CHECK(!r.completion_ids.empty());
                          out.push_back(static_cast<double>(r.completion_ids.size()));
                        }
                        return out;
                      }});
  CHECK_THROWS_WITH(trainer.add_reward({"length", nullptr}), Catch::Contains("no function"));
  CHECK_THROWS_WITH(
      trainer.add_reward(
          {"accuracy", [](const auto& b) { return std::vector<std::optional<double>>(b.size()); }}),
      Catch::Contains("'accuracy' is already there"));
  trainer.train();
  CHECK(calls == 2);
  CHECK(seen == 16);  // 2 steps × 4 prompts × 2 generations
  const auto reward = test::logged(dir + "/out", "reward");
  const auto accuracy = test::logged(dir + "/out", "rewards/accuracy/mean");
  const auto repetition = test::logged(dir + "/out", "rewards/repetition/mean");
  const auto length = test::logged(dir + "/out", "rewards/length/mean");
  const auto mean_length = test::logged(dir + "/out", "completions/mean_length");
  REQUIRE(length.size() == 2);
  for (int64_t step = 1; step <= 2; ++step) {
    CHECK(length.at(step) == Approx(mean_length.at(step)));
    CHECK(reward.at(step) ==
          Approx(accuracy.at(step) + 0.5 * repetition.at(step) + 3 * length.at(step)));
  }
  // A run with no reward function at all is refused when it starts, naming the ways to add one.
  for (size_t i = 0; i + 1 < flags.size(); ++i) {
    if (flags[i] == "--reward_funcs" || flags[i] == "--reward_weights") flags[i + 1] = "";
    if (flags[i] == "--output_dir") flags[i + 1] = dir + "/none";
  }
  TrainingArguments none;
  apply_training_flags(none, flags);
  CHECK_THROWS_WITH(Trainer(none, comm).train(),
                    Catch::Contains("reward_funcs") && Catch::Contains("add_reward"));
}

TEST_CASE("a reward program scores completions over JSON lines, and its failures are named",
          "[grpo][rewards]") {
  std::vector<RewardInput> batch(5);
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].prompt = "Q" + std::to_string(i);
    batch[i].completion = std::string(i, 'x') + "\"quoted\"\n";
    batch[i].completion_ids = {static_cast<int64_t>(i), 7};
    batch[i].columns["answer"] = i % 2 ? "odd" : "even";
  }
  // A long-lived Python program: the completion's length plus 100 for odd answers, None for
  // prompt Q3; it counts the lines it has read, so a second batch shows it kept running.
  const std::string script =
      "python3 -u -c \"import sys, json\n"
      "seen = 0\n"
      "for line in sys.stdin:\n"
      "    o = json.loads(line); seen += 1\n"
      "    if o['prompt'] == 'Q3': print('null'); continue\n"
      "    print(len(o['completion']) + (100 if o['answer'] == 'odd' else 0) + 1000 * (seen > 5) "
      "+ len(o['completion_ids']) / 10)\n\"";
  train::RewardProcess p(script, 30);
  auto r = p.score(batch);
  REQUIRE(r.size() == 5);
  for (size_t i = 0; i < 5; ++i) {
    INFO(i);
    if (i == 3) {
      CHECK_FALSE(r[i].has_value());
    } else {
      CHECK(*r[i] ==
            Approx(static_cast<double>(batch[i].completion.size()) + (i % 2 ? 100 : 0) + 0.2));
    }
  }
  r = p.score(batch);  // the same process: it has read 10 lines now
  CHECK(*r[0] == Approx(1000 + batch[0].completion.size() + 0.2));

  const auto fails = [&](const std::string& command, double timeout, const std::string& what) {
    train::RewardProcess q(command, timeout);
    CHECK_THROWS_WITH(q.score(batch), Catch::Contains(what) && Catch::Contains("reward_command"));
  };
  fails("exit 3", 10, "exited with status 3");
  fails("read line; sleep 20", 0.5, "within reward_timeout 0.5 s");
  fails("while read line; do echo hello; done", 10, "\"hello\", not a finite decimal number");
  fails("while read line; do echo 0x10; done", 10, "\"0x10\", not a finite decimal number");
  fails("while read line; do echo inf; done", 10, "\"inf\", not a finite decimal number");
  fails("read line; echo 1; exit 0", 10, "completion 1 of 5");
  fails("no_such_program_zt", 10, "exited with status 127");
  // Two lines per completion: out of step, refused in this batch (when the extra lines are there
  // when it ends) or the next one, never read as the next completions' rewards.
  train::RewardProcess twice("while read line; do echo 1; echo 2; done", 10);
  bool refused = false;
  try {
    twice.score(batch);
  } catch (const Error& e) {
    refused = std::string(e.what()).find("more lines than completions") != std::string::npos;
  }
  if (!refused) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    CHECK_THROWS_WITH(twice.score(batch), Catch::Contains("more lines than completions"));
  }
  // A NaN answer is named with its completion, through the scoring.
  train::RewardProcess nan_process("while read line; do echo nan; done", 10);
  CHECK_THROWS_WITH(
      train::score_completions(
          {{"command", [&](const std::vector<RewardInput>& b) { return nan_process.score(b); }}},
          batch, 1),
      Catch::Contains("'command'") && Catch::Contains("completion 0"));
  // After a failure the next batch starts the program anew.
  train::RewardProcess flaky("read line; sleep 5", 0.3);
  CHECK_THROWS(flaky.score(batch));
  CHECK_THROWS_WITH(flaky.score(batch), Catch::Contains("within reward_timeout"));
}

TEST_CASE("stage grpo takes a reward program beside the built-ins", "[grpo][trainer]") {
  const std::string dir = test::temp_dir("grpo-command");
  write_prompts(dir, 8);
  auto comm = std::shared_ptr<Communicator>(test::join());
  // The program's reward: 1 for a completion of the prompt whose answer is "#### 5", else 0.
  const std::string program =
      "python3 -u -c \"import sys, json\n"
      "for line in sys.stdin:\n"
      "    print(1.0 if json.loads(line)['answer'] == '#### 5' else 0.0)\n\"";
  std::vector<std::string> flags = grpo_file_flags(dir, dir + "/out", 1);
  for (size_t i = 0; i + 1 < flags.size(); ++i) {
    if (flags[i] == "--max_steps") flags[i + 1] = "2";
    if (flags[i] == "--reward_weights") flags[i + 1] = "1,0.5,2";
  }
  flags.insert(flags.end(), {"--reward_command", program});
  TrainingArguments args;
  apply_training_flags(args, flags);
  Trainer(args, comm).train();
  const auto command = test::logged(dir + "/out", "rewards/command/mean");
  REQUIRE(command.size() == 2);
  // 8 prompts in 2 steps of 4: prompt 1 ("#### 5") is in one of them, its 2 completions of 8.
  CHECK(command.at(1) + command.at(2) == Approx(0.25));
  const auto reward = test::logged(dir + "/out", "reward");
  const auto accuracy = test::logged(dir + "/out", "rewards/accuracy/mean");
  const auto repetition = test::logged(dir + "/out", "rewards/repetition/mean");
  for (int64_t step = 1; step <= 2; ++step) {
    CHECK(reward.at(step) ==
          Approx(accuracy.at(step) + 0.5 * repetition.at(step) + 2 * command.at(step)));
  }
  // Weights must count the program too.
  flags.back() = program;
  for (size_t i = 0; i + 1 < flags.size(); ++i) {
    if (flags[i] == "--reward_weights") flags[i + 1] = "1,0.5";
    if (flags[i] == "--output_dir") flags[i + 1] = dir + "/out2";
  }
  TrainingArguments two;
  apply_training_flags(two, flags);
  CHECK_THROWS_WITH(Trainer(two, comm), Catch::Contains("2 weights for 3"));
}

TEST_CASE("steps_per_generation: one generation batch feeds several optimizer steps, a slice each",
          "[grpo][trainer]") {
  // TRL's steps_per_generation: the completions of steps_per_generation micro-batches are made
  // at once and each optimizer step trains on its slice; dapo divides by the tokens of the whole
  // generation batch. With weights that barely move, the slices' losses add up to the loss of
  // one step over the whole batch (the same completions: draws depend on seed, stream, step).
  const std::string dir = test::temp_dir("grpo-slices");
  auto comm = std::shared_ptr<Communicator>(test::join());
  const auto trainer_with = [&](const std::string& name, int64_t accum,
                                std::vector<std::string> extra) {
    TrainingArguments args;
    extra.insert(extra.end(), {"--finetuning_type", "full", "--learning_rate", "1e-9"});
    apply_training_flags(args, grpo_flags(dir + "/" + name, 4, accum, extra));
    return std::make_unique<Trainer>(args, comm);
  };
  const std::vector<RewardFunction> rewards{ascii_share(), builtin_reward("repetition:2:-1")};
  auto whole = trainer_with("whole", 2, {});
  auto sliced = trainer_with("sliced", 1, {"--steps_per_generation", "2"});
  const GrpoStepStats w = whole->train_grpo_step(grpo_prompts(0), rewards);
  const GrpoStepStats s1 = sliced->train_grpo_step(grpo_prompts(0), rewards);
  CHECK(s1.completions == w.completions);
  CHECK(s1.rewards == w.rewards);
  CHECK(s1.metrics.at("reward") == w.metrics.at("reward"));
  const GrpoStepStats s2 = sliced->train_grpo_step(grpo_prompts(0), rewards);
  CHECK(s2.stepped);
  CHECK(s2.global_step == 2);
  CHECK(s2.completions.empty());
  CHECK(s2.metrics.count("reward") == 0);
  CHECK(s1.loss != Approx(w.loss).margin(1e-6));
  CHECK(s1.loss + s2.loss == Approx(w.loss).margin(1e-6));
  // The next call generates for its own prompts; the one after must repeat them.
  const GrpoStepStats s3 = sliced->train_grpo_step(grpo_prompts(1), rewards);
  CHECK(s3.completions.size() == 8);
  CHECK_THROWS_WITH(sliced->train_grpo_step(grpo_prompts(2), rewards),
                    Catch::Contains("steps_per_generation 2") && Catch::Contains("same prompts"));
  // A generation batch of two prompts is refused for a step that needs four.
  auto other = trainer_with("other", 1, {"--steps_per_generation", "2"});
  const std::vector<GrpoPrompt> four = grpo_prompts(0);
  const std::vector<GrpoPrompt> two(four.begin(), four.begin() + 2);
  CHECK_THROWS_WITH(other->train_grpo_step(two, rewards),
                    Catch::Contains("steps_per_generation") && Catch::Contains("give 4 prompts"));
  // Not a multiple of the accumulation steps: refused, naming both.
  CHECK_THROWS_WITH(trainer_with("odd", 2, {"--steps_per_generation", "3"}),
                    Catch::Contains("steps_per_generation 3") &&
                        Catch::Contains("gradient_accumulation_steps 2"));

  // Through train(): generation at the first step of each two, the same at world 1 and 2, and a
  // run resumed inside a generation batch trains on the rest of a new one.
  if (test::skip_cpu_world(2)) return;
  write_prompts(dir, 8);
  const auto run = [&](int world, const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> flags = grpo_file_flags(dir, dir + "/" + name, world);
    // grpo_file_flags accumulates 2 / world micro-batches: a generation batch of twice that.
    flags.insert(flags.end(),
                 {"--steps_per_generation", std::to_string(2 * (2 / world)), "--save_steps", "1"});
    flags.insert(flags.end(), extra.begin(), extra.end());
    test::run_ranks(world, "rank: grpo run", std::chrono::seconds(240),
                    {{"ZT_FLAGS", test::join_flags(flags)}});
    return dir + "/" + name;
  };
  const std::string one = run(1, "run-one", {}), two_ranks = run(2, "run-two", {});
  const auto reward = test::logged(one, "reward");
  CHECK(reward.size() == 2);
  CHECK(reward.count(1) == 1);
  CHECK(reward.count(3) == 1);
  for (const char* key : {"loss", "reward", "kl", "entropy", "completions/mean_length"}) {
    const auto want = test::logged(one, key), got = test::logged(two_ranks, key);
    INFO(key);
    REQUIRE(!want.empty());
    for (const auto& [step, value] : want) {
      INFO("step " << step);
      CHECK(got.at(step) == Approx(value).epsilon(1e-4).margin(1e-6));
    }
  }
  std::filesystem::create_directories(dir + "/resumed");
  std::filesystem::copy(one + "/checkpoint-1", dir + "/resumed/checkpoint-1",
                        std::filesystem::copy_options::recursive);
  const std::string resumed =
      run(1, "resumed", {"--resume_from_checkpoint", dir + "/resumed/checkpoint-1"});
  const auto again = test::logged(resumed, "reward");
  CHECK(again.count(2) == 1);  // the rest of the interrupted batch, generated anew
  CHECK(again.count(3) == 1);  // the next batch, from its first step
  CHECK(test::logged(resumed, "loss").count(4) == 1);
}

TEST_CASE("GRPO scores at the sampling temperature and logs the entropy, and stops at strings",
          "[grpo][trainer]") {
  // TRL divides the logits by the temperature before it scores completions: a low temperature
  // makes the scored distribution sharp, so its logged entropy falls well below temperature 1's
  // (which for a random model is about log 259: scored at temperature 1, the cold run's
  // completions would log that too).
  const std::string dir = test::temp_dir("grpo-temperature");
  auto comm = std::shared_ptr<Communicator>(test::join());
  const auto step_with = [&](const std::string& name, std::vector<std::string> extra) {
    TrainingArguments args;
    apply_training_flags(args, grpo_flags(dir + "/" + name, 4, 2, extra));
    Trainer trainer(args, comm);
    return trainer.train_grpo_step(grpo_prompts(0), {ascii_share()});
  };
  const GrpoStepStats warm = step_with("t1", {});
  const GrpoStepStats cold = step_with("t005", {"--temperature", "0.05"});
  const double log_vocab = std::log(259.0);
  INFO("entropy at 1: " << warm.metrics.at("entropy")
                        << ", at 0.05: " << cold.metrics.at("entropy"));
  CHECK(warm.metrics.at("entropy") > 0.5 * log_vocab);
  CHECK(warm.metrics.at("entropy") <= log_vocab + 1e-6);
  CHECK(warm.metrics.at("entropy") > log_vocab - 0.1);
  CHECK(cold.metrics.at("entropy") < warm.metrics.at("entropy") - 1.0);
  // Stop strings end completions (the completing token kept) and count as terminated; a list
  // that is no list of strings is refused before any weight is read.
  // Every printable ASCII character but '"' and '\\' (a random model's bytes hit one often).
  std::string list = "[", printable;
  for (char ch = 0x20; ch < 0x7f; ++ch) {
    if (ch == '"' || ch == '\\') continue;
    list += fmt::format("{}\"{}\"", list.size() > 1 ? ", " : "", ch);
    printable += ch;
  }
  list += "]";
  const GrpoStepStats stopped = step_with("stops", {"--stop_strings", list});
  CHECK(stopped.metrics.at("completions/mean_length") < warm.metrics.at("completions/mean_length"));
  CHECK(stopped.metrics.at("completions/clipped_ratio") <
        warm.metrics.at("completions/clipped_ratio"));
  for (const std::string& c : stopped.completions) {
    INFO(c);
    const size_t hit = c.find_first_of(printable);
    CHECK((hit == std::string::npos || hit == c.size() - 1));
  }
  TrainingArguments bad;
  apply_training_flags(bad, grpo_flags(dir + "/bad", 4, 2, {"--stop_strings", "[1, 2]"}));
  CHECK_THROWS_WITH(Trainer(bad, comm), Catch::Contains("stop_strings"));
}
