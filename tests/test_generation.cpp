// Generation: batched decoding of prompts of different lengths against transformers' own
// `generate` (fixtures tests/tools/make_generation_fixtures.py made on the GPU machine), its
// logits processors against the scores transformers sampled from, and the sampler's
// independence from the batch a sequence is generated in.
#include "support/catch.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "model/decoding.hpp"
#include "model/layers.hpp"
#include "model/sampling.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"

using namespace zt;

namespace {

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

std::shared_ptr<CausalLM> tiny_llama() {
  ModelConfig c = load_model_config(fixture("models/llama"));
  auto model = std::make_shared<CausalLM>(c, at::TensorOptions().dtype(at::kFloat), false);
  load_weights(*model, *checkpoint_source(fixture("models/llama")));
  return model;
}

std::vector<int64_t> ints(const rapidjson::Value& a) {
  std::vector<int64_t> out;
  for (const auto& v : a.GetArray()) out.push_back(v.GetInt64());
  return out;
}

// A [rows, cols] float tensor of a JSON matrix (null: -inf).
at::Tensor matrix(const rapidjson::Value& a) {
  std::vector<float> flat;
  int64_t rows = 0, cols = 0;
  for (const auto& row : a.GetArray()) {
    ++rows;
    cols = row.Size();
    for (const auto& v : row.GetArray())
      flat.push_back(v.IsNull() ? -std::numeric_limits<float>::infinity() : v.GetFloat());
  }
  return at::tensor(flat).view({rows, cols});
}

}  // namespace

TEST_CASE("batched greedy generation of prompts of different lengths is transformers'",
          "[generate]") {
  auto model = tiny_llama();
  const rapidjson::Document doc =
      json::parse(files::read_text(fixture("generation/greedy.json")), "greedy.json");
  for (const auto& c : doc["cases"].GetArray()) {
    INFO(c["name"].GetString());
    GenerationOptions o;
    o.max_new_tokens = c["max_new_tokens"].GetInt64();
    o.eos_token_ids = ints(c["eos_token_ids"]);
    o.repetition_penalty = c["repetition_penalty"].GetDouble();
    std::vector<std::vector<int64_t>> prompts;
    for (const auto& p : c["prompts"].GetArray()) prompts.push_back(ints(p));
    const std::vector<Generated> got = model->generate_batch(prompts, o);
    REQUIRE(got.size() == prompts.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("prompt " << i);
      const std::vector<int64_t> want = ints(c["completions"][static_cast<rapidjson::SizeType>(i)]);
      CHECK(got[i].tokens == want);
      const bool ended = !want.empty() && std::find(o.eos_token_ids.begin(), o.eos_token_ids.end(),
                                                    want.back()) != o.eos_token_ids.end();
      CHECK(got[i].stopped == ended);
    }
  }
}

TEST_CASE("the logits processors leave transformers' sampling scores", "[generate]") {
  const rapidjson::Document doc =
      json::parse(files::read_text(fixture("generation/sampling.json")), "sampling.json");
  int compared = 0;
  for (const auto& c : doc["cases"].GetArray()) {
    INFO(c["name"].GetString());
    const auto& opt = c["options"];
    GenerationOptions o;
    o.do_sample = true;
    o.temperature = opt["temperature"].GetDouble();
    o.top_k = opt["top_k"].GetInt64();
    o.top_p = opt["top_p"].GetDouble();
    o.min_p = opt["min_p"].IsNull() ? 0.0 : opt["min_p"].GetDouble();
    o.repetition_penalty = opt["repetition_penalty"].GetDouble();
    for (const auto& step : c["steps"].GetArray()) {
      const at::Tensor logits = matrix(step["logits"]);
      const at::Tensor want = matrix(step["scores"]);
      at::Tensor seen = at::zeros(logits.sizes(), at::kBool);
      size_t longest = 0;
      for (const auto& h : step["history"].GetArray())
        longest = std::max<size_t>(longest, h.Size());
      int64_t row = 0;
      for (const auto& h : step["history"].GetArray()) {
        for (int64_t t : ints(h)) seen[row][t] = true;
        // transformers' input_ids hold a padded row's padding (id 0) too, and its repetition
        // penalty counts it (docs/generation.md): given here, so that the formulas compare.
        if (h.Size() < longest) seen[row][0] = true;
        ++row;
      }
      const at::Tensor got = model::process_logits(logits, seen, o);
      // The same tokens filtered out, the same values elsewhere.
      CHECK(at::equal(got.isinf(), want.isinf()));
      const at::Tensor kept = want.isinf().logical_not();
      CHECK(at::allclose(got.masked_select(kept), want.masked_select(kept), 1e-5, 1e-5));
      ++compared;
    }
  }
  CHECK(compared >= 12);
}

