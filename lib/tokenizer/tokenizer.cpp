// The byte-level tokenizer and the choice of tokenizer for a model folder.
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <mutex>
#include <set>
#include <string_view>

#include <fmt/format.h>

#include "tokenizer/chatglm_tokenizer.hpp"
#include "tokenizer/hf_tokenizer.hpp"
#include "util/files.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/tokenizer.hpp"

namespace zt {
namespace {

// Ids 0-255 are bytes; the specials follow them.
constexpr int32_t kByteBos = 256;
constexpr int32_t kByteEos = 257;
constexpr int32_t kBytePad = 258;
constexpr int64_t kByteVocab = 259;

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string text;
    text.reserve(ids.size());
    for (int32_t id : ids) {
      if (id >= 0 && id < 256) text.push_back(static_cast<char>(id));
    }
    return text;
  }

  int32_t bos_id() const override { return kByteBos; }
  int32_t eos_id() const override { return kByteEos; }
  int32_t pad_id() const override { return kBytePad; }
  bool add_bos() const override { return true; }
  bool add_eos() const override { return false; }
  int64_t vocab_size() const override { return kByteVocab; }
  std::string fingerprint() const override { return "byte-v1:bos=256,eos=257,pad=258"; }
};

}  // namespace

std::shared_ptr<Tokenizer> byte_tokenizer() {
  static const std::shared_ptr<Tokenizer> instance = std::make_shared<ByteTokenizer>();
  return instance;
}

std::vector<int32_t> encode_prefix(const Tokenizer& tok, std::string_view text, size_t max_ids) {
  // Ids cover a few bytes each: 32 bytes an id leaves room for whole words of any script.
  size_t length = 32 * max_ids + 4096;
  std::vector<int32_t> previous;
  while (length < text.size()) {
    size_t cut = length;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80)
      --cut;  // not inside a character
    std::vector<int32_t> ids = tok.encode(text.substr(0, cut));
    // Enough ids, with a margin for the few tokens the cut can change, and the same as the
    // previous (shorter) cut gave: the ids before the cut do not depend on where it is.
    if (ids.size() >= max_ids + 64) {
      ids.resize(max_ids);
      if (ids == previous) return ids;
      previous = std::move(ids);
    }
    length *= 2;
  }
  std::vector<int32_t> ids = tok.encode(text);
  if (ids.size() > max_ids) ids.resize(max_ids);
  return ids;
}

void check_tokenizer_fits(const Tokenizer& tok, int64_t model_vocab_size) {
  if (tok.vocab_size() <= model_vocab_size) return;
  throw ConfigError(fmt::format(
      "the model's vocab_size is {}, but its tokenizer{} has {} ids; text cannot be encoded for "
      "it: give the "
      "model a vocab_size >= {}{}, or feed token ids below {} (pre-tokenized input_ids data, or "
      "train_step from a host)",
      model_vocab_size,
      tok.vocab_size() == kByteVocab ? " (the byte-level one: 256 bytes + bos, eos, pad)" : "",
      tok.vocab_size(), tok.vocab_size(),
      tok.vocab_size() == kByteVocab ? "" : " or use the model's own tokenizer", model_vocab_size));
}

namespace {

// Whether `path` starts like a tiktoken rank file ("<base64 token> <rank>" lines) — what the
// remote-code glm-4-9b-chat folder names tokenizer.model — rather than a SentencePiece model (a
// protobuf). Reads only the first line.
bool is_tiktoken_ranks(const std::string& path) {
  const int fd = files::open_regular(path, "tokenizer model");
  char head[512];
  const ssize_t n = ::read(fd, head, sizeof head);
  ::close(fd);
  if (n <= 0) return false;
  const std::string_view text(head, static_cast<size_t>(n));
  const size_t end = text.find('\n');
  if (end == std::string_view::npos) return false;
  const std::string_view line = text.substr(0, end);
  const size_t space = line.find(' ');
  if (space == 0 || space == std::string_view::npos || space + 1 == line.size()) return false;
  for (size_t i = 0; i < space; ++i) {
    const char c = line[i];
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '+' && c != '/' && c != '=') {
      return false;
    }
  }
  for (size_t i = space + 1; i < line.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(line[i]))) return false;
  }
  return true;
}

}  // namespace

std::shared_ptr<Tokenizer> load_tokenizer(const std::string& model_dir, int64_t model_vocab_size) {
  namespace fs = std::filesystem;
  if (!model_dir.empty()) {
    std::error_code ec;
    if (!fs::is_directory(model_dir, ec)) {
      throw IoError(fmt::format("model folder '{}' does not exist or is not a folder", model_dir));
    }
    if (fs::exists(fs::path(model_dir) / "tokenizer.json", ec)) {
      std::shared_ptr<HfTokenizer> tok = HfTokenizer::load(model_dir);
      if (tok->vocab_size() > model_vocab_size) {
        throw ConfigError(fmt::format(
            "'{}': the tokenizer has {} ids (tokenizer.json's vocabulary and added tokens), more "
            "than the model's vocab_size {}; use the tokenizer the model was trained with, or "
            "resize the model's embeddings",
            (fs::path(model_dir) / "tokenizer.json").string(), tok->vocab_size(),
            model_vocab_size));
      }
      return tok;
    }
    const fs::path model_file = fs::path(model_dir) / "tokenizer.model";
    if (fs::is_regular_file(model_file, ec) && is_tiktoken_ranks(model_file.string())) {
      throw ConfigError(fmt::format(
          "'{}' is a tiktoken rank file (the remote-code glm-4-9b-chat tokenizer), not a "
          "SentencePiece model: use the transformers folder of the same model, "
          "THUDM/glm-4-9b-chat-hf, whose tokenizer.json zerotrain reads",
          model_file.string()));
    }
    if (is_chatglm_tokenizer_folder(model_dir)) {
      std::shared_ptr<ChatGlmTokenizer> tok =
          ChatGlmTokenizer::load(model_dir, chatglm_generation(model_dir));
      if (tok->vocab_size() > model_vocab_size) {
        throw ConfigError(fmt::format(
            "'{}': the tokenizer has {} ids (its pieces and ChatGLM's special tokens), more than "
            "the model's vocab_size {}; use the tokenizer the model was trained with",
            model_file.string(), tok->vocab_size(), model_vocab_size));
      }
      return tok;
    }
    for (const char* name :
         {"tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json"}) {
      if (fs::exists(fs::path(model_dir) / name, ec)) {
        throw ConfigError(fmt::format(
            "model folder '{}' has {} but no tokenizer.json: zerotrain reads Hugging Face "
            "tokenizers only from tokenizer.json; convert the tokenizer with HF transformers "
            "(AutoTokenizer.from_pretrained(folder).save_pretrained(folder) writes "
            "tokenizer.json), or remove the tokenizer files to train with the byte-level "
            "tokenizer",
            model_dir, name));
      }
    }
    // Once per folder and process (merge, verify and every rank load it more than once).
    static std::mutex mutex;
    static std::set<std::string> warned;
    std::lock_guard<std::mutex> lock(mutex);
    if (warned.insert(fs::absolute(model_dir).lexically_normal().string()).second) {
      log::warn(
          "model folder '{}' has no tokenizer files (tokenizer.json, tokenizer.model, "
          "vocab.json, merges.txt, tokenizer_config.json); using the byte-level tokenizer",
          model_dir);
    }
  }
  return byte_tokenizer();
}

}  // namespace zt
