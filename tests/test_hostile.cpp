// Files and inputs other people made, read as an adversary would make them: nesting deep enough
// to overflow a recursive reader, special files (FIFOs, devices, folders), names that leave their
// folder, damaged checkpoints, huge numbers and huge lines — each a clear error naming the file,
// key or entry, never a crash, a hang, a write outside the run or a silent default.
#include "support/catch.hpp"

#include <c10/util/Exception.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include <fmt/format.h>
#include <rapidjson/document.h>

#include "capi/status.hpp"
#include "support/jobs.hpp"
#include "support/messages.hpp"
#include "support/ranks.hpp"
#include "tokenizer/hf_tokenizer.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/tokenizer.hpp"
#include "zerotrain/trainer.hpp"

using namespace zt;
using Catch::Contains;
using test::Has;
using test::LogCapture;
namespace fs = std::filesystem;

namespace {

std::string nested(size_t depth, const std::string& inner = "1") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

void write_file(const std::string& path, const std::string& content) {
  std::ofstream(path, std::ios::binary) << content;
}

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

// A copy of the tiny llama fixture folder (config.json + model.safetensors) to tamper with.
std::string model_copy(const std::string& tag) {
  const std::string dir = test::temp_dir(tag);
  fs::copy_file(fixture("models/llama/config.json"), dir + "/config.json");
  fs::copy_file(fixture("models/llama/model.safetensors"), dir + "/model.safetensors");
  return dir;
}

// An environment variable set for a scope (the variable unset after).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() { ::unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

// This process's address space capped at what it maps now plus `headroom` for a scope: an
// allocation beyond fails at once in the allocator (as on a host without that much memory)
// instead of being granted and touched, which would push a CI machine into swap or the OOM
// killer when a refusal regresses.
class AddressSpaceCap {
 public:
  explicit AddressSpaceCap(double headroom) {
    std::ifstream status("/proc/self/status");
    std::string key;
    double vm_kib = 0;
    while (status >> key) {
      if (key == "VmSize:") {
        status >> vm_kib;
        break;
      }
      status.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
    }
    REQUIRE(vm_kib > 0);
    REQUIRE(::getrlimit(RLIMIT_AS, &saved_) == 0);
    rlimit cap = saved_;
    cap.rlim_cur = static_cast<rlim_t>(vm_kib * 1024 + headroom);
    if (saved_.rlim_max != RLIM_INFINITY) cap.rlim_cur = std::min(cap.rlim_cur, saved_.rlim_max);
    REQUIRE(::setrlimit(RLIMIT_AS, &cap) == 0);
  }
  ~AddressSpaceCap() { ::setrlimit(RLIMIT_AS, &saved_); }
  AddressSpaceCap(const AddressSpaceCap&) = delete;
  AddressSpaceCap& operator=(const AddressSpaceCap&) = delete;

 private:
  rlimit saved_{};
};

std::vector<std::string> run_flags(const std::string& dir, const std::vector<std::string>& extra) {
  return test::tiny_run_flags(dir,
                              {"--per_device_train_batch_size", "2", "--max_steps", "4",
                               "--save_steps", "2", "--logging_steps", "1"},
                              extra);
}

}  // namespace