TEST_CASE("a sequence generates the same tokens alone and in any batch", "[generate]") {
  auto model = tiny_llama();
  const std::vector<std::vector<int64_t>> prompts = {
      {1, 17, 33, 90, 5}, {1, 44}, {1, 3, 99, 120, 7, 8, 9, 10}, {1, 70, 71}};
  for (bool sample : {false, true}) {
    INFO("do_sample " << sample);
    GenerationOptions o;
    o.max_new_tokens = 10;
    o.do_sample = sample;
    o.temperature = 1.5;
    o.top_p = 0.95;
    o.seed = 11;
    o.repetition_penalty = 1.1;
    const std::vector<Generated> together = model->generate_batch(prompts, o, {5, 6, 7, 8});
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto alone = model->generate_batch({prompts[i]}, o, {5 + i});
      CHECK(alone[0].tokens == together[i].tokens);
    }
    // Reversed order, other batch mates: the streams decide.
    const auto reversed = model->generate_batch({prompts[3], prompts[0]}, o, {8, 5});
    CHECK(reversed[0].tokens == together[3].tokens);
    CHECK(reversed[1].tokens == together[0].tokens);
    if (sample) {  // another seed draws another completion
      o.seed = 12;
      CHECK(model->generate_batch(prompts, o, {5, 6, 7, 8})[2].tokens != together[2].tokens);
    }
  }
}

TEST_CASE("finished sequences leave the batch and the others go on", "[generate]") {
  auto model = tiny_llama();
  const std::vector<std::vector<int64_t>> prompts = {{1, 17, 33}, {1, 44, 45, 46, 47}};
  GenerationOptions o;
  o.max_new_tokens = 8;
  const auto free_run = model->generate_batch(prompts, o);
  // Row 0 stops at its third token; row 1 continues as it would alone.
  o.eos_token_ids = {free_run[0].tokens[2]};
  const auto stopped = model->generate_batch(prompts, o);
  CHECK(stopped[0].tokens ==
        std::vector<int64_t>(free_run[0].tokens.begin(), free_run[0].tokens.begin() + 3));
  CHECK(stopped[0].stopped);
  const auto& row1 = free_run[1].tokens;
  const auto cut = std::find(row1.begin(), row1.end(), o.eos_token_ids[0]);
  CHECK(stopped[1].tokens == std::vector<int64_t>(row1.begin(), cut == row1.end() ? cut : cut + 1));
  CHECK(stopped[1].stopped == (cut != row1.end()));
}

TEST_CASE("adapters generate padded batches as they generate each prompt alone", "[generate]") {
  const std::vector<std::vector<int64_t>> prompts = {{1, 17, 33, 90, 5, 6}, {1, 44}};
  for (FinetuningType type :
       {FinetuningType::kLora, FinetuningType::kPTuning, FinetuningType::kPrefix}) {
    INFO("method " << static_cast<int>(type));
    auto model = tiny_llama();
    PeftConfig peft;
    peft.type = type;
    peft.prompt.num_virtual_tokens = 3;
    apply_peft(*model, peft, 5);
    {
      at::NoGradGuard no_grad;  // adapters that matter (LoRA's B starts at zero)
      for (auto& p : model->named_parameters()) {
        if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0, 0.3);
      }
    }
    GenerationOptions o;
    o.max_new_tokens = 6;
    const auto together = model->generate_batch(prompts, o);
    for (size_t i = 0; i < prompts.size(); ++i) {
      CHECK(model->generate_batch({prompts[i]}, o)[0].tokens == together[i].tokens);
    }
    // The adapter takes part: with it off, the completions differ.
    model->set_adapters_enabled(false);
    const auto base = model->generate_batch(prompts, o);
    model->set_adapters_enabled(true);
    CHECK((base[0].tokens != together[0].tokens || base[1].tokens != together[1].tokens));
  }
}

