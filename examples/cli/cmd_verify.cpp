// zerotrain verify MODEL_DIR --prompt "..." [--template T | --raw] [--max_new_tokens N]: load a
// model folder (or a LoRA / prompt adapter folder over its base) and generate — the seed's habit
// of checking every checkpoint by asking it something.
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "commands.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/tokenizer.hpp"

namespace zt::cli {

int cmd_verify(const Args& in) {
  Args args = in;
  std::optional<std::string> prompt = take_option(args, "prompt");
  std::string template_name = take_option(args, "template").value_or("alpaca_zh");
  const long max_new = std::strtol(take_option(args, "max_new_tokens").value_or("64").c_str(), nullptr, 10);
  bool raw = false;
  for (auto it = args.begin(); it != args.end();) {
    if (*it == "--raw") {
      raw = true;
      it = args.erase(it);
    } else {
      ++it;
    }
  }
  if (args.size() != 1 || !prompt || max_new < 1) {
    throw ConfigError("usage: zerotrain verify MODEL_DIR --prompt \"...\" [--template alpaca_zh|alpaca|chatml|plain "
                      "| --raw] [--max_new_tokens N]");
  }
  std::string dir = args[0];
  const bool adapter = std::filesystem::exists(dir + "/adapter_config.json");
  std::string base = dir;
  if (adapter) {
    base = load_adapter_config(dir).base_model_name_or_path;
    if (base.empty()) throw ConfigError("verify: the adapter in '" + dir + "' names no base model");
  }
  ModelConfig config = load_model_config(base);
  CausalLM model(config, at::TensorOptions().dtype(at::kFloat), /*allocate=*/false);
  load_weights(model, *checkpoint_source(base));
  if (adapter) load_adapter(model, dir, /*trainable=*/false);
  model.eval();
  std::shared_ptr<Tokenizer> tok = load_tokenizer(adapter ? base : dir, config.vocab_size);
  const std::string text = raw ? *prompt : render_prompt(template_name, *prompt);
  std::vector<int32_t> ids = tok->encode(text);
  if (tok->add_bos() && tok->bos_id() >= 0) ids.insert(ids.begin(), tok->bos_id());
  at::Tensor input = at::tensor(std::vector<int64_t>(ids.begin(), ids.end()), at::kLong).unsqueeze(0);
  GenerationOptions g;
  g.max_new_tokens = max_new;
  if (tok->eos_id() >= 0) g.eos_token_ids = {tok->eos_id()};
  at::NoGradGuard no_grad;
  at::Tensor out = model.generate(input, g)[0].contiguous();
  std::vector<int32_t> new_ids(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel());
  std::printf("%s%s\n", text.c_str(), tok->decode(new_ids).c_str());
  return 0;
}

}  // namespace zt::cli
