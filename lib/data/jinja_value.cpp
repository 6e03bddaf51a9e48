// The Jinja interpreter's values (jinja.hpp's Value) with Python's semantics: construction with
// the nesting limit, truth, member lookup, str() and repr() (Python's quoting, float repr and
// Markup), ==, str.isspace, and a JSON text as a Value. Part of the interpreter split over
// lib/data/jinja*.cpp (jinja_internal.hpp lists the parts).
#include <fmt/format.h>
#include <rapidjson/document.h>
#include <utf8proc.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "data/jinja_internal.hpp"
#include "tokenizer/unicode_text.hpp"
#include "util/json.hpp"
#include "zerotrain/error.hpp"

namespace zt::jinja {

// UTF-8 → code points (bounds-checked: the text may be ill-formed), for Python's str indexing,
// slicing and len; back with text::append_utf8.
std::vector<uint32_t> code_points(std::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + static_cast<size_t>(n) > s.size()) n = 1;
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1f) : n == 3 ? (c & 0x0f) : (c & 0x07);
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
    out.push_back(cp);
    i += static_cast<size_t>(n);
  }
  return out;
}

std::string from_code_points(const std::vector<uint32_t>& cps) {
  std::string out;
  for (uint32_t c : cps) text::append_utf8(c, out);
  return out;
}

// Python's repr of a float: the shortest text that reads back, with ".0" on integral values.
std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  std::string s = fmt::format("{}", d);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

namespace {

// Python's str.isprintable() for one code point: not a control, format, surrogate,
// private-use or unassigned character, and no separator but the ASCII space.
bool is_printable(uint32_t c) {
  if (c < 0x80) return c >= 0x20 && c < 0x7f;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS:
      return false;
    default:
      return true;
  }
}

std::string quote(const std::string& s) {
  // Python's repr: single quotes unless the text has one and no double quote; \n \r \t, and
  // every other character that is not printable as \xNN, \uNNNN or \UNNNNNNNN.
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (uint32_t c : code_points(s)) {
    if (c == static_cast<uint32_t>(q) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else if (!is_printable(c)) {
      out += c < 0x100     ? fmt::format("\\x{:02x}", c)
             : c < 0x10000 ? fmt::format("\\u{:04x}", c)
                           : fmt::format("\\U{:08x}", c);
    } else {
      text::append_utf8(c, out);
    }
  }
  out += q;
  return out;
}

}  // namespace

Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}
Value::Value(bool b) : kind_(Kind::kBool), b_(b), i_(b ? 1 : 0) {}
Value::Value(int64_t i) : kind_(Kind::kInt), i_(i) {}
Value::Value(double d) : kind_(Kind::kFloat), d_(d) {}
Value::Value(std::string s) : kind_(Kind::kString), s_(std::move(s)) {}

Value Value::markup(std::string s) {
  Value v(std::move(s));
  v.markup_ = true;
  return v;
}

Value Value::tuple(List l) {
  Value v(std::move(l));
  v.tuple_ = true;
  return v;
}

namespace {

constexpr int kMaxNesting = 256;

int nesting_of(int below) {
  if (below + 1 > kMaxNesting) {
    throw ConfigError(fmt::format("a value nested more than {} lists or dicts deep", kMaxNesting));
  }
  return below + 1;
}

}  // namespace

Value::Value(List l) : kind_(Kind::kList) {
  int below = 0;
  for (const Value& v : l) below = std::max(below, v.nesting_);
  nesting_ = nesting_of(below);
  list_ = std::make_shared<List>(std::move(l));
}

Value::Value(Dict d) : kind_(Kind::kDict) {
  int below = 0;
  for (const auto& kv : d) {
    if ((kv.first.is_list() && !kv.first.is_tuple()) || kv.first.is_dict())
      throw ConfigError(
          fmt::format("unhashable type: '{}' as a dict key", kv.first.is_list() ? "list" : "dict"));
    below = std::max(below, kv.second.nesting_);
  }
  nesting_ = nesting_of(below);
  dict_ = std::make_shared<Dict>(std::move(d));
}

Value Value::function(Function f) {
  Value v;
  v.kind_ = Kind::kFunction;
  v.fn_ = std::make_shared<Function>(std::move(f));
  return v;
}

Value Value::make_namespace(Dict attributes) {
  Value v(std::move(attributes));
  v.kind_ = Kind::kNamespace;
  return v;
}

Value Value::undefined(std::string name) {
  Value v;
  v.s_ = std::move(name);
  return v;
}

int64_t Value::integer() const {
  if (kind_ != Kind::kFloat) return i_;
  // Python's int() of a float, saturated where int64 ends (and 0 for NaN) instead of undefined.
  if (std::isnan(d_)) return 0;
  if (d_ >= 9.2233720368547758e18) return std::numeric_limits<int64_t>::max();
  if (d_ <= -9.2233720368547758e18) return std::numeric_limits<int64_t>::min();
  return static_cast<int64_t>(d_);
}

