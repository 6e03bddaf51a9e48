// Reading tokenizer.json into a validated TokenizerJson (tokenizer_config.json and
// special_tokens_map.json: hf_tokenizer_config.cpp). Whatever zerotrain does not implement is a
// ConfigError naming the file, the key and the type, never a silently different tokenization.
#include <set>

#include <fmt/format.h>

#include "tokenizer/bpe_model.hpp"
#include "tokenizer/hf_tokenizer.hpp"
#include "tokenizer/precompiled_charsmap.hpp"
#include "tokenizer/unigram_model.hpp"
#include "tokenizer/word_models.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"

namespace zt::hf {
namespace {

constexpr const char* kNormalizerTypes =
    "NFC, NFD, NFKC, NFKD, Lowercase, Strip, StripAccents, BertNormalizer, Nmt, Precompiled, "
    "Prepend, Replace, ByteLevel, Sequence";
constexpr const char* kPreTokenizerTypes =
    "Split (any regex or string, every behavior), Whitespace, WhitespaceSplit, Digits, "
    "Punctuation, BertPreTokenizer, CharDelimiterSplit, FixedLength, ByteLevel, Metaspace, "
    "Sequence";
constexpr const char* kDecoderTypes =
    "ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, WordPiece, BPEDecoder, CTC, "
    "Sequence";
constexpr const char* kPostProcessorTypes =
    "TemplateProcessing, BertProcessing, RobertaProcessing, ByteLevel, Sequence";

// HF's character classes for its pre-tokenizers, as regexes: Rust's char::is_whitespace, and
// ASCII punctuation or Unicode P*.
constexpr const char* kWhitespace =
    "[\\t-\\r \\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}"
    "\\x{205f}\\x{3000}]";
constexpr const char* kPunctuation = "[\\p{P}\\x21-\\x2f\\x3a-\\x40\\x5b-\\x60\\x7b-\\x7e]";

PreTokenizerStep split_step(const std::string& regex, text::SplitBehavior behavior, bool invert) {
  PreTokenizerStep s{PreTokenizerStep::kSplit};
  s.matcher = text::Matcher::regex(regex);
  s.behavior = behavior;
  s.invert = invert;
  return s;
}

[[noreturn]] void unsupported(const json::ObjectReader& r, std::string_view key,
                              std::string_view value, std::string_view supported) {
  r.fail_value(key, fmt::format("{} is not supported by zerotrain (supported: {}); see "
                                "docs/tokenizers.md",
                                value, supported));
}

std::string type_of(json::ObjectReader& r) {
  return r.required_string("type", "a string naming the type");
}

// The members of the array `key` as objects, with their paths.
template <typename F>
void for_each_object(json::ObjectReader& r, const char* key, const std::string& source, F&& f) {
  const rapidjson::Value* list = r.find(key);
  if (list == nullptr || !list->IsArray()) r.fail(key, "an array of objects");
  for (rapidjson::SizeType i = 0; i < list->Size(); ++i) {
    json::ObjectReader item((*list)[i], fmt::format("{}[{}]", r.key_path(key), i), source);
    f(item);
  }
}

// A Replace's pattern: {"String": "..."} (a literal) or {"Regex": "..."} (Oniguruma).
void read_pattern(json::ObjectReader& r, const char* key, const std::string& source,
                  std::string& literal, std::shared_ptr<const text::Matcher>& matcher) {
  const rapidjson::Value* v = r.find(key);
  if (v == nullptr || !v->IsObject())
    r.fail(key, "an object {\"String\": ...} or {\"Regex\": ...}");
  json::ObjectReader p(*v, r.key_path(key), source);
  if (p.has("Regex")) {
    const std::string regex = p.required_string("Regex");
    try {
      matcher = text::Matcher::regex(regex);
    } catch (const ConfigError& e) {
      p.fail_value("Regex", e.what());
    }
    return;
  }
  std::optional<std::string> s = p.string("String");
  if (!s || s->empty()) p.fail("String", "a non-empty string");
  literal = *s;
}

// A string of exactly one character (Metaspace's replacement, Strip's content).
std::string one_char(json::ObjectReader& r, const char* key, const char* fallback) {
  std::string s = r.string(key).value_or(fallback);
  uint32_t len = 0;
  if (s.empty() || !text::is_valid_utf8(s) || (text::decode_at(s, 0, len), len != s.size())) {
    r.fail(key, "a string of one character");
  }
  return s;
}

void read_normalizer(json::ObjectReader& r, const std::string& source,
                     std::vector<NormalizerStep>& out) {
  const std::string type = type_of(r);
  if (type == "Sequence") {
    for_each_object(r, "normalizers", source,
                    [&](json::ObjectReader& item) { read_normalizer(item, source, out); });
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    NormalizerStep s{NormalizerStep::kForm};
    s.form = type == "NFC"    ? text::NormalForm::kNFC
             : type == "NFD"  ? text::NormalForm::kNFD
             : type == "NFKC" ? text::NormalForm::kNFKC
                              : text::NormalForm::kNFKD;
    out.push_back(s);
  } else if (type == "Prepend") {
    NormalizerStep s{NormalizerStep::kPrepend};
    s.text = r.required_string("prepend");
    out.push_back(s);
  } else if (type == "Replace") {
    NormalizerStep s{NormalizerStep::kReplace};
    read_pattern(r, "pattern", source, s.text, s.matcher);
    s.content = r.required_string("content");
    out.push_back(s);
  } else if (type == "Lowercase" || type == "StripAccents" || type == "Nmt" ||
             type == "ByteLevel") {
    out.push_back(NormalizerStep{type == "Lowercase"      ? NormalizerStep::kLowercase
                                 : type == "StripAccents" ? NormalizerStep::kStripAccents
                                 : type == "Nmt"          ? NormalizerStep::kNmt
                                                          : NormalizerStep::kByteLevel});
  } else if (type == "Strip") {
    NormalizerStep s{NormalizerStep::kStrip};
    s.left = r.boolean("strip_left").value_or(true);
    s.right = r.boolean("strip_right").value_or(true);
    out.push_back(s);
  } else if (type == "BertNormalizer") {
    NormalizerStep s{NormalizerStep::kBert};
    s.clean_text = r.boolean("clean_text").value_or(true);
    s.chinese_chars = r.boolean("handle_chinese_chars").value_or(true);
    s.lowercase = r.boolean("lowercase").value_or(true);
    s.strip_accents = r.boolean("strip_accents").value_or(s.lowercase);  // null: as lowercase
    out.push_back(s);
  } else if (type == "Precompiled") {
    NormalizerStep s{NormalizerStep::kPrecompiled};
    const std::string charsmap = r.required_string("precompiled_charsmap");
    // An empty charsmap (an identity SentencePiece normalizer) changes nothing.
    if (charsmap.empty()) return;
    try {
      s.charsmap = std::make_shared<const PrecompiledCharsmap>(charsmap, source);
    } catch (const ConfigError& e) {
      r.fail_value("precompiled_charsmap", e.what());
    }
    out.push_back(s);
  } else {
    unsupported(r, "type", fmt::format("normalizer \"{}\"", type), kNormalizerTypes);
  }
}

// How much the normalizer can grow a text, bounded before any text meets it: the product of
// each step's worst factor (a Replace's content over its pattern, a Unicode form's longest
// decomposition). Real tokenizers stay far below the limit (LLaMA-2's Prepend + Replace of
// " " by "▁": 3×); a chain of Replaces that doubles text each time would need gigabytes.
void check_normalizer_growth(const std::vector<NormalizerStep>& steps, const std::string& source) {
  constexpr double kMaxGrowth = 4096;
  double growth = 1;
  for (const NormalizerStep& step : steps) {
    double factor = 1;
    switch (step.kind) {
      case NormalizerStep::kForm:
        factor = step.form == text::NormalForm::kNFC ? 3 : 18;  // U+FDFA decomposes into 18
        break;
      case NormalizerStep::kReplace:
        // A regex may match empty text between any two bytes.
        factor = step.matcher ? static_cast<double>(step.content.size() + 1)
                              : std::max(1.0, static_cast<double>(step.content.size()) /
                                                  static_cast<double>(step.text.size()));
        break;
      case NormalizerStep::kLowercase:  // U+0130 (2 bytes) lowercases to 3
        factor = 1.5;
        break;
      case NormalizerStep::kBert:  // NFD, then spaces around a 3-byte CJK character
        factor = (step.strip_accents ? 18 : 1) * 1.5 * (5.0 / 3);
        break;
      case NormalizerStep::kByteLevel:  // a byte becomes a character of up to 2 bytes
        factor = 2;
        break;
      case NormalizerStep::kPrecompiled:  // a character of at least one byte, by its rule
        factor = static_cast<double>(step.charsmap->longest_replacement()) + 1;
        break;
      default:
        break;
    }
    growth *= factor;
    if (growth > kMaxGrowth) {
      throw ConfigError(fmt::format(
          "{}: normalizer: its steps can grow a text more than {}-fold (a Replace's content much "
          "longer than its pattern, or such steps in a row); no real tokenizer does this — is "
          "it the right file?",
          source, kMaxGrowth));
    }
  }
}

// A Split's `behavior` (HF's SplitDelimiterBehavior), refused by key when it is none of five.
text::SplitBehavior split_behavior(json::ObjectReader& r, const std::string& name) {
  static const std::pair<const char*, text::SplitBehavior> kBehaviors[] = {
      {"Removed", text::SplitBehavior::kRemoved},
      {"Isolated", text::SplitBehavior::kIsolated},
      {"MergedWithPrevious", text::SplitBehavior::kMergedWithPrevious},
      {"MergedWithNext", text::SplitBehavior::kMergedWithNext},
      {"Contiguous", text::SplitBehavior::kContiguous}};
  for (const auto& [n, b] : kBehaviors) {
    if (name == n) return b;
  }
  r.fail_value("behavior", fmt::format("\"{}\": expected Removed, Isolated, MergedWithPrevious, "
                                       "MergedWithNext or Contiguous",
                                       name));
}

void read_pre_tokenizer(json::ObjectReader& r, const std::string& source,
                        std::vector<PreTokenizerStep>& out) {
  const std::string type = type_of(r);
  if (type == "Sequence") {
    for_each_object(r, "pretokenizers", source,
                    [&](json::ObjectReader& item) { read_pre_tokenizer(item, source, out); });
    return;
  }
  if (!out.empty() && out.back().kind == PreTokenizerStep::kByteLevel) {
    unsupported(r, "type", fmt::format("pre-tokenizer \"{}\" after ByteLevel", type),
                "ByteLevel as the last pre-tokenizer");
  }
  if (type == "Split") {
    PreTokenizerStep s{PreTokenizerStep::kSplit};
    const rapidjson::Value* v = r.find("pattern");
    if (v == nullptr || !v->IsObject()) {
      r.fail("pattern", "an object {\"Regex\": \"...\"} or {\"String\": \"...\"}");
    }
    json::ObjectReader p(*v, r.key_path("pattern"), source);
    s.behavior = split_behavior(
        r, r.required_string(
               "behavior", "Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous"));
    s.invert = r.boolean("invert").value_or(false);
    if (p.has("String")) {
      s.matcher = text::Matcher::literal(p.required_string("String"));
    } else {
      const std::string regex = p.required_string("Regex");
      std::optional<text::SplitPattern> known = text::known_split_pattern(regex);
      if (known && s.behavior == text::SplitBehavior::kIsolated && !s.invert) {
        s.pattern = *known;  // the hand-written matcher of this exact regex
      } else {
        try {
          s.matcher = text::Matcher::regex(regex);
        } catch (const ConfigError& e) {
          p.fail_value("Regex", e.what());
        }
      }
    }
    out.push_back(s);
  } else if (type == "ByteLevel") {
    PreTokenizerStep s{PreTokenizerStep::kByteLevel};
    s.add_prefix_space = r.boolean("add_prefix_space").value_or(true);
    s.use_regex = r.boolean("use_regex").value_or(true);
    s.pattern = text::SplitPattern::kGpt2;
    r.known({"trim_offsets"});  // offsets only
    out.push_back(s);
  } else if (type == "Metaspace") {
    PreTokenizerStep s{PreTokenizerStep::kMetaspace};
    s.replacement = one_char(r, "replacement", "\xE2\x96\x81");
    const std::string scheme =
        r.choice("prepend_scheme", {"always", "first", "never"}).value_or("always");
    s.prepend = scheme == "always"  ? PreTokenizerStep::Prepend::kAlways
                : scheme == "first" ? PreTokenizerStep::Prepend::kFirst
                                    : PreTokenizerStep::Prepend::kNever;
    // The spelling before prepend_scheme existed: add_prefix_space false means never.
    if (r.boolean("add_prefix_space") == std::optional<bool>(false)) {
      if (s.prepend != PreTokenizerStep::Prepend::kNever && r.has("prepend_scheme")) {
        r.fail_value("add_prefix_space", "false contradicts prepend_scheme");
      }
      s.prepend = PreTokenizerStep::Prepend::kNever;
    }
    s.split = r.boolean("split").value_or(true);
    r.known({"str_rep"});
    out.push_back(s);
  } else if (type == "CharDelimiterSplit") {
    // A split on one character, which is removed (HF: split(delimiter, Removed)).
    PreTokenizerStep s{PreTokenizerStep::kSplit};
    s.matcher = text::Matcher::literal(one_char(r, "delimiter", " "));
    s.behavior = text::SplitBehavior::kRemoved;
    out.push_back(s);
  } else if (type == "FixedLength") {
    // Chunks of `length` characters (Unicode scalar values) from the start, the last one
    // shorter: each run of up to `length` characters isolated. HF's default is 5; a length of 0
    // makes HF's Rust code panic.
    const int64_t length = r.integer("length", 1, 65536).value_or(5);
    PreTokenizerStep s{PreTokenizerStep::kSplit};
    s.matcher = text::Matcher::regex(fmt::format("[\\s\\S]{{1,{}}}", length));
    s.behavior = text::SplitBehavior::kIsolated;
    out.push_back(s);
  } else if (type == "Whitespace" || type == "WhitespaceSplit" || type == "Digits" ||
             type == "Punctuation" || type == "BertPreTokenizer") {
    // HF's character-class pre-tokenizers are Splits: the pattern each one uses, as a regex.
    // Whitespace: \w+|[^\w\s]+ kept (Removed, inverted); WhitespaceSplit: Rust's
    // char::is_whitespace removed; Digits: char::is_numeric, one by one or in runs;
    // Punctuation: ASCII punctuation or Unicode P*, by its behavior (default Isolated); Bert:
    // WhitespaceSplit then Punctuation.
    const auto add = [&](const std::string& regex, text::SplitBehavior behavior, bool invert) {
      out.push_back(split_step(regex, behavior, invert));
    };
    if (type == "Whitespace") {
      add("\\w+|[^\\w\\s]+", text::SplitBehavior::kRemoved, true);
    } else if (type == "WhitespaceSplit") {
      add(kWhitespace, text::SplitBehavior::kRemoved, false);
    } else if (type == "Digits") {
      add("\\p{N}",
          r.boolean("individual_digits").value_or(false) ? text::SplitBehavior::kIsolated
                                                         : text::SplitBehavior::kContiguous,
          false);
    } else if (type == "Punctuation") {
      text::SplitBehavior behavior = text::SplitBehavior::kIsolated;
      if (auto b = r.string("behavior")) behavior = split_behavior(r, *b);
      add(kPunctuation, behavior, false);
    } else {
      const std::vector<PreTokenizerStep> bert = bert_pre_tokenizer();
      out.insert(out.end(), bert.begin(), bert.end());
    }
  } else {
    unsupported(r, "type", fmt::format("pre-tokenizer \"{}\"", type), kPreTokenizerTypes);
  }
}

void read_decoder(json::ObjectReader& r, const std::string& source, std::vector<DecoderStep>& out) {
  const std::string type = type_of(r);
  if (type == "Sequence") {
    for_each_object(r, "decoders", source,
                    [&](json::ObjectReader& item) { read_decoder(item, source, out); });
  } else if (type == "ByteLevel") {
    out.push_back(DecoderStep{DecoderStep::kByteLevel});
  } else if (type == "Metaspace") {
    DecoderStep s{DecoderStep::kMetaspace};
    s.text = one_char(r, "replacement", "\xE2\x96\x81");
    const std::string scheme =
        r.choice("prepend_scheme", {"always", "first", "never"}).value_or("always");
    s.prepend = scheme != "never" && r.boolean("add_prefix_space").value_or(true);
    out.push_back(s);
  } else if (type == "Replace") {
    DecoderStep s{DecoderStep::kReplace};
    read_pattern(r, "pattern", source, s.text, s.matcher);
    s.content = r.required_string("content");
    out.push_back(s);
  } else if (type == "WordPiece") {
    DecoderStep s{DecoderStep::kWordPiece};
    s.text = r.string("prefix").value_or("##");
    s.cleanup = r.boolean("cleanup").value_or(true);
    out.push_back(s);
  } else if (type == "BPEDecoder") {
    DecoderStep s{DecoderStep::kBpe};
    s.text = r.string("suffix").value_or("</w>");
    out.push_back(s);
  } else if (type == "CTC") {
    DecoderStep s{DecoderStep::kCtc};
    s.text = r.string("pad_token").value_or("<pad>");
    s.content = r.string("word_delimiter_token").value_or("|");
    s.cleanup = r.boolean("cleanup").value_or(true);
    out.push_back(s);
  } else if (type == "ByteFallback") {
    out.push_back(DecoderStep{DecoderStep::kByteFallback});
  } else if (type == "Fuse") {
    out.push_back(DecoderStep{DecoderStep::kFuse});
  } else if (type == "Strip") {
    DecoderStep s{DecoderStep::kStrip};
    s.text = one_char(r, "content", " ");
    s.start = static_cast<int>(r.integer("start", 0, 1 << 20).value_or(0));
    s.stop = static_cast<int>(r.integer("stop", 0, 1 << 20).value_or(0));
    out.push_back(s);
  } else {
    unsupported(r, "type", fmt::format("decoder \"{}\"", type), kDecoderTypes);
  }
}

// The ids a template item stands for: the special_tokens entry of a SpecialToken.
std::vector<int32_t> template_ids(json::ObjectReader& tp, const rapidjson::Value& specials,
                                  const std::string& name, const std::string& path,
                                  const std::string& source) {
  auto it = specials.IsObject() ? specials.FindMember(name.c_str()) : specials.MemberEnd();
  if (!specials.IsObject() || it == specials.MemberEnd()) {
    tp.fail_value("special_tokens", fmt::format("has no entry \"{}\", which {} names", name, path));
  }
  json::ObjectReader entry(it->value, tp.key_path("special_tokens") + "." + name, source);
  const rapidjson::Value* ids = entry.find("ids");
  if (ids == nullptr || !ids->IsArray()) entry.fail("ids", "an array of token ids");
  std::vector<int32_t> out;
  for (const rapidjson::Value& id : ids->GetArray()) {
    std::optional<int64_t> v = id.IsNumber() ? json::as_integer(id) : std::nullopt;
    if (!v || *v < 0 || *v >= INT32_MAX) entry.fail("ids", "an array of token ids");
    out.push_back(static_cast<int32_t>(*v));
  }
  return out;
}

void read_template(json::ObjectReader& r, const std::string& source, Template& t) {
  const rapidjson::Value* single = r.find("single");
  if (single == nullptr || !single->IsArray()) r.fail("single", "an array of template items");
  const rapidjson::Value* specials = r.find("special_tokens");
  static const rapidjson::Value kNone(rapidjson::kObjectType);
  bool seen_sequence = false;
  for (rapidjson::SizeType i = 0; i < single->Size(); ++i) {
    const std::string path = fmt::format("{}[{}]", r.key_path("single"), i);
    json::ObjectReader item((*single)[i], path, source);
    if (std::optional<json::ObjectReader> seq = item.object("Sequence")) {
      if (seq->string("id").value_or("") != "A") seq->fail("id", "\"A\"");
      seen_sequence = true;
    } else if (std::optional<json::ObjectReader> sp = item.object("SpecialToken")) {
      std::optional<std::string> name = sp->string("id");
      if (!name) sp->fail("id", "a string");
      std::vector<int32_t> ids =
          template_ids(r, specials != nullptr ? *specials : kNone, *name, path, source);
      auto& side = seen_sequence ? t.after : t.before;
      side.insert(side.end(), ids.begin(), ids.end());
    } else {
      item.fail("SpecialToken", "an item {\"SpecialToken\": ...} or {\"Sequence\": ...}");
    }
  }
  if (!seen_sequence) r.fail_value("single", "has no {\"Sequence\": {\"id\": \"A\"}} item");
  if (t.before.size() > 1 || t.after.size() > 1) {
    unsupported(r, "single",
                fmt::format("a template with {} special ids before and {} after the text",
                            t.before.size(), t.after.size()),
                "at most one before (a bos) and one after (an eos)");
  }
}

void read_post_processor(json::ObjectReader& r, const std::string& source,
                         std::optional<Template>& out) {
  const std::string type = type_of(r);
  if (type == "Sequence") {
    for_each_object(r, "processors", source,
                    [&](json::ObjectReader& item) { read_post_processor(item, source, out); });
  } else if (type == "ByteLevel") {
    // Trims offsets only; ids are unchanged.
  } else if (type == "TemplateProcessing") {
    if (out) r.fail_value("type", "a second template-adding post-processor is not supported");
    out.emplace();
    read_template(r, source, *out);
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    // [CLS] $A [SEP] (BERT), <s> $A </s> (RoBERTa), the ids given with the tokens.
    if (out) r.fail_value("type", "a second template-adding post-processor is not supported");
    out.emplace();
    for (const char* key : {"cls", "sep"}) {
      const rapidjson::Value* v = r.find(key);
      std::optional<int64_t> id;
      if (v != nullptr && v->IsArray() && v->Size() == 2 && (*v)[0].IsString() &&
          (*v)[1].IsNumber()) {
        id = json::as_integer((*v)[1]);
      }
      if (!id || *id < 0 || *id >= INT32_MAX) r.fail(key, "a pair [token, id]");
      (std::string(key) == "cls" ? out->before : out->after).push_back(static_cast<int32_t>(*id));
    }
    r.known({"trim_offsets", "add_prefix_space"});  // offsets only
  } else {
    unsupported(r, "type", fmt::format("post-processor \"{}\"", type), kPostProcessorTypes);
  }
}

// A {token: id} vocabulary.
std::vector<std::pair<std::string, int32_t>> read_vocab_object(json::ObjectReader& m) {
  const rapidjson::Value* v = m.find("vocab");
  if (v == nullptr || !v->IsObject()) m.fail("vocab", "an object {token: id}");
  std::vector<std::pair<std::string, int32_t>> vocab;
  vocab.reserve(v->MemberCount());
  for (auto it = v->MemberBegin(); it != v->MemberEnd(); ++it) {
    const int64_t id =
        it->value.IsNumber() ? json::as_integer(it->value).value_or(-1) : int64_t{-1};
    std::string token(it->name.GetString(), it->name.GetStringLength());
    if (id < 0 || id > INT32_MAX) {
      m.fail_value("vocab", fmt::format("\"{}\" has id {}: expected an integer >= 0", token,
                                        json::render(it->value)));
    }
    vocab.emplace_back(std::move(token), static_cast<int32_t>(id));
  }
  return vocab;
}

std::shared_ptr<const TokenModel> read_bpe(json::ObjectReader& m, const std::string& source,
                                           bool byte_level,
                                           const std::optional<ClassPipeline>& pipeline) {
  if (std::optional<double> dropout = m.number("dropout"); dropout && *dropout != 0.0) {
    unsupported(m, "dropout", fmt::format("{}", *dropout), "null (no BPE dropout)");
  }
  BpeOptions o;
  o.unk_token = m.string("unk_token");
  o.fuse_unk = m.boolean("fuse_unk").value_or(false);
  o.byte_fallback = m.boolean("byte_fallback").value_or(false);
  o.ignore_merges = m.boolean("ignore_merges").value_or(false);
  o.continuing_subword_prefix = m.string("continuing_subword_prefix").value_or("");
  o.end_of_word_suffix = m.string("end_of_word_suffix").value_or("");
  o.byte_level = byte_level;
  if (pipeline) {  // the class's own BPE(vocab, merges, ...): its flags, merges always applied
    o.fuse_unk = pipeline->fuse_unk;
    o.byte_fallback = pipeline->byte_fallback;
    o.ignore_merges = false;
  }
  const std::vector<std::pair<std::string, int32_t>> vocab = read_vocab_object(m);
  const rapidjson::Value* ml = m.find("merges");
  if (ml == nullptr || !ml->IsArray()) m.fail("merges", "an array of merges");
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(ml->Size());
  for (rapidjson::SizeType i = 0; i < ml->Size(); ++i) {
    const rapidjson::Value& e = (*ml)[i];
    if (e.IsString()) {  // "left right"
      std::string_view s(e.GetString(), e.GetStringLength());
      const size_t space = s.find(' ');
      if (space == std::string_view::npos || s.find(' ', space + 1) != std::string_view::npos) {
        m.fail_value("merges", fmt::format("entry {} is {}: expected \"left right\" with one space",
                                           i, json::render(e)));
      }
      merges.emplace_back(std::string(s.substr(0, space)), std::string(s.substr(space + 1)));
    } else if (e.IsArray() && e.Size() == 2 && e[0].IsString() && e[1].IsString()) {
      merges.emplace_back(json::text(e[0]), json::text(e[1]));
    } else {
      m.fail_value("merges", fmt::format("entry {} is {}: expected \"left right\" or [left, right]",
                                         i, json::render(e)));
    }
  }
  return std::make_shared<const BpeModel>(vocab, merges, o, source);
}

std::shared_ptr<const TokenModel> read_unigram(json::ObjectReader& m, const std::string& source) {
  const rapidjson::Value* v = m.find("vocab");
  if (v == nullptr || !v->IsArray()) m.fail("vocab", "an array of [piece, score]");
  std::vector<std::pair<std::string, double>> pieces;
  pieces.reserve(v->Size());
  for (rapidjson::SizeType i = 0; i < v->Size(); ++i) {
    const rapidjson::Value& e = (*v)[i];
    if (!e.IsArray() || e.Size() != 2 || !e[0].IsString() || !e[1].IsNumber()) {
      m.fail_value("vocab",
                   fmt::format("entry {} is {}: expected [piece, score]", i, json::render(e)));
    }
    pieces.emplace_back(json::text(e[0]), e[1].GetDouble());
  }
  std::optional<int32_t> unk;
  if (std::optional<int64_t> id = m.integer("unk_id", 0, INT32_MAX)) {
    unk = static_cast<int32_t>(*id);
  }
  const bool byte_fallback = m.boolean("byte_fallback").value_or(false);
  return std::make_shared<const UnigramModel>(pieces, unk, byte_fallback, source);
}

std::shared_ptr<const TokenModel> read_model(json::ObjectReader& m, const std::string& source,
                                             bool byte_level,
                                             const std::optional<ClassPipeline>& pipeline) {
  // Files written before the model carried its type: HF tries BPE, WordPiece, WordLevel and
  // Unigram in turn; their members tell them apart.
  std::string type = m.string("type").value_or("");
  if (type.empty()) {
    const rapidjson::Value* v = m.find("vocab");
    type = m.has("merges")                                                           ? "BPE"
           : v != nullptr && v->IsArray()                                            ? "Unigram"
           : m.has("continuing_subword_prefix") || m.has("max_input_chars_per_word") ? "WordPiece"
                                                                                     : "WordLevel";
  }
  if (pipeline && pipeline->model == ClassPipeline::Model::kWordPiece) {
    // The class's own WordPiece over the file's vocabulary (a WordPiece, WordLevel or BPE
    // vocab object), with its defaults: "##" continues a word, words past 100 characters are
    // unknown.
    if (type == "Unigram") {
      m.fail_value("type",
                   fmt::format("\"Unigram\": {} builds a WordPiece model from a "
                               "vocabulary object; the file and its tokenizer_config.json's "
                               "tokenizer_class disagree",
                               pipeline->name));
    }
    return std::make_shared<const WordPieceModel>(read_vocab_object(m), pipeline->unk_token, "##",
                                                  100, source);
  }
  if (pipeline && type != "BPE") {
    m.fail_value("type", fmt::format("\"{}\": {} builds a BPE pipeline; the file and its "
                                     "tokenizer_config.json's tokenizer_class disagree",
                                     type, pipeline->name));
  }
  if (type == "BPE") return read_bpe(m, source, byte_level, pipeline);
  if (type == "Unigram") return read_unigram(m, source);
  if (type == "WordPiece") {
    const int64_t max_chars =
        m.integer("max_input_chars_per_word", 0, int64_t{1} << 40).value_or(100);
    return std::make_shared<const WordPieceModel>(
        read_vocab_object(m), m.string("unk_token").value_or("[UNK]"),
        m.string("continuing_subword_prefix").value_or("##"), static_cast<size_t>(max_chars),
        source);
  }
  if (type == "WordLevel") {
    return std::make_shared<const WordLevelModel>(read_vocab_object(m),
                                                  m.string("unk_token").value_or("<unk>"), source);
  }
  unsupported(m, "type", fmt::format("model \"{}\"", type), "BPE, Unigram, WordPiece, WordLevel");
}

// The added tokens with the ids HF tokenizers gives them when it loads the file: an existing
// entry's id, else the next id after the vocabulary. A file that says otherwise is rejected
// (HF would only warn and use its own id).
void read_added_tokens(json::ObjectReader& r, const std::string& source, const TokenModel& model,
                       size_t model_entries, std::vector<AddedToken>& out) {
  if (!r.has("added_tokens")) return;
  int64_t max_added = -1;
  std::set<std::string> contents;
  for_each_object(r, "added_tokens", source, [&](json::ObjectReader& item) {
    AddedToken t;
    std::optional<int64_t> id = item.integer("id", 0, INT32_MAX - 1);
    if (!id) item.fail("id", "a token id");
    std::optional<std::string> content = item.string("content");
    if (!content || content->empty() || !text::is_valid_utf8(*content)) {
      item.fail("content", "a non-empty UTF-8 string");
    }
    t.id = static_cast<int32_t>(*id);
    t.content = *content;
    t.special = item.boolean("special").value_or(false);
    t.single_word = item.boolean("single_word").value_or(false);
    t.lstrip = item.boolean("lstrip").value_or(false);
    t.rstrip = item.boolean("rstrip").value_or(false);
    t.normalized = item.boolean("normalized").value_or(!t.special);
    if (!contents.insert(t.content).second) {
      item.fail_value("content", fmt::format("\"{}\" is added twice", t.content));
    }
    int64_t expected = model.token_id(t.content);
    if (expected < 0) {
      const auto entries = static_cast<int64_t>(model_entries);
      expected = max_added < 0                            ? entries
                 : (max_added >= entries || entries == 0) ? max_added + 1
                                                          : entries;
    }
    if (expected != t.id) {
      item.fail_value("id", fmt::format("\"{}\" has id {}, but HF tokenizers would give it id {} "
                                        "(the vocabulary's id, or the next free one); fix the file",
                                        t.content, t.id, expected));
    }
    max_added = std::max<int64_t>(max_added, t.id);
    out.push_back(std::move(t));
  });
}

}  // namespace

std::vector<PreTokenizerStep> bert_pre_tokenizer() {
  return {split_step(kWhitespace, text::SplitBehavior::kRemoved, false),
          split_step(kPunctuation, text::SplitBehavior::kIsolated, false)};
}

TokenizerJson read_tokenizer_json(const std::string& path,
                                  const std::optional<ClassPipeline>& pipeline) {
  const std::string content = files::read_text(path, "tokenizer file", files::kMaxTokenizerBytes);
  rapidjson::Document doc = json::parse(content, path);
  json::ObjectReader r(doc, "", path);
  TokenizerJson spec;
  if (std::optional<std::string> v = r.string("version"); v && *v != "1.0") {
    r.fail("version", "\"1.0\"");
  }
  r.known({"truncation", "padding"});  // per-call settings in transformers; encode never pads
  if (std::optional<json::ObjectReader> n = r.object("normalizer")) {
    read_normalizer(*n, path, spec.normalizers);
    check_normalizer_growth(spec.normalizers, path);
  }
  if (std::optional<json::ObjectReader> p = r.object("pre_tokenizer")) {
    read_pre_tokenizer(*p, path, spec.pre_tokenizers);
  }
  if (std::optional<json::ObjectReader> p = r.object("post_processor")) {
    read_post_processor(*p, path, spec.post_template);
  }
  if (std::optional<json::ObjectReader> d = r.object("decoder")) {
    spec.decoders.emplace();
    read_decoder(*d, path, *spec.decoders);
  }
  std::optional<json::ObjectReader> m = r.object("model");
  if (!m) r.fail("model", "an object");
  // A byte-level tokenizer.json under a SentencePiece class's name (DeepSeek-V3 and
  // DeepSeek-R1-Distill-Llama name LlamaTokenizerFast): the class's Metaspace pipeline would
  // drop every space, which transformers 5's LlamaTokenizer did (transformers #45488) until it
  // learned to keep a byte-level file (#48317); the file as written is what the model was
  // trained with, as transformers 4.x and the tokenizers library read it.
  const bool file_byte_level = !spec.pre_tokenizers.empty() &&
                               spec.pre_tokenizers.back().kind == PreTokenizerStep::kByteLevel;
  const bool class_byte_level =
      pipeline && !pipeline->pre_tokenizers.empty() &&
      pipeline->pre_tokenizers.back().kind == PreTokenizerStep::kByteLevel;
  std::optional<ClassPipeline> applied = pipeline;
  if (applied && file_byte_level && !class_byte_level) {
    log::info(
        "{}: byte-level, though tokenizer_config.json names {}: read as written (as "
        "transformers 4.x and the tokenizers library read it; docs/tokenizers.md)",
        path, applied->name);
    applied.reset();
  }
  if (applied) {
    spec.normalizers = applied->normalizers;
    spec.pre_tokenizers = applied->pre_tokenizers;
    spec.decoders = applied->decoders;
  }
  const bool byte_level = !spec.pre_tokenizers.empty() &&
                          spec.pre_tokenizers.back().kind == PreTokenizerStep::kByteLevel;
  spec.model = read_model(*m, path, byte_level, applied);
  read_added_tokens(r, path, *spec.model, spec.model->entries(), spec.added);
  if (applied && applied->template_around) {
    // The class's TemplateProcessing: its [CLS]-like token before the text, its [SEP]-like
    // one after, by their ids (transformers falls back to 2 and 3 for a token it lacks).
    const auto id_of = [&](const std::string& token, int32_t fallback) {
      for (const AddedToken& t : spec.added) {
        if (t.content == token) return t.id;
      }
      const int32_t id = spec.model->token_id(token);
      return id >= 0 ? id : fallback;
    };
    spec.post_template = Template{{id_of(applied->template_around->first, 2)},
                                  {id_of(applied->template_around->second, 3)}};
  }
  return spec;
}

}  // namespace zt::hf