TEST_CASE("JSON nested beyond any real file is an error wherever JSON is read", "[hostile][json]") {
  const std::string deep = nested(200000);
  CHECK_THROWS_MATCHES(json::parse(deep, "x.json"), ConfigError,
                       Has({"x.json", "nested deeper than 256", "line 1"}));
  CHECK_NOTHROW(json::parse(nested(200), "ok.json"));
  CHECK_NOTHROW(
      json::parse(R"(["[[[[[", "\"]]]]"])", "strings.json"));  // brackets in strings do not count
  CHECK_NOTHROW(json::parse("[\"" + std::string(1000, '[') + "\"]", "strings.json"));
  CHECK_THROWS_AS(parse_model_config(R"({"model_type": "llama", "x": )" + deep + "}"), ConfigError);
  CHECK_THROWS_AS(parse_deepspeed_config(R"({"zero_optimization": )" + deep + "}"), ConfigError);
  TrainingArguments a;
  CHECK_THROWS_AS(apply_training_json(a, R"({"learning_rate": )" + deep + "}"), ConfigError);
  // A data record: an error naming the line, or skipped with skip_bad_lines.
  const std::string dir = test::temp_dir("deep");
  write_file(dir + "/d.jsonl", "{\"text\": \"fine\"}\n{\"text\": " + deep + "}\n");
  CHECK_THROWS_MATCHES(tokenize_jsonl(dir + "/d.jsonl", *byte_tokenizer(), DataOptions()),
                       ConfigError, Has({dir + "/d.jsonl:2", "nested deeper"}));
  DataOptions skip;
  skip.skip_bad_lines = true;
  skip.template_name = "plain";
  CHECK(tokenize_jsonl(dir + "/d.jsonl", *byte_tokenizer(), skip).size() == 1);
  // A safetensors header.
  const std::string header = R"({"a": )" + deep + "}";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  write_file(dir + "/deep.safetensors", file + header);
  CHECK_THROWS_MATCHES(SafetensorsFile(dir + "/deep.safetensors"), IoError,
                       Has({"deep.safetensors", "nested"}));
  // tokenizer.json with a normalizer Sequence 10^4 deep (its reader recurses into sequences).
  std::string seq = R"({"type": "NFC"})";
  for (int i = 0; i < 10000; ++i) seq = R"({"type": "Sequence", "normalizers": [)" + seq + "]}";
  write_file(
      dir + "/tokenizer.json",
      R"({"normalizer": )" + seq + R"(, "model": {"type": "BPE", "vocab": {}, "merges": []}})");
  CHECK_THROWS_MATCHES(HfTokenizer::load(dir), ConfigError,
                       Has({"tokenizer.json", "nested deeper"}));
}

TEST_CASE("special files are refused at once, never read or waited on", "[hostile][files]") {
  const std::string dir = test::temp_dir("special");
  REQUIRE(::mkfifo((dir + "/fifo").c_str(), 0600) == 0);
  // A FIFO nobody writes: opening it for reading would wait forever.
  CHECK_THROWS_MATCHES(files::read_text(dir + "/fifo", "model config"), IoError,
                       Has({"fifo", "a FIFO"}));
  CHECK_THROWS_MATCHES(SafetensorsFile(dir + "/fifo"), IoError, Has({"a FIFO"}));
  CHECK_THROWS_MATCHES(tokenize_jsonl(dir + "/fifo", *byte_tokenizer(), DataOptions()), IoError,
                       Has({"a FIFO"}));
  // /dev/zero behind a config.json link: a device, not an endless config.
  const std::string model = test::temp_dir("zero_model");
  fs::create_symlink("/dev/zero", model + "/config.json");
  CHECK_THROWS_MATCHES(load_model_config(model), IoError, Has({"config.json", "character device"}));
  fs::create_directories(dir + "/folder.json");
  CHECK_THROWS_MATCHES(files::read_text(dir + "/folder.json"), IoError, Has({"a folder"}));
  // Size limits per kind.
  write_file(dir + "/big.json", std::string(2000, ' '));
  CHECK_THROWS_MATCHES(files::read_text(dir + "/big.json", "model config", 1000), IoError,
                       Has({"2000 bytes", "1000"}));
  // A checkpoint file that is a FIFO.
  const std::string ckpt = test::temp_dir("fifo_ckpt");
  REQUIRE(::mkfifo((ckpt + "/latest").c_str(), 0600) == 0);
  LogCapture log;
  CHECK_FALSE(latest_checkpoint(ckpt).has_value());
  CHECK(log.contains("FIFO"));
}

namespace {

// Every tensor of a model folder's model.safetensors, as fp32 (names in file order).
std::vector<std::pair<std::string, at::Tensor>> weights_of(const std::string& dir) {
  SafetensorsFile f(dir + "/model.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const std::string& name : f.names()) {
    at::Tensor t = at::empty(f.info(name).shape, at::TensorOptions().dtype(at::kFloat));
    f.read_range(name, 0, t.view({-1}));
    out.emplace_back(name, t);
  }
  return out;
}

std::string check_error(const std::string& dir) {
  CausalLM model(load_model_config(dir), at::TensorOptions(), /*allocate=*/false);
  try {
    check_checkpoint(model, dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("what a weights file claims is checked against the model's config", "[hostile][model]") {
  // Integers or booleans where a weight belongs: refused on every path that reads weights.
  for (at::ScalarType bad : {at::kInt, at::kBool}) {
    const std::string dir = model_copy("int_weights");
    auto tensors = weights_of(dir);
    for (auto& [name, t] : tensors) {
      if (name == "model.layers.0.mlp.up_proj.weight") t = t.gt(0).to(bad);
    }
    save_safetensors(dir + "/model.safetensors", tensors);
    CHECK_THAT(check_error(dir), Contains("model.layers.0.mlp.up_proj.weight") &&
                                     Contains(bad == at::kInt ? "I32" : "BOOL") &&
                                     Contains("floating point"));
    CausalLM model(load_model_config(dir), at::TensorOptions(), /*allocate=*/false);
    CHECK_THROWS_MATCHES(load_weights(model, *checkpoint_source(dir)), IoError,
                         Has({"up_proj", "floating point"}));
  }
  // More layers in the file than num_hidden_layers: the config does not describe the file.
  {
    const std::string dir = model_copy("layers");
    std::string config = files::read_text(dir + "/config.json");
    config.replace(config.find("\"num_hidden_layers\": 2"), 22, "\"num_hidden_layers\": 1");
    files::write_atomic(dir + "/config.json", config);
    CHECK_THAT(check_error(dir), Contains("holds layers 0 to 1") &&
                                     Contains("num_hidden_layers 1") &&
                                     Contains("set num_hidden_layers 2"));
  }
  // Tensors with no place in the model: listed once, by name, and the run goes on.
  {
    const std::string dir = model_copy("extra");
    auto tensors = weights_of(dir);
    tensors.emplace_back("vision_tower.proj.weight", at::ones({4, 4}));
    tensors.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", at::ones({8}));
    save_safetensors(dir + "/model.safetensors", tensors);
    LogCapture log;
    CHECK(check_error(dir).empty());
    CHECK(
        log.contains("1 tensor(s) have no place in this model and are not used: "
                     "vision_tower.proj.weight"));
  }
  // tie_word_embeddings with a head of its own in the file: said, with which one is used.
  {
    const std::string dir = model_copy("tied");
    std::string config = files::read_text(dir + "/config.json");
    config.replace(config.find("\"tie_word_embeddings\": false"), 28,
                   "\"tie_word_embeddings\": true");
    files::write_atomic(dir + "/config.json", config);
    LogCapture log;
    CHECK(check_error(dir).empty());
    CHECK(
        log.contains("has its own 'lm_head.weight', but config.json says tie_word_embeddings "
                     "true: the output layer is 'model.embed_tokens.weight'"));
    // An exact copy of the embedding as the head changes nothing and is not reported.
    auto tensors = weights_of(dir);
    at::Tensor embedding;
    for (auto& [name, t] : tensors)
      if (name == "model.embed_tokens.weight") embedding = t;
    for (auto& [name, t] : tensors)
      if (name == "lm_head.weight") t = embedding.clone();
    save_safetensors(dir + "/model.safetensors", tensors);
    LogCapture quiet;
    CHECK(check_error(dir).empty());
    CHECK_FALSE(quiet.contains("lm_head.weight"));
  }
  // Shapes are exact wherever a model folder is read, merge's base included: an embedding of
  // fewer (or more) rows is never read in part.
  {
    const std::string dir = model_copy("rows");
    auto source = checkpoint_source(dir);
    at::Tensor out = at::empty({100, 64});
    CHECK_THROWS_MATCHES(source->read("model.embed_tokens.weight", {100, 64}, 0, out), IoError,
                         Has({"model.embed_tokens.weight", "[128, 64]", "[100, 64]"}));
  }
}

TEST_CASE("names read from files stay inside their folder", "[hostile][paths]") {
  // Shard names in model.safetensors.index.json.
  for (const char* shard :
       {"../model.safetensors", "/etc/passwd", "sub/model.safetensors", "..", ""}) {
    INFO(shard);
    const std::string dir = model_copy("index");
    write_file(dir + "/model.safetensors.index.json",
               fmt::format(R"({{"weight_map": {{"model.embed_tokens.weight": "{}"}}}})", shard));
    CHECK_THROWS_MATCHES(SafetensorsCheckpoint(dir), IoError,
                         Has({"model.safetensors.index.json", "model.embed_tokens.weight",
                              "not a plain file name"}));
  }
  // `latest` naming "..", "." or a link out of output_dir is ignored (the highest step is used).
  const std::string out = test::temp_dir("latest");
  fs::create_directories(out + "/checkpoint-3");
  const std::string elsewhere = test::temp_dir("elsewhere");
  fs::create_directories(elsewhere + "/checkpoint-9");
  fs::create_directory_symlink(elsewhere + "/checkpoint-9", out + "/checkpoint-9");
  for (const char* name : {"..", ".", "checkpoint-9", "../elsewhere", "/tmp"}) {
    INFO(name);
    write_file(out + "/latest", std::string(name) + "\n");
    LogCapture log;
    CHECK(latest_checkpoint(out) == std::optional<std::string>(out + "/checkpoint-3"));
  }
  CHECK(list_checkpoints(out).size() == 1);  // the link is no checkpoint
  CHECK_FALSE(checkpoint_in(out, "checkpoint-9").has_value());
  CHECK(checkpoint_in(out, "checkpoint-3").has_value());
  // A folder whose step does not fit 64 bits is skipped with a warning, not "stoll".
  fs::create_directories(out + "/checkpoint-99999999999999999999");
  LogCapture log;
  CHECK(list_checkpoints(out).size() == 1);
  CHECK(log.contains("64-bit"));
  CHECK_THROWS_AS(files::child(out, "../x", "test"), IoError);
  CHECK_THROWS_AS(files::descendant(out, "optimizer/../../x", "test"), IoError);
  CHECK(files::descendant(out, "optimizer/rank-0.safetensors", "test") ==
        out + "/optimizer/rank-0.safetensors");
}

TEST_CASE("companion files are copied only when they are what their names say, never through links",
          "[hostile][paths]") {
  const std::string from = test::temp_dir("companions"), to = test::temp_dir("outputs");
  write_file(from + "/tokenizer_config.json", R"({"bos_token": "<s>"})");
  fs::create_symlink("/etc/hostname", from + "/generation_config.json");  // not JSON
  REQUIRE(::mkfifo((from + "/special_tokens_map.json").c_str(), 0600) == 0);
  const std::string target = test::temp_dir("target") + "/victim";
  write_file(target, "untouched");
  fs::create_symlink(target, to + "/tokenizer_config.json");  // a link already in the output
  LogCapture log;
  CHECK(copy_model_companion_files(from, to) == 1);
  CHECK(files::read_text(target) == "untouched");
  CHECK(fs::is_regular_file(fs::symlink_status(to + "/tokenizer_config.json")));
  CHECK_FALSE(fs::exists(to + "/generation_config.json"));
  CHECK_FALSE(fs::exists(to + "/special_tokens_map.json"));
  CHECK(log.contains("generation_config.json"));
}

TEST_CASE("a damaged checkpoint is refused at resume and merge, naming the file and tensor",
          "[hostile][checkpoint]") {
  const std::string dir = test::temp_dir("damaged");
  test::write_data(dir, "train.jsonl", 16, 21);
  auto comm = std::shared_ptr<Communicator>(test::join());
  {
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, {}));
    Trainer(args, comm).train();
  }
  const std::string shard = dir + "/out/checkpoint-2/optimizer/rank-00000-of-00001.safetensors";
  SafetensorsFile before(shard);
  const TensorInfo& info = before.info("master/model.layers.0.mlp.down_proj.weight");
  const int64_t at = info.begin + info.nbytes / 2;
  {  // one flipped bit in the middle of a master tensor
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(at);
    f.write(&c, 1);
  }
  CHECK_THROWS_MATCHES(merge_checkpoint(dir + "/out/checkpoint-2", dir + "/merged"), IoError,
                       Has({"rank-00000-of-00001.safetensors",
                            "master/model.layers.0.mlp.down_proj.weight", "fails its checksum"}));
  TrainingArguments resume;
  apply_training_flags(resume,
                       run_flags(dir, {"--resume_from_checkpoint", dir + "/out/checkpoint-2",
                                       "--overwrite_output_dir"}));
  CHECK_THROWS_MATCHES(Trainer(resume, comm), IoError, Has({"fails its checksum"}));
  // An empty list of state kinds in layout.json (a crash before: front() of nothing).
  std::string layout = files::read_text(dir + "/out/checkpoint-4/layout.json");
  const size_t k = layout.find("\"kinds\"");
  layout.replace(k, layout.find(']', k) + 1 - k, "\"kinds\": []");
  files::write_atomic(dir + "/out/checkpoint-4/layout.json", layout);
  CHECK_THROWS_MATCHES(read_engine_state(dir + "/out/checkpoint-4"), ConfigError,
                       Has({"layout.json", "kinds"}));
  // Shard files named outside the checkpoint.
  layout = files::read_text(dir + "/out/checkpoint-4/layout.json");
  layout.replace(layout.find("\"kinds\": []"), 11, "\"kinds\": [\"master\"]");
  const size_t f = layout.find("optimizer/rank-");
  layout.replace(f, std::string("optimizer/rank-00000-of-00001.safetensors").size(),
                 "../../../etc/passwd");
  files::write_atomic(dir + "/out/checkpoint-4/layout.json", layout);
  CHECK_THROWS_MATCHES(read_engine_state(dir + "/out/checkpoint-4"), IoError,
                       Has({"layout.json", "files[0]"}));
}

TEST_CASE("a checkpoint mixing pieces of different saves is refused, naming them",
          "[hostile][checkpoint]") {
  const std::string dir = test::temp_dir("mixed");
  test::write_data(dir, "train.jsonl", 16, 21);
  auto comm = std::shared_ptr<Communicator>(test::join());
  {
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, {}));
    Trainer(args, comm).train();
  }
  const std::string two = dir + "/out/checkpoint-2", four = dir + "/out/checkpoint-4";
  const std::string shard = "/optimizer/rank-00000-of-00001.safetensors";
  auto resume_error = [&](const std::string& checkpoint) -> std::string {
    TrainingArguments resume;
    apply_training_flags(resume,
                         run_flags(dir, {"--resume_from_checkpoint", checkpoint, "--output_dir",
                                         test::temp_dir("mixed_resume"), "--max_steps", "5"}));
    try {
      Trainer(resume, comm).train();
    } catch (const Error& e) {
      return e.what();
    }
    return "(resumed)";
  };
  auto merge_error = [&](const std::string& checkpoint) -> std::string {
    try {
      merge_checkpoint(checkpoint, test::temp_dir("mixed_merge") + "/m");
    } catch (const Error& e) {
      return e.what();
    }
    return "(merged)";
  };
  // Each copy of checkpoint-4 gets one piece of checkpoint-2.
  auto mixed = [&](const std::string& name, const std::string& piece) {
    const std::string copy = dir + "/out/" + name;
    fs::copy(four, copy, fs::copy_options::recursive);
    fs::copy_file(two + piece, copy + piece, fs::copy_options::overwrite_existing);
    return copy;
  };
  // Step-2 masters and moments under step-4 counters.
  const std::string shards = mixed("checkpoint-40", shard);
  CHECK_THAT(resume_error(shards), Contains(shards + shard) && Contains("different saves"));
  CHECK_THAT(merge_error(shards), Contains(shards + shard) && Contains("different saves"));
  // Step-2 position beside step-4 optimizer state.
  const std::string position = mixed("checkpoint-41", "/zerotrain_state.json");
  CHECK_THAT(resume_error(position),
             Contains("zerotrain_state.json") && Contains("different saves"));
  // Two files claiming the same elements (one save's shard under two rank names).
  const std::string twice = dir + "/out/checkpoint-42";
  fs::copy(four, twice, fs::copy_options::recursive);
  std::string layout = files::read_text(twice + "/layout.json");
  const size_t w = layout.find("\"world_size\": 1");
  REQUIRE(w != std::string::npos);
  layout.replace(w, std::string("\"world_size\": 1").size(), "\"world_size\": 2");
  const std::string one_file = "\"optimizer/rank-00000-of-00001.safetensors\"";
  layout.replace(layout.find(one_file), one_file.size(),
                 "\"optimizer/rank-00000-of-00002.safetensors\", "
                 "\"optimizer/rank-00001-of-00002.safetensors\"");
  files::write_atomic(twice + "/layout.json", layout);
  for (const char* name : {"rank-00000-of-00002", "rank-00001-of-00002"})
    fs::copy_file(four + shard, twice + "/optimizer/" + name + ".safetensors");
  // Both files carry this save's id: the pieces are said to overlap, not to be another save's.
  const std::string overlapping = merge_error(twice);
  CHECK_THAT(overlapping, Contains("rank-00000-of-00002") && Contains("rank-00001-of-00002") &&
                              Contains("overlapping pieces of 'lm_head.weight'"));
  CHECK_THAT(overlapping, !Contains("different saves"));
  CHECK_THAT(resume_error(twice), Contains("overlapping") && !Contains("different saves"));
  // Counters beyond any run (2^60 steps) are refused, never wrapped into a negative step.
  const std::string far = dir + "/out/checkpoint-43";
  fs::copy(four, far, fs::copy_options::recursive);
  layout = files::read_text(far + "/layout.json");
  const size_t g = layout.find("\"global_steps\": 4");
  REQUIRE(g != std::string::npos);
  layout.replace(g, std::string("\"global_steps\": 4").size(),
                 "\"global_steps\": 1152921504606846976");
  files::write_atomic(far + "/layout.json", layout);
  CHECK_THAT(resume_error(far), Contains("layout.json") && Contains("global_steps"));
  // A random state of another size than the generator's (3 bytes): named, never LibTorch's text.
  const std::string rng = dir + "/out/checkpoint-44";
  fs::copy(four, rng, fs::copy_options::recursive);
  save_safetensors(rng + "/rng/rank-00000.safetensors",
                   {{"cpu", at::tensor({1, 2, 3}, at::kByte)}});
  CHECK_THAT(resume_error(rng), Contains("random state") && Contains("rng folder"));
  // The intact checkpoint still resumes.
  CHECK(resume_error(four) == "(resumed)");
}

TEST_CASE("a run that fails before it starts leaves nothing; a cancelled one says how to go on",
          "[hostile][output]") {
  const std::string dir = test::temp_dir("failed_start");
  test::write_data(dir, "train.jsonl", 16, 7);
  auto comm = std::shared_ptr<Communicator>(test::join());
  // A configuration error found after output_dir was made and locked: the folder goes again.
  TrainingArguments bad;
  apply_training_flags(bad, run_flags(dir, {"--output_dir", dir + "/fresh", "--lora_target_modules",
                                            "no_such_proj", "--finetuning_type", "lora"}));
  CHECK_THROWS_AS(Trainer(bad, comm), ConfigError);
  CHECK_FALSE(fs::exists(dir + "/fresh"));
  // In a folder that was there before, only the lock file goes; what was there stays.
  fs::create_directories(dir + "/kept");
  write_file(dir + "/kept/notes.txt", "mine");
  apply_training_flags(bad, {"--output_dir", dir + "/kept"});
  CHECK_THROWS_AS(Trainer(bad, comm), ConfigError);
  CHECK(fs::exists(dir + "/kept/notes.txt"));
  CHECK_FALSE(fs::exists(dir + "/kept/.zerotrain.lock"));

  // Cancelled before any save: nothing to resume, and it says so.
  TrainingArguments args;
  apply_training_flags(args, run_flags(dir, {"--output_dir", dir + "/cancel"}));
  {
    Trainer early(args, comm);
    early.cancel();
    CHECK_THROWS_MATCHES(early.train(), CancelledError,
                         Has({"before the first step: no checkpoint was saved"}));
  }
  // Cancelled after checkpoint-2: named, with the flag that continues from it.
  TrainerCallbacks cb;
  Trainer* running = nullptr;
  cb.on_step = [&](const StepStats& s) {
    if (s.global_step == 3) running->cancel();
  };
  apply_training_flags(args, {"--overwrite_output_dir"});
  Trainer later(args, comm, cb);
  running = &later;
  CHECK_THROWS_MATCHES(later.train(), CancelledError,
                       Has({"checkpoint-2", "--resume_from_checkpoint True"}));
}

TEST_CASE("output_dir is checked before any work and held by one run at a time",
          "[hostile][trainer]") {
  const std::string dir = test::temp_dir("outdir");
  test::write_data(dir, "train.jsonl", 16, 22);
  auto comm = std::shared_ptr<Communicator>(test::join());
  auto with = [&](std::vector<std::string> extra) {
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, extra));
    return args;
  };
  CHECK_THROWS_MATCHES(Trainer(with({"--output_dir", ""}), comm), ConfigError,
                       Has({"output_dir is empty"}));
  CHECK_THROWS_MATCHES(Trainer(with({"--output_dir", "/"}), comm), ConfigError,
                       Has({"root of the file system"}));
  write_file(dir + "/a_file", "x");
  CHECK_THROWS_MATCHES(Trainer(with({"--output_dir", dir + "/a_file"}), comm), ConfigError,
                       Has({"not a folder"}));
  // Two runs into one folder: the second is refused at once, overwrite or not.
  Trainer first(with({}), comm);
  CHECK_THROWS_MATCHES(Trainer(with({}), comm), ConfigError,
                       Has({"in use by another run", fmt::format("pid {}", ::getpid())}));
  CHECK_THROWS_MATCHES(Trainer(with({"--overwrite_output_dir"}), comm), ConfigError,
                       Has({"in use by another run"}));
  first.train();
  // A holder killed with -9 frees the folder.
  const std::string other = test::temp_dir("killed_holder");
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto lock = files::FileLock::try_lock(other + "/.zerotrain.lock", true, "the child");
    ::sleep(60);
    ::_exit(0);
  }
  for (int i = 0; i < 200 && files::FileLock::holder_of(other + "/.zerotrain.lock").empty(); ++i)
    ::usleep(10000);
  CHECK_FALSE(files::FileLock::try_lock(other + "/.zerotrain.lock", true).has_value());
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  CHECK(files::FileLock::try_lock(other + "/.zerotrain.lock", true).has_value());
}

TEST_CASE("a checkpoint being read is kept by rotation; a save without room is refused early",
          "[hostile][checkpoint]") {
  const std::string dir = test::temp_dir("rotation");
  test::write_data(dir, "train.jsonl", 16, 23);
  auto comm = std::shared_ptr<Communicator>(test::join());
  {
    TrainingArguments args;
    apply_training_flags(args, run_flags(dir, {"--max_steps", "2"}));
    Trainer(args, comm).train();
  }
  {
    const ReadLock reading(dir + "/out/checkpoint-2");  // as merge and verify hold it
    TrainingArguments more;
    apply_training_flags(more, run_flags(dir, {"--resume_from_checkpoint", "True",
                                               "--save_total_limit", "1", "--max_steps", "6"}));
    Trainer(more, comm).train();
    CHECK(fs::exists(dir + "/out/checkpoint-2"));  // kept while read
  }
  // Not enough room: refused before writing, the earlier checkpoints intact.
  const std::string full = test::temp_dir("full_disk");
  test::write_data(full, "train.jsonl", 16, 24);
  ::setenv("ZT_TEST_FREE_BYTES", "1000", 1);
  TrainingArguments args;
  apply_training_flags(args, run_flags(full, {}));
  CHECK_THROWS_MATCHES(Trainer(args, comm).train(), IoError,
                       Has({"not enough free disk", "checkpoint-2", "GiB needed"}));
  ::unsetenv("ZT_TEST_FREE_BYTES");
  CHECK(list_checkpoints(full + "/out").empty());
  for (const auto& e : fs::directory_iterator(full + "/out")) {
    CHECK(e.path().filename().string().rfind(".tmp-", 0) != 0);  // nothing half-written
  }
}

TEST_CASE("numbers from files and flags are range-checked before anything is allocated",
          "[hostile][config]") {
  CHECK_THROWS_MATCHES(
      parse_model_config(R"({"model_type": "llama", "vocab_size": 1e15, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})"),
      ConfigError, Has({"vocab_size", "2147483648"}));
  CHECK_THROWS_MATCHES(
      parse_model_config(R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "eos_token_id": 100})"),
      ConfigError, Has({"eos_token_id", "outside the vocabulary"}));
  // RoPE rotates pairs: an odd head_dim (given, or hidden_size / heads) is named.
  for (const char* heads :
       {R"("num_attention_heads": 4, "head_dim": 7)", R"("num_attention_heads": 4)"}) {
    const std::string hidden =
        std::string(heads).find("head_dim") != std::string::npos ? "64" : "28";
    CHECK_THROWS_MATCHES(
        parse_model_config(R"({"model_type": "llama", "vocab_size": 100, "hidden_size": )" +
                           hidden + R"(, "intermediate_size": 128, "num_hidden_layers": 2, )" +
                           heads + "}"),
        ConfigError, Has({"rotary dimensions", "even"}));
  }
  // An adapter config's lists hold names: [null] is an error naming the key.
  const std::string adapter = test::temp_dir("adapter_null");
  write_file(adapter + "/adapter_config.json",
             R"({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16,
                 "target_modules": ["q_proj"], "modules_to_save": [null]})");
  CHECK_THROWS_MATCHES(load_adapter_config(adapter), ConfigError, Has({"modules_to_save"}));
  // Sizes within range but beyond the machine: refused with the sizes named.
  const std::string dir = test::temp_dir("huge");
  test::write_data(dir, "train.jsonl", 4, 25);
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args, {"--model_config", R"({"model_type": "llama", "vocab_size": 2000000000,
      "hidden_size": 1048576, "intermediate_size": 4194304, "num_hidden_layers": 4096, "num_attention_heads": 16384,
      "head_dim": 64})",
                              "--train_file", dir + "/train.jsonl", "--output_dir", dir + "/out",
                              "--max_steps", "1"});
  CHECK_THROWS_MATCHES(Trainer(args, comm), ConfigError,
                       Has({"parameters", "per rank", "GiB", "hidden_size 1048576"}));
  // A micro-batch whose hidden states alone are beyond the machine, on a tiny model.
  TrainingArguments wide;
  apply_training_flags(
      wide, test::tiny_run_flags(
                dir, {"--per_device_train_batch_size", "65536", "--max_length", "1048576"},
                {"--max_steps", "1"}));
  CHECK_THROWS_MATCHES(Trainer(wide, comm), ConfigError,
                       Has({"per_device_train_batch_size 65536", "max_length 1048576", "GiB",
                            "more than this machine"}));
}

