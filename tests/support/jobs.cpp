#include "support/jobs.hpp"

#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "support/ranks.hpp"
#include "util/files.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/trainer.hpp"

namespace zt::test {

const char* const kTinyModel =
    R"({"model_type": "llama", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": false})";

std::vector<std::string> tiny_run_flags(const std::string& dir,
                                        const std::vector<std::string>& settings,
                                        const std::vector<std::string>& extra) {
  std::vector<std::string> f{"--model_config", kTinyModel,   "--train_file", dir + "/train.jsonl",
                             "--output_dir",   dir + "/out", "--template",   "alpaca"};
  f.insert(f.end(), settings.begin(), settings.end());
  f.insert(f.end(), extra.begin(), extra.end());
  return f;
}

ModelConfig write_model_folder(const std::string& folder, const std::string& config_json,
                               uint64_t seed) {
  const ModelConfig c = parse_model_config(config_json);
  CausalLM m(c, at::TensorOptions(), false);
  load_weights(m, *random_source(c, seed));
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& p : m.named_parameters()) tensors.emplace_back(p.key(), p.value());
  std::filesystem::create_directories(folder);
  save_sharded_safetensors(folder, tensors);
  files::write_atomic(folder + "/config.json", model_config_json(c));
  return c;
}

std::string write_data(const std::string& dir, const std::string& name, int count, int salt) {
  std::string text;
  for (int i = 0; i < count; ++i) {
    const int n = static_cast<int>((int64_t{i} * 7919 + int64_t{salt} * 104729) % 10007);
    text += fmt::format("{{\"instruction\": \"Is {} even or odd?\", \"output\": \"{}\"}}\n", n,
                        n % 2 ? "odd" : "even");
  }
  const std::string path = dir + "/" + name;
  files::write_atomic(path, text);
  return path;
}

std::string write_pairs(const std::string& dir, const std::string& name, int count, int salt) {
  std::string text;
  for (int i = 0; i < count; ++i) {
    const int n = static_cast<int>((int64_t{i} * 7919 + int64_t{salt} * 104729) % 10007);
    text += fmt::format(
        "{{\"instruction\": \"Is {} even or odd?\", \"chosen\": \"{}\", \"rejected\": \"{}\"}}\n",
        n, n % 2 ? "odd" : "even", n % 2 ? "even" : "odd");
  }
  const std::string path = dir + "/" + name;
  files::write_atomic(path, text);
  return path;
}

std::string join_flags(const std::vector<std::string>& flags) {
  std::string s;
  for (const std::string& f : flags) s += f + '\x1f';
  return s;
}

std::vector<std::string> split_flags(const std::string& joined) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : joined) {
    if (c == '\x1f') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  return out;
}

std::string stage_json(int stage, const std::string& extra) {
  return fmt::format(R"({{"zero_optimization": {{"stage": {}{}}}, "bf16": {{"enabled": "auto"}},
                         "fp16": {{"enabled": "auto", "initial_scale_power": 8}},
                         "train_micro_batch_size_per_gpu": "auto",
                         "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}})",
                     stage, extra);
}

std::vector<std::string> zero_stage_flags(const std::string& kind) {
  const std::string stage =
      kind == "0" || kind == "1" || kind == "2" || kind == "3" ? kind
      : kind == "3 offload"
          ? R"(3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"})"
          : "2";
  return {"--deepspeed",
          R"({"zero_optimization": {"stage3_param_persistence_threshold": 10,
              "stage3_gather_16bit_weights_on_model_save": true, "stage": )" +
              stage + "}}"};
}

std::map<int64_t, double> logged(const std::string& out_dir, const std::string& key) {
  const std::string quoted = "\"" + key + "\":";
  std::map<int64_t, double> values;
  std::ifstream in(out_dir + "/trainer_log.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.find(quoted);
    if (at == std::string::npos) continue;
    const int64_t step = std::stoll(line.substr(line.find("\"step\":") + 7));
    values[step] = std::stod(line.substr(at + quoted.size()));
  }
  return values;
}

std::vector<double> train_on_base(const std::string& dir,
                                  const std::vector<std::string>& settings) {
  std::vector<std::string> run{
      "--per_device_train_batch_size", "2", "--learning_rate", "1e-2", "--seed", "5"};
  run.insert(run.end(), settings.begin(), settings.end());
  std::vector<std::string> flags = tiny_run_flags(dir, run, {});
  flags[0] = "--model_name_or_path";
  flags[1] = dir + "/base";
  TrainingArguments args;
  apply_training_flags(args, flags);
  std::vector<double> losses;
  TrainerCallbacks callbacks;
  callbacks.on_step = [&](const StepStats& s) { losses.push_back(s.loss); };
  Trainer(args, std::shared_ptr<Communicator>(join()), callbacks).train();
  return losses;
}

}  // namespace zt::test