TEST_CASE("generation refuses bad options and prompts before generating", "[generate]") {
  auto model = tiny_llama();
  const std::vector<std::vector<int64_t>> ok = {{1, 2, 3}};
  const auto refuses = [&](GenerationOptions o, const std::string& what) {
    o.do_sample = true;
    CHECK_THROWS_WITH(model->generate_batch(ok, o), Catch::Contains(what));
  };
  GenerationOptions o;
  o.temperature = 0;
  refuses(o, "temperature");
  o = {};
  o.top_p = 1.5;
  refuses(o, "top_p");
  o = {};
  o.min_p = -0.1;
  refuses(o, "min_p");
  o = {};
  o.top_k = -1;
  refuses(o, "top_k");
  o = {};
  o.repetition_penalty = std::nan("");
  refuses(o, "repetition_penalty");
  o = {};
  o.max_new_tokens = -2;
  refuses(o, "max_new_tokens");
  CHECK_THROWS_WITH(model->generate_batch({{1, 2}, {}}, {}), Catch::Contains("prompt 1 is empty"));
  CHECK_THROWS_WITH(model->generate_batch({{1, 500}}, {}), Catch::Contains("token id 500"));
  CHECK_THROWS_WITH(model->generate_batch(ok, {}, {1, 2}), Catch::Contains("streams"));
}

TEST_CASE("sampling draws depend on the seed, stream and step alone", "[generate]") {
  const at::Tensor a = model::uniform_draws(3, {0, 1, 2}, 4);
  const at::Tensor b = model::uniform_draws(3, {2, 1, 0}, 4);
  CHECK(a[0].item<double>() == b[2].item<double>());
  CHECK(a[0].item<double>() != a[1].item<double>());
  CHECK(model::uniform_draws(3, {0}, 5)[0].item<double>() != a[0].item<double>());
  CHECK(model::uniform_draws(4, {0}, 4)[0].item<double>() != a[0].item<double>());
  // Inverse-CDF: the token whose probability interval holds u; filtered tokens never.
  const float ninf = -std::numeric_limits<float>::infinity();
  const at::Tensor scores =
      at::tensor({ninf, std::log(0.25f), ninf, std::log(0.75f)}).view({1, 4}).repeat({3, 1});
  const at::Tensor u = at::tensor({0.1, 0.3, 0.9999}, at::kDouble);
  const at::Tensor t = model::sample_tokens(scores, u);
  CHECK(t[0].item<int64_t>() == 1);
  CHECK(t[1].item<int64_t>() == 3);
  CHECK(t[2].item<int64_t>() == 3);
  // Over many draws the frequencies follow the probabilities.
  std::vector<uint64_t> streams(4000);
  for (size_t i = 0; i < streams.size(); ++i) streams[i] = i;
  const at::Tensor many = model::sample_tokens(scores.narrow(0, 0, 1).repeat({4000, 1}),
                                               model::uniform_draws(9, streams, 0));
  const double share = many.eq(1).to(at::kDouble).mean().item<double>();
  CHECK(share == Approx(0.25).margin(0.03));
}

namespace {

// Token texts for the stop-string tests: id → "<id>".
std::shared_ptr<const std::vector<std::string>> bracketed(int64_t vocab) {
  auto texts = std::make_shared<std::vector<std::string>>();
  for (int64_t i = 0; i < vocab; ++i) texts->push_back("<" + std::to_string(i) + ">");
  return texts;
}

}  // namespace