TEST_CASE("long records are truncated while tokenizing, to exactly the ids of the whole",
          "[hostile][data]") {
  // encode_prefix equals encode-then-truncate for the fixture tokenizers' pipelines.
  std::mt19937 rng(7);
  const char* pieces[] = {"hello",   " world", "\n", "  ", "数据", "ℌ𝔢𝔩𝔩𝔬",
                          "1234567", "!?",     "\t", "é",  "don't"};
  std::string text;
  while (text.size() < 400000) text += pieces[rng() % (sizeof(pieces) / sizeof(pieces[0]))];
  for (const char* name : {"qwen2", "llama3", "llama2", "mistral"}) {
    INFO(name);
    auto tok = HfTokenizer::load(fixture(std::string("tokenizers/") + name));
    const std::vector<int32_t> whole = tok->encode(text);
    for (size_t m : {size_t{1}, size_t{100}, size_t{1000}, size_t{5000}}) {
      INFO("first " << m);
      std::vector<int32_t> want(whole.begin(),
                                whole.begin() + static_cast<int64_t>(std::min(m, whole.size())));
      CHECK(encode_prefix(*tok, text, m) == want);
    }
  }
  // A 64 MB line costs memory in proportion to max_length, not to the line.
  const std::string path = test::temp_dir("long_line") + "/d.jsonl";
  {
    std::ofstream out(path);
    out << "{\"text\": \"";
    for (int i = 0; i < (64 << 20) / 8; ++i) out << "abc def ";
    out << "\"}\n";
  }
  struct rusage before {};
  ::getrusage(RUSAGE_SELF, &before);
  DataOptions o;
  o.max_length = 512;
  Dataset d = tokenize_jsonl(path, *byte_tokenizer(), o);
  struct rusage after {};
  ::getrusage(RUSAGE_SELF, &after);
  CHECK(d.length(0) == 512);
  // The line and its parsed copy are two times 64 MB; tokenizing it whole would add GBs.
  CHECK(after.ru_maxrss - before.ru_maxrss < 512 * 1024);  // KiB
}

