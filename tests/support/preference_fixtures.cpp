// See preference_fixtures.hpp.
#include "support/preference_fixtures.hpp"

#include <ATen/ATen.h>
#include <rapidjson/document.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "support/catch.hpp"
#include "train/preference.hpp"
#include "util/files.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt::test {

namespace fs = std::filesystem;

namespace {

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

// The family's model with the fixture's adapter, in eval mode on `device`.
std::shared_ptr<CausalLM> adapted_model(const std::string& family, const std::string& dir,
                                        const at::Device& device) {
  auto model = fixture_model(family);
  load_adapter(*model, dir + "/adapter", /*trainable=*/true);
  model->eval();
  model->to(device);
  return model;
}

// TRL's logits metrics of the fixture's batches under its adapter, from transformers + PEFT
// (logits.safetensors: chosen, rejected, kto_chosen, kto_rejected).
std::map<std::string, double> fixture_logits(const std::string& dir, const std::string& prefix) {
  REQUIRE(fs::exists(dir + "/logits.safetensors"));
  SafetensorsFile f(dir + "/logits.safetensors");
  return {{"logits/chosen", f.load(prefix + "chosen").item<double>()},
          {"logits/rejected", f.load(prefix + "rejected").item<double>()}};
}

// A case's loss, metrics (named `names`, in the fixture's order; `more`: others by name) and the
// gradients of the loss.
void check_case(CausalLM& model, const SafetensorsFile& expected, const std::string& name,
                const train::PreferenceOptions& o, const train::PreferenceLosses& out,
                const std::vector<const char*>& names, const std::map<std::string, double>& more,
                double slack) {
  const at::Tensor loss = out.loss.mean();
  CHECK(loss.item<double>() ==
        Approx(expected.load("loss." + name).item<double>()).epsilon(1e-5 * slack).margin(1e-7));
  const at::Tensor host_sums = out.sums.to(at::kDouble).cpu().contiguous();
  const std::map<std::string, double> metrics = train::preference_metrics(
      o,
      std::vector<double>(host_sums.data_ptr<double>(),
                          host_sums.data_ptr<double>() + host_sums.numel()),
      "");
  const at::Tensor want = expected.load("metrics." + name);
  for (size_t k = 0; k < names.size(); ++k) {
    INFO(names[k]);
    CHECK(metrics.at(names[k]) == Approx(want[static_cast<int64_t>(k)].item<double>())
                                      .epsilon(1e-5 * slack)
                                      .margin(1e-5 * slack));
  }
  for (const auto& [metric, value] : more) {
    INFO(metric);
    REQUIRE(metrics.count(metric) == 1);
    CHECK(metrics.at(metric) == Approx(value).epsilon(1e-5 * slack).margin(1e-5 * slack));
  }
  loss.backward();
  int grads = 0;
  for (const auto& p : model.named_parameters()) {
    if (!p.value().requires_grad()) continue;
    INFO(p.key());
    const at::Tensor g = expected.load("grad." + name + "." + p.key());
    REQUIRE(p.value().grad().defined());
    const double scale = std::max(g.abs().max().item<double>(), 1e-8);
    CHECK((p.value().grad().cpu() - g).abs().max().item<double>() / scale < 1e-4 * slack);
    ++grads;
  }
  CHECK(grads > 0);
}

}  // namespace

std::shared_ptr<CausalLM> fixture_model(const std::string& family) {
  auto m = std::make_shared<CausalLM>(load_model_config(fixture("models/" + family)),
                                      at::TensorOptions(), true);
  load_weights(*m, *checkpoint_source(fixture("models/" + family)));
  return m;
}