TEST_CASE("stop strings end a sequence at the token that completes them, as transformers'",
          "[generate]") {
  // transformers' StopStringCriteria documents these for the stop string "stop": a match needs
  // the last token to hold the string's end (overhangs off either end allowed), and a string
  // completed by earlier tokens does not count.
  const std::vector<std::string> vocab = {"st",  "op",     "stop", "opera", "sto",  "pper",
                                          "las", "topper", "s",    "to",    "pped", "at"};
  const auto id = [&](const std::string& t) {
    return static_cast<int64_t>(std::find(vocab.begin(), vocab.end(), t) - vocab.begin());
  };
  const StopStrings stop({"stop"}, std::make_shared<const std::vector<std::string>>(vocab));
  const auto ids = [&](std::initializer_list<const char*> tokens) {
    std::vector<int64_t> out;
    for (const char* t : tokens) out.push_back(id(t));
    return out;
  };
  for (const auto& seq : {ids({"st", "op"}), ids({"stop"}), ids({"st", "opera"}),
                          ids({"sto", "pper"}), ids({"las", "topper"}), ids({"s", "to", "pped"})}) {
    CHECK(stop.completes({}, seq));
  }
  for (const auto& seq : {ids({"stop", "at"}), ids({"st", "op", "at"}), ids({"st"}), ids({})}) {
    CHECK_FALSE(stop.completes({}, seq));
  }
  // The prompt's tokens hold the string's start; a string wholly in the prompt does not count.
  CHECK(stop.completes(ids({"las", "st"}), ids({"op"})));
  CHECK_FALSE(stop.completes(ids({"stop"}), ids({"at"})));
  // Several strings: any one completes.
  const StopStrings two({"xyz", "pp"}, std::make_shared<const std::vector<std::string>>(vocab));
  CHECK(two.completes({}, ids({"sto", "pped"})));
  CHECK_FALSE(two.completes({}, ids({"sto", "at"})));

  // The option's text: one string, or a JSON list; malformed lists are named.
  CHECK(StopStrings::parse("</answer>") == std::vector<std::string>{"</answer>"});
  CHECK(StopStrings::parse(R"(["a", "\n\n"])") == std::vector<std::string>{"a", "\n\n"});
  CHECK(StopStrings::parse("").empty());
  CHECK_THROWS_WITH(StopStrings::parse("[1]"), Catch::Contains("stop_strings"));
  CHECK_THROWS_WITH(StopStrings::parse("[]"), Catch::Contains("empty"));
  CHECK_THROWS_WITH(StopStrings::parse(R"(["a", ""])"), Catch::Contains("item 1"));
  CHECK_THROWS_WITH(StopStrings::parse("[\"a\""), Catch::Contains("stop_strings"));
  CHECK_THROWS_AS(StopStrings({}, bracketed(4)), InvalidArgument);
  CHECK_THROWS_AS(StopStrings({""}, bracketed(4)), InvalidArgument);
}

