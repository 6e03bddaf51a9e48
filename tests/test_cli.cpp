// The `zerotrain` program as users meet it: --help lists every option with its default, exit
// statuses (0 / 2 configuration / 1 other / 130 cancelled), one `error: ...` line per failing
// process, and `launch` passing on the first failing rank's status.
#include "support/catch.hpp"

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

#include "support/ranks.hpp"
#include "util/files.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/safetensors.hpp"

using Catch::Contains;
using Catch::Matches;

namespace {

struct Ran {
  int status = -1;
  std::string output;  ///< stdout and stderr together
};

// Runs the CLI through the shell with `args` (already quoted) and collects what it printed.
Ran cli(const std::string& args) {
  const std::string command = fmt::format("'{}' {} 2>&1", ZT_CLI, args);
  Ran r;
  FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::array<char, 4096> buf;
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int raw = ::pclose(pipe);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  return r;
}

int count_lines_starting(const std::string& text, const std::string& prefix) {
  int n = 0;
  size_t at = 0;
  while (at < text.size()) {
    if (text.compare(at, prefix.size(), prefix) == 0) ++n;
    at = text.find('\n', at);
    if (at == std::string::npos) break;
    ++at;
  }
  return n;
}

}  // namespace

TEST_CASE("train --help lists every option with its default", "[cli]") {
  Ran r = cli("train --help");
  CHECK(r.status == 0);
  for (const zt::OptionHelp& o : zt::training_option_help()) {
    INFO(o.name);
    CHECK_THAT(r.output, Contains("--" + o.name));
    if (!o.default_value.empty()) CHECK_THAT(r.output, Contains("[default: " + o.default_value + "]"));
  }
}

TEST_CASE("exit statuses and one error line", "[cli][errors]") {
  const std::string dir = zt::test::temp_dir("cli");
  SECTION("a configuration error exits 2") {
    Ran r = cli("train --lerning_rate 1e-4");
    CHECK(r.status == 2);
    CHECK_THAT(r.output, Contains("error: unknown option --lerning_rate") && Contains("learning_rate"));
    CHECK(count_lines_starting(r.output, "error: ") == 1);
  }
  SECTION("a missing file exits 1 and names it") {
    Ran r = cli(fmt::format("train --model_name_or_path '{}/no_such_model' --train_file x.jsonl --output_dir '{}/o'",
                            dir, dir));
    CHECK(r.status != 0);
    CHECK_THAT(r.output, Contains("no_such_model"));
    CHECK(count_lines_starting(r.output, "error: ") == 1);
  }
  SECTION("merge of something that is not a checkpoint exits 1") {
    Ran r = cli(fmt::format("merge '{}' '{}/out'", dir, dir));
    CHECK(r.status == 1);
    CHECK_THAT(r.output, Contains("error: ") && Contains("layout.json"));
  }
  SECTION("launch exits with the first failing rank's status") {
    if (zt::test::skip_cpu_world(2)) return;
    // Rank 0 fails first (rank 1 waits), so its status is the launcher's whatever the load.
    Ran r = cli("launch --nproc_per_node 2 -- sh -c '[ $RANK = 1 ] && sleep 2; exit $((RANK + 3))'");
    CHECK(r.status == 3);
    Ran later = cli("launch --nproc_per_node 2 -- sh -c '[ $RANK = 0 ] && sleep 2; exit $((RANK + 3))'");
    CHECK(later.status == 4);
    Ran bad = cli(fmt::format("launch --nproc_per_node 2 -- '{}' train --bogus 1", ZT_CLI));
    CHECK(bad.status == 2);
    CHECK(count_lines_starting(bad.output, "error: rank 0: ") == 1);
    CHECK(count_lines_starting(bad.output, "error: rank 1: ") == 1);
  }
}

TEST_CASE("verify loads a model folder and answers a prompt in the training template", "[cli]") {
  const std::string dir = zt::test::temp_dir("verify");
  const zt::ModelConfig c = zt::parse_model_config(
      R"({"model_type": "llama", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 128})");
  zt::CausalLM m(c, at::TensorOptions(), false);
  zt::load_weights(m, *zt::random_source(c, 1));
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& p : m.named_parameters()) tensors.emplace_back(p.key(), p.value());
  zt::save_sharded_safetensors(dir, tensors);
  zt::files::write_atomic(dir + "/config.json", zt::model_config_json(c));
  Ran r = cli(fmt::format("verify '{}' --prompt 'Is 7 odd?' --max_new_tokens 4", dir));
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Contains("### 指令：Is 7 odd?\n### 回答："));
  Ran raw = cli(fmt::format("verify '{}' --prompt 'plain text' --raw --max_new_tokens 2", dir));
  CHECK(raw.status == 0);
  CHECK_THAT(raw.output, Contains("plain text"));
  CHECK_FALSE(raw.output.find("###") != std::string::npos);
  Ran missing = cli(fmt::format("verify '{}'", dir));
  CHECK(missing.status == 2);
  CHECK_THAT(missing.output, Contains("--prompt"));
}