int check_pair_fixture(const std::string& family, const at::Device& device, double slack) {
  const std::string dir = fixture(std::string("preference/") + family);
  REQUIRE(fs::exists(dir + "/expected.safetensors"));
  SafetensorsFile expected(dir + "/expected.safetensors");
  auto model = adapted_model(family, dir, device);
  const at::Tensor ids = expected.load("input_ids").to(device);
  const at::Tensor labels = expected.load("labels").to(device);
  const at::Tensor mask = expected.load("attention_mask").to(device);
  at::Tensor ref;
  {
    at::NoGradGuard no_grad;
    model->set_adapters_enabled(false);
    ref = model->label_log_probs(ids, labels, mask).sum(1);
    model->set_adapters_enabled(true);
  }
  CHECK(at::allclose(ref.cpu(), expected.load("ref_logps"), 1e-5 * slack, 1e-4 * slack));
  const at::Tensor counts = expected.load("completion_tokens").to(at::kFloat).to(device);
  CHECK(at::equal(labels.narrow(1, 1, labels.size(1) - 1).ne(-100).sum(1).to(at::kFloat).cpu(),
                  counts.cpu()));
  rapidjson::Document cases;
  cases.Parse(files::read_text(dir + "/cases.json").c_str());
  REQUIRE(cases.IsObject());
  int checked = 0;
  for (const auto& c : cases["cases"].GetArray()) {
    const std::string name = c["name"].GetString();
    INFO(name);
    train::PreferenceOptions o;
    o.loss = c["pref_loss"].GetString();
    o.beta = c["beta"].GetDouble();
    o.label_smoothing = c["label_smoothing"].GetDouble();
    o.simpo_gamma = c["simpo_gamma"].GetDouble();
    o.ftx = c["pref_ftx"].GetDouble();
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    at::Tensor mean_logits;
    const at::Tensor logps =
        model->label_log_probs(ids, labels, mask, 1024, {}, &mean_logits).sum(1);
    CHECK(at::allclose(logps.detach().cpu(), expected.load("policy_logps"), 1e-5 * slack,
                       1e-4 * slack));
    const train::PairLogProbs lp =
        train::split_pairs(logps, counts, train::answer_logit_sums(mean_logits, labels), ref);
    const train::PreferenceLosses out = train::preference_losses(o, lp);
    check_case(*model, expected, name, o, out,
               {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected"},
               fixture_logits(dir, ""), slack);
    ++checked;
  }
  return checked;
}

int check_kto_fixture(const std::string& family, const at::Device& device, double slack) {
  const std::string dir = fixture(std::string("preference/") + family);
  REQUIRE(fs::exists(dir + "/kto.safetensors"));
  SafetensorsFile expected(dir + "/kto.safetensors");
  auto model = adapted_model(family, dir, device);
  const at::Tensor ids = expected.load("input_ids").to(device);
  const at::Tensor labels = expected.load("labels").to(device);
  const at::Tensor mask = expected.load("attention_mask").to(device);
  at::Tensor ref, kl_ref, kl_policy;
  {
    at::NoGradGuard no_grad;
    kl_policy = model
                    ->label_log_probs(expected.load("kl_input_ids").to(device),
                                      expected.load("kl_labels").to(device),
                                      expected.load("kl_attention_mask").to(device))
                    .sum(1);
    model->set_adapters_enabled(false);
    ref = model->label_log_probs(ids, labels, mask).sum(1);
    kl_ref = model
                 ->label_log_probs(expected.load("kl_input_ids").to(device),
                                   expected.load("kl_labels").to(device),
                                   expected.load("kl_attention_mask").to(device))
                 .sum(1);
    model->set_adapters_enabled(true);
  }
  CHECK(at::allclose(ref.cpu(), expected.load("ref_logps"), 1e-5 * slack, 1e-4 * slack));
  CHECK(at::allclose(kl_ref.cpu(), expected.load("kl_ref_logps"), 1e-5 * slack, 1e-4 * slack));
  CHECK(
      at::allclose(kl_policy.cpu(), expected.load("kl_policy_logps"), 1e-5 * slack, 1e-4 * slack));
  // TRL's z0: the batch's mean KL-row log-ratio, at least 0 (positive in this batch).
  const double kl = std::max(0.0, (kl_policy - kl_ref).mean().item<double>());
  CHECK(kl == Approx(expected.load("kl").item<double>()).epsilon(1e-4 * slack).margin(1e-6));
  REQUIRE(kl > 1e-3);
  const at::Tensor desirable = expected.load("desirable").to(at::kBool).to(device);
  const int64_t n = ids.size(0), n_desirable = desirable.sum().item<int64_t>();
  const at::Tensor tokens = labels.narrow(1, 1, labels.size(1) - 1).ne(-100).sum(1).to(at::kFloat);
  rapidjson::Document cases;
  cases.Parse(files::read_text(dir + "/cases.json").c_str());
  REQUIRE(cases.IsObject());
  int checked = 0;
  for (const auto& c : cases["kto_cases"].GetArray()) {
    const std::string name = c["name"].GetString();
    INFO(name);
    train::PreferenceOptions o;
    o.loss = c["pref_loss"].GetString();
    o.beta = c["beta"].GetDouble();
    o.desirable_weight = c["desirable_weight"].GetDouble();
    o.undesirable_weight = c["undesirable_weight"].GetDouble();
    o.ftx = c["pref_ftx"].GetDouble();
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    train::UnpairedLogProbs lp;
    at::Tensor mean_logits;
    lp.policy = model->label_log_probs(ids, labels, mask, 1024, {}, &mean_logits).sum(1);
    lp.logits = train::answer_logit_sums(mean_logits, labels);
    CHECK(at::allclose(lp.policy.detach().cpu(), expected.load("policy_logps"), 1e-5 * slack,
                       1e-4 * slack));
    lp.reference = ref;
    lp.desirable = desirable;
    lp.tokens = tokens;
    lp.kl = kl;
    lp.nll_scale = train::unpaired_nll_scale(n, n_desirable);
    const train::PreferenceLosses out = train::unpaired_losses(o, lp);
    check_case(
        *model, expected, name, o, out,
        {"rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected", "rewards/margins"},
        fixture_logits(dir, "kto_"), slack);
    ++checked;
  }
  return checked;
}

}  // namespace zt::test