TEST_CASE("a JSON array broken by a '}' that closes nothing is an error, never an endless skip",
          "[hostile][data]") {
  // Found by fuzz_jsonl: with skip_bad_lines the reader gave back the stray '}' as an empty
  // element, skipped it and found the same '}' again, forever. The reading runs in a child
  // with an alarm so that a regression fails here instead of hanging the suite.
  const std::string dir = test::temp_dir("array_stray");
  const std::vector<std::string> files = {
      R"([{"text": "a"}}, {"text": "b"}])",
      R"([{"instruction": "a", "output": "b: "b"}, {"text": "c, ] }"}"}, {"text": "c"}])"};
  for (size_t i = 0; i < files.size(); ++i) {
    INFO(files[i]);
    const std::string path = fmt::format("{}/data{}.json", dir, i);
    write_file(path, files[i]);
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      ::alarm(30);
      DataOptions o;
      o.skip_bad_lines = true;
      try {
        tokenize_jsonl(path, *byte_tokenizer(), o);
      } catch (const ConfigError& e) {
        const std::string m = e.what();
        ::_exit(m.find(path) != std::string::npos && m.find("closes nothing") != std::string::npos
                    ? 0
                    : 2);
      }
      ::_exit(3);
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    CHECK_FALSE((WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM));  // hung
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);  // 2: another message; 3: no error at all
  }
}

