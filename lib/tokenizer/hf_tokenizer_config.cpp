// The special tokens of tokenizer_config.json / special_tokens_map.json, and the pipeline that
// tokenizer_config.json's tokenizer_class builds in place of tokenizer.json's own.
#include <filesystem>
#include <tuple>

#include <fmt/format.h>

#include "tokenizer/hf_tokenizer.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"

namespace zt::hf {

namespace {

// A tokenizer_config.json or special_tokens_map.json, when the folder has it.
struct ConfigFile {
  std::string path;
  rapidjson::Document doc;
  bool present = false;
};

ConfigFile read_config(const std::string& dir, const char* name) {
  ConfigFile f;
  f.path = (std::filesystem::path(dir) / name).string();
  std::error_code ec;
  if (!std::filesystem::exists(f.path, ec)) return f;
  f.doc =
      json::parse(files::read_text(f.path, "tokenizer file", files::kMaxTokenizerBytes), f.path);
  json::ObjectReader check(f.doc, "", f.path);  // an object without repeated keys
  f.present = true;
  return f;
}

// A special token as transformers writes it: "<s>", {"content": "<s>", ...} or null.
std::optional<std::string> token_setting(const ConfigFile& f, const char* key) {
  if (!f.present) return std::nullopt;
  json::ObjectReader r(f.doc, "", f.path);
  const rapidjson::Value* v = r.find(key);
  if (v == nullptr) return std::nullopt;
  if (v->IsString()) return std::string(v->GetString(), v->GetStringLength());
  if (v->IsObject()) {
    json::ObjectReader t(*v, key, f.path);
    if (std::optional<std::string> c = t.string("content")) return c;
  }
  r.fail(key, "a token string, {\"content\": ...} or null");
}

std::optional<bool> flag_setting(const ConfigFile& f, const char* key) {
  if (!f.present) return std::nullopt;
  json::ObjectReader r(f.doc, "", f.path);
  return r.boolean(key);
}

}  // namespace

std::optional<ClassPipeline> class_pipeline(const std::string& dir) {
  const ConfigFile config = read_config(dir, "tokenizer_config.json");
  if (!config.present) return std::nullopt;
  json::ObjectReader r(config.doc, "", config.path);
  const std::string name = r.string("tokenizer_class").value_or("");
  // add_prefix_space null means the class's default (true for LLaMA, false for Qwen2).
  const rapidjson::Value* aps = r.find("add_prefix_space");
  const bool aps_given = aps != nullptr && !aps->IsNull();
  const bool aps_value = aps_given && r.boolean("add_prefix_space").value_or(false);
  ClassPipeline p;
  p.name = name;
  if (name == "LlamaTokenizer" || name == "LlamaTokenizerFast") {
    // BPE(fuse_unk, byte_fallback), no normalizer, Metaspace without splitting: prepended
    // "always" (legacy true), at the input's start only ("first", legacy false, the class's
    // default) or never (add_prefix_space false).
    const bool prefix = aps_given ? aps_value : true;
    const bool legacy = r.boolean("legacy").value_or(false);
    PreTokenizerStep meta{PreTokenizerStep::kMetaspace};
    meta.replacement = "\xE2\x96\x81";
    meta.split = false;
    meta.prepend = !prefix  ? PreTokenizerStep::Prepend::kNever
                   : legacy ? PreTokenizerStep::Prepend::kAlways
                            : PreTokenizerStep::Prepend::kFirst;
    p.pre_tokenizers = {meta};
    DecoderStep replace{DecoderStep::kReplace};
    replace.text = "\xE2\x96\x81";
    replace.content = " ";
    p.decoders = {replace, DecoderStep{DecoderStep::kByteFallback},
                  DecoderStep{DecoderStep::kFuse}};
    if (prefix) {
      DecoderStep strip{DecoderStep::kStrip};
      strip.text = " ";
      strip.start = 1;
      p.decoders.push_back(strip);
    }
    p.fuse_unk = p.byte_fallback = true;
    return p;
  }
  if (name == "BertTokenizer" || name == "BertTokenizerFast") {
    // WordPiece over the file's vocabulary; BertNormalizer(clean_text, handle_chinese_chars =
    // tokenize_chinese_chars, strip_accents (null: as lowercase), lowercase = do_lower_case);
    // BertPreTokenizer; the WordPiece decoder; [CLS] text [SEP]. The class's defaults are
    // true for both switches.
    NormalizerStep bert{NormalizerStep::kBert};
    bert.lowercase = r.boolean("do_lower_case").value_or(true);
    bert.chinese_chars = r.boolean("tokenize_chinese_chars").value_or(true);
    bert.strip_accents = r.boolean("strip_accents").value_or(bert.lowercase);
    p.normalizers = {bert};
    p.pre_tokenizers = bert_pre_tokenizer();
    DecoderStep pieces{DecoderStep::kWordPiece};
    pieces.text = "##";
    pieces.cleanup = true;
    p.decoders = {pieces};
    p.model = ClassPipeline::Model::kWordPiece;
    p.unk_token = token_setting(config, "unk_token").value_or("[UNK]");
    p.template_around = std::make_pair(token_setting(config, "cls_token").value_or("[CLS]"),
                                       token_setting(config, "sep_token").value_or("[SEP]"));
    return p;
  }
  if (name == "Qwen2Tokenizer" || name == "Qwen2TokenizerFast") {
    // NFC, the Qwen2 regex split, ByteLevel without its own regex; plain BPE.
    p.normalizers = {NormalizerStep{NormalizerStep::kForm}};
    p.normalizers[0].form = text::NormalForm::kNFC;
    PreTokenizerStep split{PreTokenizerStep::kSplit};
    split.pattern = text::SplitPattern::kQwen2;
    PreTokenizerStep bytes{PreTokenizerStep::kByteLevel};
    bytes.add_prefix_space = aps_given && aps_value;
    bytes.use_regex = false;
    p.pre_tokenizers = {split, bytes};
    p.decoders = {DecoderStep{DecoderStep::kByteLevel}};
    return p;
  }
  return std::nullopt;
}

SpecialTokens read_special_tokens(const std::string& dir, const HfTokenizer& tokenizer,
                                  const std::optional<Template>& post_template) {
  const ConfigFile config = read_config(dir, "tokenizer_config.json");
  const ConfigFile map = read_config(dir, "special_tokens_map.json");
  // transformers adds the tokens of added_tokens_decoder that tokenizer.json lacks; zerotrain
  // would then encode differently, so they must agree.
  if (config.present) {
    json::ObjectReader r(config.doc, "", config.path);
    if (std::optional<json::ObjectReader> decoder = r.object("added_tokens_decoder")) {
      const rapidjson::Value& entries = config.doc["added_tokens_decoder"];
      for (auto it = entries.MemberBegin(); it != entries.MemberEnd(); ++it) {
        const std::string id(it->name.GetString(), it->name.GetStringLength());
        json::ObjectReader entry(it->value, decoder->key_path(id), config.path);
        const std::string content = entry.string("content").value_or("");
        if (std::to_string(tokenizer.token_id(content)) != id) {
          entry.fail_value("content", fmt::format("\"{}\" is not token {} of tokenizer.json; "
                                                  "save the tokenizer again with HF so that the "
                                                  "two files agree",
                                                  content, id));
        }
      }
    }
  }
  const ConfigFile& source = config.present ? config : map;
  auto setting = [&](const char* key) -> std::pair<std::optional<std::string>, const ConfigFile*> {
    if (std::optional<std::string> s = token_setting(config, key)) return {s, &config};
    return {token_setting(map, key), &map};
  };
  auto id_of = [&](const char* key) -> int32_t {
    auto [token, file] = setting(key);
    if (!token) return -1;
    const int32_t id = tokenizer.token_id(*token);
    if (id < 0) {
      throw ConfigError(
          fmt::format("{}: {}: \"{}\" is not a token of tokenizer.json (transformers "
                      "would add it as a new token); add it with HF and save the "
                      "tokenizer again",
                      file->path, key, *token));
    }
    return id;
  };
  const int32_t template_bos =
      post_template && !post_template->before.empty() ? post_template->before[0] : -1;
  const int32_t template_eos =
      post_template && !post_template->after.empty() ? post_template->after[0] : -1;

  SpecialTokens s;
  s.bos_id = id_of("bos_token");
  s.eos_id = id_of("eos_token");
  s.pad_id = id_of("pad_token");
  const std::optional<bool> add_bos = flag_setting(config, "add_bos_token");
  const std::optional<bool> add_eos = flag_setting(config, "add_eos_token");
  // Without add_bos_token / add_eos_token, transformers keeps tokenizer.json's post-processor:
  // the template's tokens are what it adds.
  s.add_bos = add_bos.value_or(template_bos >= 0);
  s.add_eos = add_eos.value_or(template_eos >= 0);
  for (auto [flag, template_id, id, key] :
       {std::make_tuple(add_bos, template_bos, &s.bos_id, "bos_token"),
        std::make_tuple(add_eos, template_eos, &s.eos_id, "eos_token")}) {
    if (flag || template_id < 0) continue;
    if (*id >= 0 && *id != template_id) {
      throw ConfigError(
          fmt::format("{}: {} is token {}, but tokenizer.json's post_processor adds token {}; set "
                      "add_bos_token / add_eos_token in tokenizer_config.json to say which applies",
                      source.present ? source.path : dir, key, *id, template_id));
    }
    *id = template_id;
  }
  if (!config.present && !map.present && s.eos_id < 0) {
    // No config at all: take the usual end-of-text token of the families zerotrain knows.
    for (const char* name : {"</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>"}) {
      if ((s.eos_id = tokenizer.token_id(name)) >= 0) {
        log::warn("'{}' has no tokenizer_config.json: using \"{}\" (id {}) as eos", dir, name,
                  s.eos_id);
        break;
      }
    }
  }
  if (s.add_bos && s.bos_id < 0) {
    throw ConfigError(
        fmt::format("{}: add_bos_token is true but there is no bos_token", config.path));
  }
  if (s.add_eos && s.eos_id < 0) {
    throw ConfigError(
        fmt::format("{}: add_eos_token is true but there is no eos_token", config.path));
  }
  return s;
}

}  // namespace zt::hf
