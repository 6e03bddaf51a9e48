// RapidJSON helpers that read typed values and name the JSON path of whatever is wrong.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <rapidjson/document.h>

namespace zt::json {

/// How deep any JSON zerotrain reads may nest (objects and arrays): far beyond every real
/// config, tokenizer.json or data record, and shallow enough for the recursive walks after it.
constexpr int kMaxDepth = 256;

/// A ConfigError naming `source`, the limit and where it is passed when `text` nests deeper than
/// kMaxDepth. One pass; strings are skipped.
void check_depth(std::string_view text, const std::string& source);

/// Parses JSON text — the one path for every JSON the library reads: the nesting is checked
/// first (check_depth), then RapidJSON's iterative (non-recursive) parser runs. Malformed text
/// is a ConfigError naming `source`, line and column. Strings are Unicode text: a surrogate
/// code point (an unpaired \uD800-\uDFFF escape, or its raw bytes) is refused the same way, as
/// serde_json and Python's UTF-8 encoder refuse it; \u0000 is a character like any other and
/// is kept (read strings with `text()`, never as C strings).
rapidjson::Document parse(std::string_view text, const std::string& source);

/// A string value's whole text, NUL characters included.
inline std::string text(const rapidjson::Value& v) {
  return std::string(v.GetString(), v.GetStringLength());
}

/// "an object", "a string", ... for messages.
std::string type_name(const rapidjson::Value& v);

/// Compact JSON of a value, shortened to about `max_chars` for messages.
std::string render(const rapidjson::Value& v, size_t max_chars = 60);

/// Serializes a value (compact, or indented when `pretty`).
std::string dump(const rapidjson::Value& v, bool pretty = false);

/// Reads the members of one JSON object by name with type checks. Every member that is read
/// (or declared `known`) counts as known; `unknown_paths()` lists the rest, so callers can warn
/// about typos. Errors are ConfigError: "<source>: <path>.<key>: expected ..., found ...".
class ObjectReader {
 public:
  /// Throws when `value` is not an object or repeats a key.
  ObjectReader(const rapidjson::Value& value, std::string path, std::string source);

  const std::string& path() const { return path_; }
  const std::string& source() const { return source_; }
  std::string key_path(std::string_view key) const;
  bool has(const char* key) const;
  /// True when the member exists, null included (`has` counts null as absent): for keys whose
  /// null means "none" where absence means the class's default (a sliding window, a soft-cap).
  bool present(const char* key) const;
  /// True when the member exists and is the string "auto".
  bool is_auto(const char* key) const;
  const rapidjson::Value* find(const char* key);

  std::optional<bool> boolean(const char* key);
  /// An integer in [min, max]; integral floats such as 2e8 are accepted.
  std::optional<int64_t> integer(const char* key, int64_t min = INT64_MIN, int64_t max = INT64_MAX);
  std::optional<double> number(const char* key, double min = -1e308, double max = 1e308);
  std::optional<std::string> string(const char* key);
  /// A string that must be there; absent, it fails saying `expected`.
  std::string required_string(const char* key, std::string_view expected = "a string");
  /// A string that must be one of `choices` (compared case-insensitively when `fold_case`);
  /// returns the matching entry of `choices`.
  std::optional<std::string> choice(const char* key, const std::vector<std::string>& choices,
                                    bool fold_case = false);
  /// A nested object, or nullopt when absent (null counts as absent).
  std::optional<ObjectReader> object(const char* key);

  /// Declares keys that are accepted without being read.
  void known(std::initializer_list<const char*> keys);
  std::vector<std::string> unknown_paths() const;
  /// The key read or declared known so far that is nearest to `key`, within two edits; "".
  std::string nearest_known(std::string_view key) const;
  /// Throws ConfigError for the first member that was neither read nor declared known, naming
  /// the nearest known key ("did you mean ...?") and `why` (for objects that, like DeepSpeed's
  /// config sections, forbid extra keys). Call after every key was read.
  void reject_unknown(std::string_view why) const;

  [[noreturn]] void fail(std::string_view key, std::string_view expected) const;
  [[noreturn]] void fail_value(std::string_view key, std::string_view message) const;

 private:
  const rapidjson::Value* value_;
  std::string path_;
  std::string source_;
  std::set<std::string> known_;
};

/// Converts a JSON number to int64 when it is integral and in range.
std::optional<int64_t> as_integer(const rapidjson::Value& v);

}  // namespace zt::json