TEST_CASE("generation stops at the first stop string in the completion", "[generate]") {
  auto model = tiny_llama();
  const std::vector<std::vector<int64_t>> prompts = {{1, 17, 33}, {1, 44, 45, 46, 47}};
  GenerationOptions o;
  o.max_new_tokens = 8;
  const auto free_run = model->generate_batch(prompts, o);
  const auto texts = bracketed(model->config().vocab_size);
  const auto text_of = [&](int64_t t) { return (*texts)[static_cast<size_t>(t)]; };
  // Row 0's stop string starts inside its second token's text and ends inside its third's.
  const std::string a = text_of(free_run[0].tokens[1]), b = text_of(free_run[0].tokens[2]);
  const std::string s = a.substr(1) + b.substr(0, 2);
  o.stop_strings = std::make_shared<StopStrings>(std::vector<std::string>{s}, texts);
  const auto stopped = model->generate_batch(prompts, o);
  for (size_t r = 0; r < prompts.size(); ++r) {
    INFO("row " << r);
    // Where the string first ends in the whole text (prompt, then the free completion), past
    // the prompt: the sequence stops at the token holding that end.
    std::string whole;
    for (int64_t t : prompts[r]) whole += text_of(t);
    const size_t prompt_chars = whole.size();
    std::vector<size_t> ends;
    for (int64_t t : free_run[r].tokens) ends.push_back((whole += text_of(t)).size());
    size_t cut = free_run[r].tokens.size();
    bool found = false;
    for (size_t at = whole.find(s); at != std::string::npos && !found; at = whole.find(s, at + 1)) {
      if (at + s.size() <= prompt_chars) continue;
      found = true;
      cut = static_cast<size_t>(std::lower_bound(ends.begin(), ends.end(), at + s.size()) -
                                ends.begin()) +
            1;
    }
    CHECK(stopped[r].tokens ==
          std::vector<int64_t>(free_run[r].tokens.begin(), free_run[r].tokens.begin() + cut));
    CHECK(stopped[r].stopped == found);
  }
  CHECK(stopped[0].tokens.size() == 3);
}

TEST_CASE("scored log-probs and entropies at a temperature are those of the divided logits",
          "[generate][grpo]") {
  // TRL's GRPO scores completions with logits / temperature; its entropy metric is that
  // distribution's. Checked against the full logits of the same model.
  auto model = tiny_llama();
  const at::Tensor ids =
      at::tensor({1, 17, 33, 90, 5, 6, 1, 44, 45, 46, 47, 48}, at::kLong).view({2, 6});
  at::Tensor labels = ids.clone();
  labels[0][0] = -100;
  labels[1][2] = -100;
  const at::Tensor logits = model->logits(ids).to(at::kDouble);
  for (const double t : {1.0, 0.7, 2.5}) {
    INFO("temperature " << t);
    at::Tensor entropies;
    const at::Tensor got =
        model->label_log_probs(ids, labels, {}, 3, {}, nullptr, t, &entropies).to(at::kDouble);
    const at::Tensor scaled = logits / t;
    const at::Tensor logp = at::log_softmax(scaled, -1);
    const at::Tensor want_entropy = -(logp.exp() * logp).sum(-1);
    for (int64_t b = 0; b < 2; ++b) {
      CHECK(got[b][0].item<double>() == 0.0);
      for (int64_t i = 1; i < 6; ++i) {
        const int64_t y = labels[b][i].item<int64_t>();
        const double want = y == -100 ? 0.0 : logp[b][i - 1][y].item<double>();
        CHECK(got[b][i].item<double>() == Approx(want).margin(1e-5));
        CHECK(entropies[b][i].item<double>() ==
              Approx(want_entropy[b][i - 1].item<double>()).margin(1e-5));
      }
    }
  }
  CHECK_THROWS_AS(model->label_log_probs(ids, labels, {}, 3, {}, nullptr, 0.0), InvalidArgument);
}