TEST_CASE(
    "the C API maps LibTorch's out-of-memory and I/O failures to their codes, LibTorch's text cut",
    "[hostile][capi]") {
  auto status = [](auto thrower, std::string* msg = nullptr) {
    std::string message;
    zt_status s = ZT_OK;
    try {
      thrower();
    } catch (...) {
      s = capi::status_of(std::current_exception(), message);
    }
    if (msg != nullptr) *msg = message;
    return s;
  };
  std::string m;
  CHECK(status(
            [] {
              throw c10::Error({"f", "file.cpp", 1},
                               "CUDA out of memory. Tried to allocate 2.00 GiB\nmore");
            },
            &m) == ZT_ERR_OUT_OF_MEMORY);
  CHECK(m == "CUDA out of memory. Tried to allocate 2.00 GiB");
  CHECK(status([] {
          throw c10::Error({"f", "file.cpp", 1},
                           "DefaultCPUAllocator: can't allocate memory: you tried to allocate 9");
        }) == ZT_ERR_OUT_OF_MEMORY);
  CHECK(status(
            [] {
              throw c10::Error({"f", "file.cpp", 1},
                               "index out of range in self\nException raised from");
            },
            &m) == ZT_ERR_INTERNAL);
  CHECK(m == "index out of range in self");
  CHECK(status([] { throw std::bad_alloc(); }) == ZT_ERR_OUT_OF_MEMORY);
  CHECK(status([] {
          throw std::filesystem::filesystem_error(
              "rename", std::make_error_code(std::errc::no_space_on_device));
        }) == ZT_ERR_IO);
  CHECK(status([] { throw IoError("x"); }) == ZT_ERR_IO);
  CHECK(status([] { throw 42; }) == ZT_ERR_INTERNAL);
}

