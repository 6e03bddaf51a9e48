// ChatGLM-Finetuning's record layouts (its utils.py GLM2PromptDataSet / GLM3PromptDataSet),
// token for token: the source and target cut to max_source_length / max_length as data_set.py
// cuts them, the prefix and eos of ChatGLM's tokenizer around them.
#include "data/record_layouts.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "tokenizer/chatglm_tokenizer.hpp"
#include "zerotrain/error.hpp"

namespace zt::data {
namespace {

// v[start:stop] as Python slices it (negative bounds count from the end, clamped).
std::vector<int32_t> py_slice(const std::vector<int32_t>& v, int64_t start, int64_t stop) {
  const int64_t n = static_cast<int64_t>(v.size());
  auto clamp = [n](int64_t i) { return std::clamp(i < 0 ? i + n : i, int64_t{0}, n); };
  const int64_t a = clamp(start), b = clamp(stop);
  if (a >= b) return {};
  return {v.begin() + a, v.begin() + b};
}

std::vector<int32_t> joined(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class ChatGlmLayout final : public RecordLayout {
 public:
  ChatGlmLayout(bool glm3, const ChatGlmTokenizer& tok, int64_t max_length,
                int64_t max_source_length)
      : glm3_(glm3), tok_(tok), max_len_(max_length), max_src_(max_source_length) {}

  Example encode(const std::string& instruction, const std::string& output,
                 bool* truncated) const override {
    const auto command = [&](const char* name) { return *tok_.command(name); };
    std::vector<int32_t> src, tgt;
    int64_t max_tgt = 0;
    *truncated = false;
    if (!glm3_) {
      src = tok_.encode_plain("[Round 1]\n\n问：" + instruction + "\n\n答：");
      if (static_cast<int64_t>(src.size()) > max_src_) {  // keeps "\n\n答：", its last 4 tokens
        src = joined(py_slice(src, 0, max_src_ - 4), py_slice(src, -4, INT64_MAX));
        *truncated = true;
      }
      max_tgt = max_len_ - 3 - static_cast<int64_t>(src.size());
      tgt = tok_.encode_plain(output);
    } else {
      src = joined(joined({command("<|user|>")}, tok_.encode_plain("\n")),
                   tok_.encode_plain(instruction));
      if (static_cast<int64_t>(src.size()) > max_src_) {
        src = py_slice(src, 0, max_src_);
        *truncated = true;
      }
      max_tgt = max_len_ - 6 - static_cast<int64_t>(src.size());
      tgt = joined(joined({command("<|assistant|>")}, tok_.encode_plain("\n")),
                   tok_.encode_plain(output));
    }
    if (static_cast<int64_t>(tgt.size()) > max_tgt) {
      tgt = py_slice(tgt, 0, max_tgt);
      *truncated = true;
    }
    Example e;
    e.append(tok_.prefix_ids(), false);
    e.append(src, false);
    e.append(tgt, true);
    e.append({tok_.eos_id()}, true);
    return e;
  }

 private:
  bool glm3_;
  const ChatGlmTokenizer& tok_;
  int64_t max_len_, max_src_;
};

}  // namespace

std::string record_layout_template(const std::string& layout) {
  if (layout == "glm2") return "chatglm2";
  if (layout == "glm3") return "chatglm3";
  return "";
}

std::unique_ptr<RecordLayout> record_layout(const DataOptions& o, const Tokenizer& tok) {
  const std::string& layout = o.glm_prompt_layout;
  if (layout.empty()) return nullptr;
  if (layout != "glm2" && layout != "glm3") {
    throw ConfigError(
        fmt::format("mode: expected glm2 or glm3 (ChatGLM-Finetuning's data layouts "
                    "for ChatGLM2/3-6B), found \"{}\"",
                    layout));
  }
  // The layout needs ChatGLM's tokenizer (its special tokens) and room for the target under
  // max_length once the source has max_source_length tokens (data_set.py asserts it).
  const auto* glm = dynamic_cast<const ChatGlmTokenizer*>(&tok);
  if (glm == nullptr) {
    throw ConfigError(fmt::format(
        "mode {}: ChatGLM-Finetuning's data layout needs ChatGLM2/3's tokenizer (a model folder "
        "with its tokenizer.model); this model's tokenizer is another",
        layout));
  }
  const bool glm3 = layout == "glm3";
  if (glm3 && glm->generation() != ChatGlmTokenizer::kChatGlm3) {
    throw ConfigError(
        "mode glm3: the folder's tokenizer is ChatGLM2's (its tokenization_chatglm.py has no "
        "role tokens); use --mode glm2 or a ChatGLM3 folder");
  }
  const int64_t reserved = glm3 ? 6 : 3;
  const int64_t min_src = glm3 ? 1 : 4;
  if (o.max_source_length < min_src || o.max_source_length + reserved > o.max_length) {
    throw ConfigError(fmt::format(
        "max_src_len {} with max_len {}: mode {} needs max_src_len >= {} and max_len >= "
        "max_src_len + {} (data_set.py's room for the target and its special tokens)",
        o.max_source_length, o.max_length, layout, min_src, reserved));
  }
  return std::make_unique<ChatGlmLayout>(glm3, *glm, o.max_length, o.max_source_length);
}

}  // namespace zt::data
