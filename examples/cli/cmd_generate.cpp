// zerotrain generate MODEL_DIR (--prompt "..." | --prompts FILE.jsonl) [--output OUT.jsonl]
// [sampling options]: batched generation with the library's engine (docs/generation.md) — a
// trained model or adapter folder answering many prompts, several samples each, as JSON lines.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>

#include <fmt/format.h>
#include <torch/cuda.h>

#include "commands.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/grpo.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/tokenizer.hpp"

namespace zt::cli {

namespace {

constexpr const char* kUsage =
    "usage: zerotrain generate MODEL_DIR (--prompt \"...\" | --prompts FILE.jsonl) "
    "[--output OUT.jsonl] [options]\n\n"
    "Loads an HF model folder (or a PEFT adapter folder over its base) and generates completions\n"
    "of many prompts at once, written as JSON lines (to stdout without --output): prompt_index,\n"
    "sample, prompt, completion, completion_tokens, finish_reason (stop | length) and the row's\n"
    "other columns.\n"
    "  --prompts FILE       TRL's prompt datasets: a \"prompt\" per line, text (encoded as it is)\n"
    "                       or a list of messages (rendered by the chat template), other columns\n"
    "                       copied to the output\n"
    "  --prompt TEXT        one prompt, formatted as `zerotrain verify` formats it\n"
    "  --template NAME      the chat template (default: the one the run recorded, else the\n"
    "                       model's own chat format); --raw: --prompt as it is\n"
    "  --max_new_tokens N   at most N new tokens a completion [default: 256]\n"
    "  --num_return_sequences N  completions of each prompt [default: 1]\n"
    "  --do_sample BOOL     sample (true) or greedy (false) [default: true]\n"
    "  --temperature T --top_p P --top_k K --min_p M --repetition_penalty R\n"
    "                       transformers' generate options [defaults: 1, 1, 0, 0, 1]\n"
    "  --stop_strings S     transformers' stop_strings: one string, or a JSON list of them\n"
    "  --seed S             sampling seed: a completion's tokens depend on it, its prompt's\n"
    "                       index and its sample number only, not on the batch [default: 0]\n"
    "  --batch_size N       prompts generated together [default: 64]\n"
    "  --device D           auto, cpu or cuda [default: auto: cuda when there is one]\n"
    "  --dtype D            auto, fp32, bf16 or fp16 [default: auto: bf16 on CUDA, fp32 on the\n"
    "                       CPU; a 4-bit base computes in fp32]\n"
    "  --overwrite_output BOOL  replace an existing --output file [default: false]\n";

double parse_real(const std::string& flag, const std::string& text, double min, double max) {
  // Decimal numbers only, as training's flags (strtod alone would take hex, inf and nan).
  const bool decimal =
      !text.empty() && text.find_first_not_of("0123456789+-.eE") == std::string::npos;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  if (!decimal || *end != '\0' || errno == ERANGE || !std::isfinite(v) || v < min || v > max) {
    throw ConfigError(
        fmt::format("--{}: expected a number in [{}, {}], found \"{}\"", flag, min, max, text));
  }
  return v;
}

bool parse_bool(const std::string& flag, const std::string& text) {
  if (text == "true" || text == "1" || text == "True") return true;
  if (text == "false" || text == "0" || text == "False") return false;
  throw ConfigError(fmt::format("--{}: expected true or false, found \"{}\"", flag, text));
}

// The length of the well-formed UTF-8 sequence at s[i] (RFC 3629: no overlongs, surrogates or
// values past U+10FFFF), or 0 when the bytes there form none.
size_t utf8_length(const std::string& s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b = byte(i);
  if (b < 0x80) return 1;
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (b >= 0xC2 && b <= 0xDF) {
    n = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    n = 3;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    n = 4;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > s.size() || byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  return n;
}

// `s` as a JSON string literal: control characters escaped, and each byte that starts no
// well-formed UTF-8 sequence (a completion may end inside a character, the byte tokenizer
// decodes any bytes) written as U+FFFD, as Python's decode(errors="replace") does.
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size();) {
    const char c = s[i];
    const size_t n = utf8_length(s, i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    if (n > 1) {
      out.append(s, i, n);
      i += n;
      continue;
    }
    ++i;
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(static_cast<unsigned char>(c)));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// The value of the last `--name` in `args` (a later flag wins, as in train), every one taken out.
std::optional<std::string> last_option(Args& args, const std::string& name) {
  std::optional<std::string> value;
  while (std::optional<std::string> v = take_option(args, name)) value = std::move(v);
  return value;
}

}  // namespace

int cmd_generate(const Args& in) {
  if (wants_help(in)) {
    std::printf("%s", kUsage);
    return 0;
  }
  Args args = in;
  const std::optional<std::string> prompt = last_option(args, "prompt");
  const std::optional<std::string> prompts_file = last_option(args, "prompts");
  const std::optional<std::string> output = last_option(args, "output");
  std::optional<std::string> template_name = last_option(args, "template");
  const std::string base_model = last_option(args, "base_model").value_or("");
  GenerationOptions g;
  g.max_new_tokens = parse_integer(
      "max_new_tokens", last_option(args, "max_new_tokens").value_or("256"), 1, 1L << 20);
  const long samples = parse_integer(
      "num_return_sequences", last_option(args, "num_return_sequences").value_or("1"), 1, 4096);
  g.do_sample = parse_bool("do_sample", last_option(args, "do_sample").value_or("true"));
  g.temperature =
      parse_real("temperature", last_option(args, "temperature").value_or("1"), 1e-6, 1e6);
  g.top_p = parse_real("top_p", last_option(args, "top_p").value_or("1"), 0, 1);
  g.top_k = parse_integer("top_k", last_option(args, "top_k").value_or("0"), 0, 1L << 30);
  g.min_p = parse_real("min_p", last_option(args, "min_p").value_or("0"), 0, 1);
  g.repetition_penalty = parse_real(
      "repetition_penalty", last_option(args, "repetition_penalty").value_or("1"), 1e-6, 1e6);
  g.seed = static_cast<uint64_t>(
      parse_integer("seed", last_option(args, "seed").value_or("0"), 0, (1L << 62)));
  const long batch_size =
      parse_integer("batch_size", last_option(args, "batch_size").value_or("64"), 1, 1L << 20);
  const std::string device_text = last_option(args, "device").value_or("auto");
  const std::string dtype_text = last_option(args, "dtype").value_or("auto");
  const bool overwrite =
      parse_bool("overwrite_output", last_option(args, "overwrite_output").value_or("false"));
  const std::vector<std::string> stops = [&] {
    try {
      return StopStrings::parse(last_option(args, "stop_strings").value_or(""), "--stop_strings");
    } catch (const InvalidArgument& e) {
      throw ConfigError(e.what());
    }
  }();
  const bool raw = take_switch(args, "raw");
  if (args.size() != 1 || !prompt == !prompts_file)
    throw ConfigError(std::string(kUsage).substr(0, std::string(kUsage).find('\n')));
  if (!args[0].empty() && args[0][0] == '-')
    throw ConfigError(fmt::format("unknown option '{}' (zerotrain generate --help)", args[0]));
  if (device_text != "auto" && device_text != "cpu" && device_text != "cuda")
    throw ConfigError(fmt::format("--device: auto, cpu or cuda, found \"{}\"", device_text));
  if (dtype_text != "auto" && dtype_text != "fp32" && dtype_text != "bf16" && dtype_text != "fp16")
    throw ConfigError(fmt::format("--dtype: auto, fp32, bf16 or fp16, found \"{}\"", dtype_text));
  const bool cuda = device_text == "cuda" || (device_text == "auto" && torch::cuda::is_available());
  if (cuda && !torch::cuda::is_available())
    throw ConfigError("--device cuda: this machine (or this LibTorch) has no CUDA device");
  // The output: a new regular file (or an existing one with --overwrite_output), written under
  // a temporary name and renamed when complete, so a failed run leaves no half file.
  if (output) {
    struct stat st {};
    if (::lstat(output->c_str(), &st) == 0) {
      if (!S_ISREG(st.st_mode)) {
        throw ConfigError(fmt::format(
            "--output '{}' exists and is not a regular file; give a new file name", *output));
      }
      if (!overwrite) {
        throw ConfigError(fmt::format(
            "--output '{}' exists; give a new name or --overwrite_output true", *output));
      }
    }
  }

  const std::string dir = args[0];
  const ReadLock reading(dir);
  TrainedModel trained = load_trained_model(dir, base_model);
  CausalLM& model = *trained.model;
  const ModelConfig& config = model.config();
  std::shared_ptr<Tokenizer> tok = load_tokenizer(trained.base_dir, config.vocab_size);
  check_tokenizer_fits(*tok, config.vocab_size);
  const bool four_bit = trained.quantization.has_value() || config.quantization.has_value();
  at::ScalarType dtype = at::kFloat;
  if (dtype_text == "bf16") dtype = at::kBFloat16;
  if (dtype_text == "fp16") dtype = at::kHalf;
  if (dtype_text == "auto" && cuda && !four_bit) dtype = at::kBFloat16;
  if (four_bit && dtype != at::kFloat) {
    throw ConfigError(fmt::format(
        "--dtype {}: '{}' is an adapter over a 4-bit base, which generates in fp32 here; drop "
        "--dtype",
        dtype_text, dir));
  }
  if (cuda) model.to(at::Device(at::kCUDA, 0));
  if (dtype != at::kFloat) model.to(dtype);

  // The prompts, as stage grpo reads them (file), or as verify formats one (--prompt).
  const std::string recorded =
      template_name ? *template_name : recorded_template(dir).value_or("auto");
  const bool raw_prompt = raw || recorded == kRawTemplate;
  const std::string name = resolve_template(recorded == kRawTemplate ? "auto" : recorded,
                                            trained.adapter ? trained.base_dir : dir, *tok);
  const int64_t room = config.max_position_embeddings - g.max_new_tokens;
  std::vector<GrpoPrompt> prompts;
  int64_t dropped = 0;
  if (prompts_file) {
    if (raw)
      throw ConfigError(
          "--raw applies to --prompt; a --prompts file's text prompts are "
          "sent as they are already");
    prompts = read_grpo_prompts(*prompts_file, *tok, name, 0, room, &dropped);
  } else {
    std::vector<int32_t> ids;
    if (raw_prompt) {
      ids = tok->prefix_ids();
      const std::vector<int32_t> body = tok->encode(*prompt);
      ids.insert(ids.end(), body.begin(), body.end());
    } else {
      ids = encode_prompt(name, *tok, *prompt);
    }
    if (static_cast<int64_t>(ids.size()) > room) dropped = 1;
    if (!ids.empty() && dropped == 0) prompts.push_back({{ids.begin(), ids.end()}, {}});
  }
  if (prompts.empty()) {
    throw ConfigError(
        fmt::format("no prompt to generate from: every prompt is empty or longer than "
                    "max_position_embeddings {} − --max_new_tokens {} tokens",
                    config.max_position_embeddings, g.max_new_tokens));
  }
  if (dropped > 0) {
    std::fprintf(stderr,
                 "zerotrain generate: %lld prompts left out, longer than max_position_embeddings "
                 "%lld − --max_new_tokens %lld tokens\n",
                 static_cast<long long>(dropped),
                 static_cast<long long>(config.max_position_embeddings),
                 static_cast<long long>(g.max_new_tokens));
  }
  if (tok->eos_id() >= 0) g.eos_token_ids = {tok->eos_id()};
  if (config.eos_token_id && *config.eos_token_id != tok->eos_id())
    g.eos_token_ids.push_back(*config.eos_token_id);
  if (!stops.empty())
    g.stop_strings = std::make_shared<StopStrings>(stops, StopStrings::token_texts(*tok));

  // The temporary file is new (O_EXCL) and no link is followed, so nothing outside is written.
  const std::string temporary = output ? fmt::format("{}.tmp-{}", *output, ::getpid()) : "";
  std::FILE* out = stdout;
  if (output) {
    const int fd =
        ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 || (out = ::fdopen(fd, "w")) == nullptr) {
      const int error = errno;
      if (fd >= 0) ::close(fd);
      throw IoError(fmt::format("cannot create '{}': {}", temporary, std::strerror(error)));
    }
  }
  const auto emit = [&](const std::string& line) {
    if (std::fprintf(out, "%s\n", line.c_str()) < 0)
      throw IoError(fmt::format("writing '{}' failed", output ? temporary : "stdout"));
  };
  try {
    const int64_t n = static_cast<int64_t>(prompts.size());
    for (int64_t lo = 0; lo < n; lo += batch_size) {
      const int64_t hi = std::min<int64_t>(n, lo + batch_size);
      std::vector<std::vector<int64_t>> batch;
      std::vector<uint64_t> streams;
      for (int64_t p = lo; p < hi; ++p) {
        for (long s = 0; s < samples; ++s) {
          batch.push_back(prompts[static_cast<size_t>(p)].ids);
          streams.push_back(static_cast<uint64_t>(p * samples + s));
        }
      }
      const std::vector<Generated> done = model.generate_batch(batch, g, streams);
      for (size_t i = 0; i < done.size(); ++i) {
        const int64_t p = lo + static_cast<int64_t>(i) / samples;
        const GrpoPrompt& source = prompts[static_cast<size_t>(p)];
        std::vector<int32_t> tokens(done[i].tokens.begin(), done[i].tokens.end());
        // A stop token leaves the text; a token that completed a stop string stays in it, as
        // transformers keeps it.
        const bool stop_token = done[i].stopped && !tokens.empty() &&
                                std::find(g.eos_token_ids.begin(), g.eos_token_ids.end(),
                                          tokens.back()) != g.eos_token_ids.end();
        if (stop_token) tokens.pop_back();
        std::string line = fmt::format(
            "{{\"prompt_index\": {}, \"sample\": {}, \"prompt\": {}, \"completion\": {}, "
            "\"completion_tokens\": {}, \"finish_reason\": \"{}\"",
            p, static_cast<int64_t>(i) % samples,
            json_string(tok->decode(std::vector<int32_t>(source.ids.begin(), source.ids.end()))),
            json_string(tok->decode(tokens)), done[i].tokens.size(),
            done[i].stopped ? "stop" : "length");
        for (const auto& [column, value] : source.columns)
          line += fmt::format(", {}: {}", json_string(column), json_string(value));
        emit(line + "}");
      }
    }
    if (output) {
      std::FILE* done = out;
      out = nullptr;
      if (std::fclose(done) != 0) throw IoError(fmt::format("writing '{}' failed", temporary));
      std::filesystem::rename(temporary, *output);
      std::fprintf(stderr, "zerotrain generate: %zu completions of %zu prompts in %s\n",
                   prompts.size() * static_cast<size_t>(samples), prompts.size(), output->c_str());
    }
  } catch (...) {
    if (output) {
      if (out != nullptr) std::fclose(out);
      std::error_code ec;
      std::filesystem::remove(temporary, ec);
    }
    throw;
  }
  return 0;
}

}  // namespace zt::cli