TEST_CASE("merge refuses an adapter tensor with no place in the model, as loading it does",
          "[hostile][merge]") {
  // The fixture's LoRA adapter (r 4 on q_proj, v_proj, down_proj of the tiny llama) plus one
  // tensor more: of a layer the model does not have, or of a projection it does not target.
  // Merge reads by the model's names: before, the first was dropped without a word and the
  // second folded in although train refuses the file.
  MergeOptions options;
  options.base_model = fixture("models/llama");
  for (const char* stray : {"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight",
                            "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"}) {
    INFO(stray);
    const std::string dir = test::temp_dir("stray_adapter");
    fs::copy_file(fixture("peft/lora/adapter_config.json"), dir + "/adapter_config.json");
    SafetensorsFile original(fixture("peft/lora/adapter_model.safetensors"));
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const std::string& name : original.names())
      tensors.emplace_back(name, original.load(name));
    const at::Tensor like =
        original.load("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
    tensors.emplace_back(stray, at::zeros_like(like));
    save_safetensors(dir + "/adapter_model.safetensors", tensors);
    const std::vector<std::string> says = {dir + "/adapter_model.safetensors", stray,
                                           "has no place in this model"};
    CHECK_THROWS_MATCHES(merge_checkpoint(dir, dir + "_merged", options), IoError, Has(says));
    CHECK_FALSE(fs::exists(dir + "_merged"));  // refused before anything is written
    auto model = std::make_shared<CausalLM>(load_model_config(fixture("models/llama")),
                                            at::TensorOptions(), /*allocate=*/false);
    CHECK_THROWS_MATCHES(load_adapter(*model, dir, /*trainable=*/true), IoError, Has(says));
  }
}

