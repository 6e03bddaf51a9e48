// ChatGLM2/3's SentencePiece tokenizer with its special tokens.
#include "tokenizer/chatglm_tokenizer.hpp"

#include <filesystem>
#include <functional>

#include <fmt/format.h>

#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/error.hpp"

namespace zt {
namespace {

namespace fs = std::filesystem;

// tokenization_chatglm.py's SPTokenizer numbers these after the model's pieces, in this order.
const char* const kMaskTokens[] = {"[MASK]", "[gMASK]", "[sMASK]"};
const char* const kChatGlm2Specials[] = {"[MASK]", "[gMASK]", "[sMASK]", "sop", "eop"};
const char* const kRoleTokens[] = {"<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"};

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

// A member of a JSON file in `dir`, if the file is there and parses.
std::optional<std::string> json_string_member(const fs::path& file, const char* key) {
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return std::nullopt;
  try {
    rapidjson::Document doc =
        json::parse(files::read_text(file.string(), "tokenizer config"), file.string());
    if (!doc.IsObject() || !doc.HasMember(key) || !doc[key].IsString()) return std::nullopt;
    return std::string(doc[key].GetString(), doc[key].GetStringLength());
  } catch (const Error&) {
    return std::nullopt;
  }
}

}  // namespace

ChatGlmTokenizer::~ChatGlmTokenizer() = default;

std::shared_ptr<ChatGlmTokenizer> ChatGlmTokenizer::load(const std::string& dir,
                                                         Generation generation) {
  const std::string path = (fs::path(dir) / "tokenizer.model").string();
  // read_text refuses what is not a regular file (a FIFO, a device) and anything oversized.
  const std::string bytes = files::read_text(path, "tokenizer model", files::kMaxTokenizerBytes);
  std::shared_ptr<ChatGlmTokenizer> t(new ChatGlmTokenizer());
  t->sp_ = std::make_unique<SentencePieceModel>(bytes, path);
  t->generation_ = generation;
  t->pieces_ = t->sp_->size();
  t->bos_ = t->sp_->bos_id();
  t->eos_ = t->sp_->eos_id();
  t->pad_ = t->sp_->unk_id();
  if (t->eos_ < 0 || t->pad_ < 0) {
    throw ConfigError(
        fmt::format("'{}': the SentencePiece model has no {} piece, which ChatGLM's "
                    "tokenizer needs",
                    path, t->eos_ < 0 ? "eos (</s>)" : "unk (<unk>)"));
  }
  for (const char* s : kChatGlm2Specials) t->specials_.emplace_back(s);
  if (generation == kChatGlm3) {
    for (const char* s : kRoleTokens) t->specials_.emplace_back(s);
  }
  t->fingerprint_ = fmt::format("chatglm{}-sp-v1:{:016x}:{}", static_cast<int>(generation),
                                std::hash<std::string>{}(bytes), bytes.size());
  return t;
}

std::vector<int32_t> ChatGlmTokenizer::encode_plain(std::string_view text) const {
  return sp_->encode(text);
}

std::optional<int32_t> ChatGlmTokenizer::command(std::string_view token) const {
  if (token == "<bos>") return bos_;
  if (token == "<eos>") return eos_;
  if (token == "<pad>") return pad_;
  for (size_t k = 0; k < specials_.size(); ++k) {
    if (specials_[k] == token) return static_cast<int32_t>(pieces_ + k);
  }
  return std::nullopt;
}

std::vector<int32_t> ChatGlmTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  size_t start = 0, i = 0;
  bool after_mask = false;  // the previous token was [MASK], [gMASK] or [sMASK]
  auto flush = [&](size_t end) {
    if (end > start) {
      const std::vector<int32_t> ids = encode_plain(text.substr(start, end - start));
      out.insert(out.end(), ids.begin(), ids.end());
    }
  };
  while (i < text.size()) {
    std::optional<std::string_view> hit;
    bool mask = false;
    const std::string_view rest = text.substr(i);
    for (const char* m : kMaskTokens) {
      if (starts_with(rest, m)) hit = m, mask = true;
    }
    if (!hit && generation_ == kChatGlm3) {
      for (const char* r : kRoleTokens) {
        if (starts_with(rest, r)) hit = r;
      }
    }
    if (!hit && after_mask && i == start) {
      if (starts_with(rest, "sop")) hit = "sop";
      if (starts_with(rest, "eop")) hit = "eop";
    }
    if (!hit) {
      after_mask = false;
      ++i;
      continue;
    }
    flush(i);
    out.push_back(*command(*hit));
    i += hit->size();
    start = i;
    after_mask = mask;
  }
  flush(text.size());
  return out;
}

std::string ChatGlmTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::vector<int32_t> kept;
  for (int32_t id : ids) {
    if (id < 0 || id >= pieces_ || id == bos_ || id == eos_ || id == pad_) continue;
    kept.push_back(id);
  }
  return sp_->decode(kept);
}

bool is_chatglm_tokenizer_folder(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_regular_file(fs::path(dir) / "tokenizer.model", ec)) return false;
  if (json_string_member(fs::path(dir) / "tokenizer_config.json", "tokenizer_class") ==
      std::optional<std::string>("ChatGLMTokenizer")) {
    return true;
  }
  return json_string_member(fs::path(dir) / "config.json", "model_type") ==
         std::optional<std::string>("chatglm");
}

ChatGlmTokenizer::Generation chatglm_generation(const std::string& dir) {
  const fs::path code = fs::path(dir) / "tokenization_chatglm.py";
  std::error_code ec;
  if (!fs::is_regular_file(code, ec)) return ChatGlmTokenizer::kChatGlm3;
  try {
    const std::string text = files::read_text(code.string(), "tokenizer code", uint64_t{1} << 24);
    return text.find("<|user|>") != std::string::npos ? ChatGlmTokenizer::kChatGlm3
                                                      : ChatGlmTokenizer::kChatGlm2;
  } catch (const Error&) {
    return ChatGlmTokenizer::kChatGlm3;
  }
}

}  // namespace zt