TEST_CASE("a long generation attends over the positions it reached as a full forward does",
          "[generate]") {
  // Past 1,024 positions a decoding step attends over the buffer's reached part (recorded anew
  // for each reach): every greedy token is still an argmax of the full forward's logits over
  // the generated sequence (with the repetition penalty, which keeps the tiny models from
  // repeating one token, applied as transformers does), before and after each reach — with
  // sliding windows too (gpt-oss's with sinks, Gemma 2's with soft-capped attention).
  at::NoGradGuard no_grad;
  constexpr int64_t kNew = 1100;
  constexpr double kPenalty = 1.3;
  for (const char* name : {"llama", "gpt_oss", "gemma2"}) {
    INFO(name);
    ModelConfig c = load_model_config(fixture(std::string("models/") + name));
    c.max_position_embeddings = 4096;
    auto model = std::make_shared<CausalLM>(c, at::TensorOptions().dtype(at::kFloat), false);
    load_weights(*model, *checkpoint_source(fixture(std::string("models/") + name)));
    model->eval();
    GenerationOptions o;
    o.max_new_tokens = kNew;  // no stop token: every row runs to the end
    o.repetition_penalty = kPenalty;
    const std::vector<std::vector<int64_t>> prompts{{5, 9, 14, 3, 7}, {11, 4, 6}};
    const std::vector<Generated> got = model->generate_batch(prompts, o);
    REQUIRE(got.size() == prompts.size());
    for (size_t r = 0; r < got.size(); ++r) {
      INFO("row " << r);
      REQUIRE(got[r].tokens.size() == kNew);
      std::vector<int64_t> sequence = prompts[r];
      sequence.insert(sequence.end(), got[r].tokens.begin(), got[r].tokens.end());
      const at::Tensor logits =
          model->logits(at::tensor(sequence, at::kLong).view({1, -1}))[0].to(at::kDouble);
      at::Tensor seen = at::zeros({logits.size(1)}, at::kBool);
      for (int64_t t : prompts[r]) seen[t] = true;
      const auto p = static_cast<int64_t>(prompts[r].size());
      int64_t off_argmax = 0;
      for (int64_t j = 0; j < kNew; ++j) {
        const at::Tensor row = logits[p - 1 + j];
        const at::Tensor scored =
            at::where(seen, at::where(row > 0, row / kPenalty, row * kPenalty), row);
        const int64_t token = got[r].tokens[static_cast<size_t>(j)];
        off_argmax += scored.max().item<double>() - scored[token].item<double>() > 1e-4;
        seen[token] = true;
      }
      CHECK(off_argmax == 0);
      // The penalty keeps a row from settling on one token: the attention decides them.
      CHECK(std::set<int64_t>(got[r].tokens.begin(), got[r].tokens.end()).size() >= 5);
    }
  }
}

TEST_CASE("while decoding, a LoRA projection folds its scaling into its last product",
          "[generate][peft]") {
  // The decoding shortcut (model/decoding.hpp): the same projection as PEFT's expression, to
  // rounding, only inside a DecodingScope and without gradients.
  ModelConfig c = load_model_config(fixture("models/llama"));
  auto model = std::make_shared<CausalLM>(c, at::TensorOptions().dtype(at::kFloat), false);
  load_weights(*model, *checkpoint_source(fixture("models/llama")));
  PeftConfig pc;
  pc.type = FinetuningType::kLora;
  pc.lora.r = 4;
  pc.lora.alpha = 7;  // a scaling (1.75) that rounds
  apply_peft(*model, pc, 3);
  at::NoGradGuard no_grad;
  at::manual_seed(9);
  for (auto& item : model->named_parameters(true)) {
    if (item.key().find("lora_B") != std::string::npos)
      item.value().add_(at::randn_like(item.value()) * 0.3);
  }
  model->eval();
  int checked = 0;
  for (const auto& item : model->named_modules()) {
    auto* linear = dynamic_cast<model::Linear*>(item.value().get());
    if (linear == nullptr || item.key().find("q_proj") == std::string::npos ||
        item.key().find("lora") != std::string::npos)
      continue;
    INFO(item.key());
    const at::Tensor x = at::randn({3, 5, linear->in_features});
    const at::Tensor plain = linear->forward(x);
    at::Tensor decoded;
    {
      const model::DecodingScope decoding;
      decoded = linear->forward(x);
    }
    CHECK(at::allclose(decoded, plain, 1e-5, 1e-6));
    CHECK(!model::decoding());
    ++checked;
  }
  CHECK(checked == c.num_hidden_layers);
  // And generation with the adapter is unchanged: greedy tokens of a batch as of each alone.
  GenerationOptions o;
  o.max_new_tokens = 12;
  const std::vector<std::vector<int64_t>> prompts{{5, 9, 14}, {11, 4}};
  const std::vector<Generated> both = model->generate_batch(prompts, o);
  for (size_t i = 0; i < prompts.size(); ++i) {
    CHECK(model->generate_batch({prompts[i]}, o)[0].tokens == both[i].tokens);
  }
}