TEST_CASE("a model beyond the host's available memory is refused before anything is allocated",
          "[hostile][memory]") {
  // About 1.09B parameters: 4.1 GiB of fp32 weights, within any test machine's whole memory (the
  // trainer's first check passes), but full fine-tuning on the CPU also keeps their gradients and
  // Adam's two moments: about 16 GiB in all. Before, the engine began allocating it and ended
  // in the allocator's "enforce fail at alloc_cpu.cpp" (or the OOM killer).
  const std::string dir = test::temp_dir("host_memory");
  test::write_data(dir, "train.jsonl", 4, 25);
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args, {"--model_config", R"({"model_type": "llama", "vocab_size": 32000,
      "hidden_size": 2048, "intermediate_size": 5504, "num_hidden_layers": 19,
      "num_attention_heads": 16})",
                              "--train_file", dir + "/train.jsonl", "--output_dir", dir + "/out",
                              "--max_steps", "1"});
  // Whatever happens, nothing here may take more than 2 GiB: a regression fails in the allocator.
  const AddressSpaceCap cap(2.0 * (1 << 30));
  {
    // The host's available memory stood in for (8 GiB), so that the refusal is the same on
    // every machine.
    const ScopedEnv available("ZT_TEST_HOST_AVAILABLE_BYTES", "8589934592");
    CHECK_THROWS_MATCHES(
        Trainer(args, comm), OutOfMemoryError,
        Has({"ZeRO stage 0 over 1 rank", "1.09B trainable elements", "optimizer state",
             "GiB of weights in Float", "on the host", "8.0 GiB free", "--finetuning_type lora"}));
  }
  // What the check cannot foresee (here: the host claimed to have room, the cap says otherwise)
  // still ends as OutOfMemoryError naming what was allocated, never LibTorch's enforce text.
  const ScopedEnv roomy("ZT_TEST_HOST_AVAILABLE_BYTES", "1e15");
  try {
    Trainer trainer(args, comm);
    FAIL("16 GiB were allocated under a 2 GiB cap");
  } catch (const OutOfMemoryError& e) {
    const std::string m = e.what();
    CHECK_THAT(m, Contains("allocating this rank's optimizer state and weights") &&
                      Contains("could not allocate") && Contains("--finetuning_type lora"));
    CHECK_THAT(m, !Contains("enforce fail") && !Contains("DefaultCPUAllocator"));
  }
}
