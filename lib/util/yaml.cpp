// YAML to JSON values through yaml-cpp, with the limits every file zerotrain reads has.
#include "util/yaml.hpp"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <map>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "util/json.hpp"
#include "zerotrain/error.hpp"

namespace zt::yaml {
namespace {

constexpr std::string_view kCoreTag = "tag:yaml.org,2002:";

bool one_of(const std::string& s, std::initializer_list<const char*> words) {
  for (const char* w : words) {
    if (s == w) return true;
  }
  return false;
}

bool all_digits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

// [-+]?(0|[1-9][0-9]*): a leading zero is refused (PyYAML reads 010 as octal 8).
bool is_integer_text(std::string_view s) {
  if (!s.empty() && (s[0] == '-' || s[0] == '+')) s.remove_prefix(1);
  return all_digits(s) && (s.size() == 1 || s[0] != '0');
}

// OmegaConf's float rule without its underscores and sexagesimals: digits with a point
// (either side may be empty, not both) and an optional exponent, or digits and an exponent.
bool is_float_text(std::string_view s) {
  if (!s.empty() && (s[0] == '-' || s[0] == '+')) s.remove_prefix(1);
  const size_t e = s.find_first_of("eE");
  std::string_view mantissa = s.substr(0, e);
  if (e != std::string_view::npos) {
    std::string_view exponent = s.substr(e + 1);
    if (!exponent.empty() && (exponent[0] == '-' || exponent[0] == '+')) exponent.remove_prefix(1);
    if (!all_digits(exponent)) return false;
  }
  const size_t point = mantissa.find('.');
  if (point == std::string_view::npos) return e != std::string_view::npos && all_digits(mantissa);
  const std::string_view whole = mantissa.substr(0, point), part = mantissa.substr(point + 1);
  return (whole.empty() || all_digits(whole)) && (part.empty() || all_digits(part)) &&
         !(whole.empty() && part.empty());
}

class Converter {
 public:
  Converter(const std::string& source, rapidjson::Document::AllocatorType& alloc)
      : source_(source), alloc_(alloc) {}

  rapidjson::Value convert(const YAML::Node& n, int depth) {
    if (depth > json::kMaxDepth) {
      fail(n.Mark(), fmt::format("YAML nested deeper than {} levels; no options file needs that "
                                 "many — is it the right file?",
                                 json::kMaxDepth));
    }
    if (++values_ > kMaxValues) {
      fail(n.Mark(), fmt::format("the YAML expands to more than {} values once its aliases (*name) "
                                 "are replaced (an alias bomb?); an options file has a few dozen",
                                 kMaxValues));
    }
    const std::string tag = n.Tag();
    switch (n.Type()) {
      case YAML::NodeType::Map:
        check_tag(n, tag, {"map"});
        return mapping(n, depth);
      case YAML::NodeType::Sequence: {
        check_tag(n, tag, {"seq"});
        rapidjson::Value out(rapidjson::kArrayType);
        for (const YAML::Node& item : n) out.PushBack(convert(item, depth + 1), alloc_);
        return out;
      }
      case YAML::NodeType::Scalar:
        return scalar(n, tag);
      case YAML::NodeType::Null:
        if (tag == std::string(kCoreTag) + "str") return rapidjson::Value("", alloc_);
        return rapidjson::Value();
      default:
        fail(n.Mark(), "a YAML node of no known kind");
    }
  }

 private:
  [[noreturn]] void fail(const YAML::Mark& m, const std::string& what) const {
    if (m.line < 0) throw ConfigError(fmt::format("{}: {}", source_, what));
    throw ConfigError(fmt::format("{}:{}:{}: {}", source_, m.line + 1, m.column + 1, what));
  }

  // A tag as written: !!int for the core schema's.
  static std::string shown(const std::string& tag) {
    return tag.compare(0, kCoreTag.size(), kCoreTag) == 0 ? "!!" + tag.substr(kCoreTag.size())
                                                          : tag;
  }

  // A tag on a node: none, or the core schema's own for its kind.
  void check_tag(const YAML::Node& n, const std::string& tag,
                 std::initializer_list<const char*> kinds) const {
    if (tag.empty() || tag == "?" || tag == "!") return;
    for (const char* kind : kinds) {
      if (tag == std::string(kCoreTag) + kind) return;
    }
    fail(n.Mark(), fmt::format("the tag {} is not supported here (only YAML's core schema: "
                               "!!str, !!int, !!float, !!bool, !!null, !!map, !!seq)",
                               shown(tag)));
  }

  rapidjson::Value text(const std::string& s) {
    return rapidjson::Value(s.data(), static_cast<rapidjson::SizeType>(s.size()), alloc_);
  }

