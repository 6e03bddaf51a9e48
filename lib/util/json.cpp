// RapidJSON helpers with path-carrying errors.
#include "util/json.hpp"

#include "util/spelling.hpp"

#include <cctype>
#include <cmath>

#include <fmt/format.h>
#include <rapidjson/error/en.h>
#include <rapidjson/prettywriter.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include "util/json_nesting.hpp"
#include "zerotrain/error.hpp"

namespace zt::json {

namespace {

// 1-based line and column of byte `offset` in `text`.
std::pair<size_t, size_t> line_and_column(std::string_view text, size_t offset) {
  size_t line = 1, column = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return {line, column};
}

}  // namespace

void check_depth(std::string_view text, const std::string& source) {
  // One pass over the text, strings skipped: the reading that follows (RapidJSON's iterative
  // parser, then readers and writers that walk values recursively) never meets deeper nesting.
  int depth = 0;
  NestingScanner scan;
  for (size_t i = 0; i < text.size(); ++i) {
    depth += scan.feed(text[i]);
    if (depth > kMaxDepth) {
      const auto [line, column] = line_and_column(text, i);
      throw ConfigError(
          fmt::format("{}: JSON nested deeper than {} levels (at line {}, column {}); no file "
                      "zerotrain reads needs that many — is it the right file?",
                      source, kMaxDepth, line, column));
    }
  }
}

namespace {

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The \uXXXX escape at text[i] (text[i] == '\\', text[i + 1] == 'u'), or -1.
int escaped_unit(std::string_view text, size_t i) {
  if (i + 6 > text.size() || text[i + 1] != 'u') return -1;
  int v = 0;
  for (size_t k = i + 2; k < i + 6; ++k) {
    const int d = hex_digit(text[k]);
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

// Surrogate code points, escaped without their pair or as raw bytes (ED A0-BF ..): refused
// with the line and column, before RapidJSON would turn a lone low one into invalid UTF-8.
void check_surrogates(std::string_view text, const std::string& source) {
  auto refuse = [&](size_t at, const char* what) {
    const auto [line, column] = line_and_column(text, at);
    throw ConfigError(fmt::format(
        "{}: {} at line {}, column {}: a surrogate code point is not a character (JSON text "
        "must be valid Unicode); fix the text that wrote it",
        source, what, line, column));
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == 0xED && i + 1 < text.size() &&
        (static_cast<unsigned char>(text[i + 1]) & 0xE0) == 0xA0)
      refuse(i, "the bytes of a UTF-16 surrogate");
    if (c != '\\') continue;
    const int unit = escaped_unit(text, i);
    if (unit < 0) {
      ++i;  // an escaped character: skip it (it may be a backslash)
      continue;
    }
    if (unit >= 0xDC00 && unit <= 0xDFFF) refuse(i, "a lone low surrogate escape");
    if (unit >= 0xD800 && unit <= 0xDBFF) {
      const int low = i + 6 < text.size() && text[i + 6] == '\\' ? escaped_unit(text, i + 6) : -1;
      if (low < 0xDC00 || low > 0xDFFF) refuse(i, "a lone high surrogate escape");
      i += 6;  // the pair's low half
    }
    i += 5;
  }
}

}  // namespace

rapidjson::Document parse(std::string_view text, const std::string& source) {
  check_depth(text, source);
  check_surrogates(text, source);
  rapidjson::Document doc;
  doc.Parse<rapidjson::kParseIterativeFlag>(text.data(), text.size());
  if (doc.HasParseError()) {
    const auto [line, column] = line_and_column(text, doc.GetErrorOffset());
    throw ConfigError(fmt::format("{}: invalid JSON at line {}, column {}: {}", source, line,
                                  column, rapidjson::GetParseError_En(doc.GetParseError())));
  }
  return doc;
}

std::string type_name(const rapidjson::Value& v) {
  switch (v.GetType()) {
    case rapidjson::kNullType:
      return "null";
    case rapidjson::kFalseType:
    case rapidjson::kTrueType:
      return "a boolean";
    case rapidjson::kObjectType:
      return "an object";
    case rapidjson::kArrayType:
      return "an array";
    case rapidjson::kStringType:
      return "a string";
    case rapidjson::kNumberType:
      return "a number";
  }
  return "?";
}

std::string dump(const rapidjson::Value& v, bool pretty) {
  rapidjson::StringBuffer buffer;
  if (pretty) {
    rapidjson::PrettyWriter<rapidjson::StringBuffer> writer(buffer);
    writer.SetIndent(' ', 2);
    v.Accept(writer);
  } else {
    rapidjson::Writer<rapidjson::StringBuffer> writer(buffer);
    v.Accept(writer);
  }
  return buffer.GetString();
}

std::string render(const rapidjson::Value& v, size_t max_chars) {
  std::string s = dump(v);
  if (s.size() > max_chars) s = s.substr(0, max_chars) + "...";
  return s;
}

std::optional<int64_t> as_integer(const rapidjson::Value& v) {
  if (v.IsInt64()) return v.GetInt64();
  if (v.IsUint64()) return std::nullopt;  // above INT64_MAX
  if (v.IsDouble()) {
    double d = v.GetDouble();
    // 2^63 is exactly representable; anything at or beyond it does not fit.
    if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9.2233720368547758e18) {
      return static_cast<int64_t>(d);
    }
  }
  return std::nullopt;
}

ObjectReader::ObjectReader(const rapidjson::Value& value, std::string path, std::string source)
    : value_(&value), path_(std::move(path)), source_(std::move(source)) {
  if (!value.IsObject()) {
    throw ConfigError(fmt::format("{}: {}: expected an object, found {}", source_,
                                  path_.empty() ? "<top level>" : path_, render(value)));
  }
  std::set<std::string> seen;
  for (auto it = value.MemberBegin(); it != value.MemberEnd(); ++it) {
    std::string key(it->name.GetString(), it->name.GetStringLength());
    if (!seen.insert(key).second) {
      throw ConfigError(
          fmt::format("{}: {}: the key appears twice; keep one", source_, key_path(key)));
    }
  }
}

std::string ObjectReader::key_path(std::string_view key) const {
  return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
}

bool ObjectReader::present(const char* key) const {
  return value_->FindMember(key) != value_->MemberEnd();
}

bool ObjectReader::has(const char* key) const {
  auto it = value_->FindMember(key);
  return it != value_->MemberEnd() && !it->value.IsNull();
}

bool ObjectReader::is_auto(const char* key) const {
  auto it = value_->FindMember(key);
  return it != value_->MemberEnd() && it->value.IsString() &&
         std::string_view(it->value.GetString(), it->value.GetStringLength()) == "auto";
}

const rapidjson::Value* ObjectReader::find(const char* key) {
  known_.insert(key);
  auto it = value_->FindMember(key);
  if (it == value_->MemberEnd() || it->value.IsNull()) return nullptr;
  return &it->value;
}

void ObjectReader::fail(std::string_view key, std::string_view expected) const {
  auto it = value_->FindMember(rapidjson::StringRef(key.data(), key.size()));
  std::string found = it == value_->MemberEnd() ? "nothing" : render(it->value);
  throw ConfigError(
      fmt::format("{}: {}: expected {}, found {}", source_, key_path(key), expected, found));
}

void ObjectReader::fail_value(std::string_view key, std::string_view message) const {
  throw ConfigError(fmt::format("{}: {}: {}", source_, key_path(key), message));
}

std::optional<bool> ObjectReader::boolean(const char* key) {
  const rapidjson::Value* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (!v->IsBool()) fail(key, "true or false");
  return v->GetBool();
}

std::optional<int64_t> ObjectReader::integer(const char* key, int64_t min, int64_t max) {
  const rapidjson::Value* v = find(key);
  if (v == nullptr) return std::nullopt;
  std::optional<int64_t> i = v->IsNumber() ? as_integer(*v) : std::nullopt;
  if (!i || *i < min || *i > max) {
    std::string range;
    if (min != INT64_MIN && max != INT64_MAX) {
      range = fmt::format(" {}-{}", min, max);
    } else if (min != INT64_MIN) {
      range = fmt::format(" >= {}", min);
    }
    fail(key, "an integer" + range);
  }
  return i;
}

std::optional<double> ObjectReader::number(const char* key, double min, double max) {
  const rapidjson::Value* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (!v->IsNumber()) fail(key, "a number");
  double d = v->GetDouble();
  if (!(d >= min && d <= max)) {
    fail(key, max >= 1e308 ? fmt::format("a number >= {}", min)
                           : fmt::format("a number in [{}, {}]", min, max));
  }
  return d;
}

std::optional<std::string> ObjectReader::string(const char* key) {
  const rapidjson::Value* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (!v->IsString()) fail(key, "a string");
  return std::string(v->GetString(), v->GetStringLength());
}

std::string ObjectReader::required_string(const char* key, std::string_view expected) {
  std::optional<std::string> s = string(key);
  if (!s) fail(key, expected);
  return *s;
}

namespace {
std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
}  // namespace

std::optional<std::string> ObjectReader::choice(const char* key,
                                                const std::vector<std::string>& choices,
                                                bool fold_case) {
  std::optional<std::string> s = string(key);
  if (!s) return std::nullopt;
  for (const std::string& c : choices) {
    if (fold_case ? lower(c) == lower(*s) : c == *s) return c;
  }
  std::string list;
  for (const std::string& c : choices)
    list += (list.empty() ? "" : ", ") + fmt::format("\"{}\"", c);
  fail(key, "one of " + list);
}

std::optional<ObjectReader> ObjectReader::object(const char* key) {
  const rapidjson::Value* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (!v->IsObject()) fail(key, "an object");
  return ObjectReader(*v, key_path(key), source_);
}

void ObjectReader::known(std::initializer_list<const char*> keys) {
  for (const char* k : keys) known_.insert(k);
}

std::vector<std::string> ObjectReader::unknown_paths() const {
  std::vector<std::string> out;
  for (auto it = value_->MemberBegin(); it != value_->MemberEnd(); ++it) {
    std::string key(it->name.GetString(), it->name.GetStringLength());
    if (known_.count(key) == 0) out.push_back(key_path(key));
  }
  return out;
}

std::string ObjectReader::nearest_known(std::string_view key) const {
  return nearest_name(key, std::vector<std::string>(known_.begin(), known_.end()), 2);
}

void ObjectReader::reject_unknown(std::string_view why) const {
  for (auto it = value_->MemberBegin(); it != value_->MemberEnd(); ++it) {
    const std::string key(it->name.GetString(), it->name.GetStringLength());
    if (known_.count(key) != 0) continue;
    const std::string near = nearest_known(key);
    throw ConfigError(fmt::format("{}: {}: unknown key{}; {}", source_, key_path(key),
                                  near.empty() ? "" : fmt::format(" (did you mean '{}'?)", near),
                                  why));
  }
}

}  // namespace zt::json