namespace {

// Lists and dicts nested deeper than this (a namespace holding itself, a list built into
// itself in a loop) are refused where a value is printed, compared or dumped, before the
// recursion does that to the stack.
constexpr int kMaxValueNesting = 256;
thread_local int value_nesting = 0;

}  // namespace

Nested::Nested() {
  if (++value_nesting > kMaxValueNesting) {
    --value_nesting;
    throw ConfigError(
        fmt::format("a value nested more than {} lists or dicts deep", kMaxValueNesting));
  }
}
Nested::~Nested() {
  --value_nesting;
}

double Value::number() const {
  return kind_ == Kind::kFloat ? d_ : static_cast<double>(i_);
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return b_;
    case Kind::kInt:
      return i_ != 0;
    case Kind::kFloat:
      return d_ != 0;
    case Kind::kString:
      return !s_.empty();
    case Kind::kList:
      return !list_->empty();
    case Kind::kDict:
      return !dict_->empty();
    case Kind::kNamespace:
    case Kind::kFunction:
      return true;
  }
  return false;
}

Value Value::get(const std::string& key) const {
  if (is_dict()) {
    for (const auto& [k, v] : *dict_) {
      if (k.is_string() && k.string() == key) return v;
    }
  }
  return undefined(key);
}

Value Value::item(const Value& key) const {
  if (is_dict()) {
    for (const auto& [k, v] : *dict_) {
      if (equal(k, key)) return v;
    }
  }
  return undefined(key.str());
}

std::string Value::str() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "";
    case Kind::kString:
      return s_;
    default:
      return repr();
  }
}

std::string Value::repr() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return b_ ? "True" : "False";
    case Kind::kInt:
      return std::to_string(i_);
    case Kind::kFloat:
      return float_repr(d_);
    case Kind::kString:
      return markup_ ? "Markup(" + quote(s_) + ")" : quote(s_);
    case Kind::kList: {
      const Nested nested;
      std::string out = tuple_ ? "(" : "[";
      for (size_t i = 0; i < list_->size(); ++i) out += (i ? ", " : "") + (*list_)[i].repr();
      if (tuple_) return out + (list_->size() == 1 ? ",)" : ")");
      return out + "]";
    }
    case Kind::kDict: {
      const Nested nested;
      std::string out = "{";
      for (size_t i = 0; i < dict_->size(); ++i)
        out += (i ? ", " : "") + (*dict_)[i].first.repr() + ": " + (*dict_)[i].second.repr();
      return out + "}";
    }
    case Kind::kNamespace:
      return "<Namespace>";
    case Kind::kFunction:
      return "<function>";
  }
  return "";
}

bool is_python_space(uint32_t c) {
  return c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f) || c == 0x85 ||
         c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

bool equal(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind() == K::kFloat || b.kind() == K::kFloat) return a.number() == b.number();
    return a.integer() == b.integer();
  }
  if (a.kind() != b.kind()) {
    const bool dicts = (a.kind() == K::kDict || a.kind() == K::kNamespace) &&
                       (b.kind() == K::kDict || b.kind() == K::kNamespace);
    if (!dicts) return false;
  }
  switch (a.kind()) {
    case K::kUndefined:
    case K::kNone:
      return true;
    case K::kString:
      return a.string() == b.string();
    case K::kList: {
      const Nested nested;
      if (a.is_tuple() != b.is_tuple() || a.list().size() != b.list().size()) return false;
      for (size_t i = 0; i < a.list().size(); ++i)
        if (!equal(a.list()[i], b.list()[i])) return false;
      return true;
    }
    case K::kDict:
    case K::kNamespace: {
      const Nested nested;
      if (a.dict().size() != b.dict().size()) return false;
      for (const auto& [k, v] : a.dict()) {
        const auto in_b = std::find_if(b.dict().begin(), b.dict().end(),
                                       [&k = k](const auto& kv) { return equal(kv.first, k); });
        if (in_b == b.dict().end() || !equal(v, in_b->second)) return false;
      }
      return true;
    }
    case K::kFunction:
      return &a.fn() == &b.fn();
    default:
      return false;
  }
}

namespace {

Value json_value(const rapidjson::Value& v) {
  if (v.IsNull()) return Value::none();
  if (v.IsBool()) return Value(v.GetBool());
  if (v.IsInt64()) return Value(static_cast<int64_t>(v.GetInt64()));
  if (v.IsNumber()) return Value(v.GetDouble());
  if (v.IsString()) return Value(std::string(v.GetString(), v.GetStringLength()));
  if (v.IsArray()) {
    List l;
    for (const auto& x : v.GetArray()) l.push_back(json_value(x));
    return Value(std::move(l));
  }
  Dict d;
  for (const auto& m : v.GetObject())
    d.emplace_back(Value(std::string(m.name.GetString(), m.name.GetStringLength())),
                   json_value(m.value));
  return Value(std::move(d));
}

}  // namespace

Value from_json(std::string_view text, const std::string& source) {
  rapidjson::Document doc = json::parse(text, source);
  return json_value(doc);
}

}  // namespace zt::jinja