  rapidjson::Value scalar(const YAML::Node& n, const std::string& tag) {
    const std::string& s = n.Scalar();
    if (tag == "!") return text(s);  // quoted, or a literal / folded block: text as written
    std::string kind = "resolve";    // a plain scalar: what it looks like decides
    if (tag != "?") {
      check_tag(n, tag, {"str", "null", "bool", "int", "float"});
      kind = tag.substr(kCoreTag.size());
    }
    const bool any = kind == "resolve";
    if (kind == "str") return text(s);
    if ((any || kind == "null") && one_of(s, {"~", "null", "Null", "NULL", ""}))
      return rapidjson::Value();
    if ((any || kind == "bool") &&
        one_of(s, {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"})) {
      return rapidjson::Value(true);
    }
    if ((any || kind == "bool") &&
        one_of(s, {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"})) {
      return rapidjson::Value(false);
    }
    if ((any || kind == "int") && is_integer_text(s)) {
      int64_t v = 0;
      const char* begin = s.data() + (s[0] == '+');
      const auto [end, ec] = std::from_chars(begin, s.data() + s.size(), v);
      if (ec == std::errc() && end == s.data() + s.size()) return rapidjson::Value(v);
      // Past int64: a number all the same, which the option's range then refuses by name.
      return rapidjson::Value(std::strtod(s.c_str(), nullptr));
    }
    if ((any || kind == "float") && (is_float_text(s) || is_integer_text(s))) {
      const double d = std::strtod(s.c_str(), nullptr);
      if (std::isfinite(d)) return rapidjson::Value(d);
    }
    if (any) return text(s);
    fail(n.Mark(), fmt::format("'{}' is not a value of its tag {}", s, shown(tag)));
  }

  rapidjson::Value mapping(const YAML::Node& n, int depth) {
    rapidjson::Value out(rapidjson::kObjectType);
    std::map<std::string, int> lines;  // key -> the line it was first given on
    std::vector<YAML::Node> merged;    // the mappings of `<<: ...`, in the order given
    for (auto it = n.begin(); it != n.end(); ++it) {
      // Copies: the iterator's pair is a temporary (a node is a handle, cheap to copy).
      const YAML::Node key = it->first, value = it->second;
      if (!key.IsScalar()) {
        fail(key.Mark(), key.IsNull() ? "a key is empty (null); every option needs a name"
                                      : "a key is a mapping or a list; option names are text");
      }
      const std::string name = key.Scalar();
      if (name == "<<" && key.Tag() == "?") {  // YAML 1.1's merge key, as PyYAML reads it
        const YAML::Node& from = value;
        if (from.IsMap()) {
          merged.push_back(from);
        } else if (from.IsSequence()) {
          for (const YAML::Node& m : from) {
            if (!m.IsMap()) fail(m.Mark(), "a merge key (<<) takes mappings only");
            merged.push_back(m);
          }
        } else {
          fail(from.Mark(), "a merge key (<<) takes a mapping or a list of mappings");
        }
        continue;
      }
      if (const auto [at, fresh] = lines.emplace(name, key.Mark().line + 1); !fresh) {
        fail(key.Mark(),
             fmt::format("'{}' is given twice (first at line {}); keep one", name, at->second));
      }
      out.AddMember(text(name), convert(value, depth + 1), alloc_);
    }
    // Keys written out win over merged ones, and earlier merged mappings over later ones.
    for (const YAML::Node& m : merged) {
      if (++values_ > kMaxValues) fail(m.Mark(), "the YAML expands to too many values");
      rapidjson::Value more = mapping(m, depth + 1);
      for (auto it = more.MemberBegin(); it != more.MemberEnd(); ++it) {
        if (!out.HasMember(it->name)) out.AddMember(it->name, it->value, alloc_);
      }
    }
    return out;
  }

  const std::string& source_;
  rapidjson::Document::AllocatorType& alloc_;
  int values_ = 0;
};

// Counts the documents of a stream up to two, and where the second starts. yaml-cpp's LoadAll
// loops forever on some malformed input (fuzzing found `&e$,`), so the documents are counted
// with a bounded number of calls and only the first is built (YAML::Load).
class DocumentCounter : public YAML::EventHandler {
 public:
  explicit DocumentCounter(std::istream& in) : parser_(in) {}
  // 0, 1 or 2 (two or more).
  int count() {
    int n = 0;
    while (n < 2 && parser_.HandleNextDocument(*this)) ++n;
    return n;
  }
  YAML::Mark second() const { return second_; }

  void OnDocumentStart(const YAML::Mark& mark) override {
    if (++started_ == 2) second_ = mark;
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}

 private:
  YAML::Parser parser_;
  int started_ = 0;
  YAML::Mark second_ = YAML::Mark::null_mark();
};

}  // namespace

rapidjson::Document parse(std::string_view text, const std::string& source) {
  YAML::Node root;
  int documents = 0;
  YAML::Mark second = YAML::Mark::null_mark();
  try {
    std::istringstream in{std::string(text)};
    DocumentCounter counter(in);
    documents = counter.count();
    second = counter.second();
    if (documents == 1) root = YAML::Load(std::string(text));
  } catch (const YAML::DeepRecursion& e) {
    throw ConfigError(fmt::format(
        "{}:{}:{}: YAML nested deeper than its parser allows; no options file needs that many "
        "levels — is it the right file?",
        source, e.mark.line + 1, e.mark.column + 1));
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}:{}:{}: malformed YAML: {}", source, e.mark.line + 1,
                                  e.mark.column + 1, e.msg));
  }
  rapidjson::Document doc;
  if (documents > 1) {
    throw ConfigError(
        fmt::format("{}:{}: a second YAML document (after '---'); an options file "
                    "is one document",
                    source, second.line + 1));
  }
  if (documents == 0) return doc;  // null
  Converter converter(source, doc.GetAllocator());
  rapidjson::Value value = converter.convert(root, 1);
  static_cast<rapidjson::Value&>(doc).Swap(value);
  return doc;
}

}  // namespace zt::yaml
