// See jinja.hpp. Three parts: the scanner (template text → text and tag tokens, with jinja2's
// whitespace rules), the parser (tokens → a tree of statements and expressions) and the
// evaluator (the tree + a context → text), with Python's value semantics and the filters,
// tests and methods chat templates call.
#include "data/jinja.hpp"

#include <fmt/format.h>
#include <rapidjson/document.h>
#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <limits>
#include <optional>
#include <unordered_map>

#include "tokenizer/unicode_text.hpp"
#include "util/json.hpp"
#include "zerotrain/error.hpp"

namespace zt::jinja {

// ---- values -------------------------------------------------------------------------------

namespace {

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
struct Nested {
  Nested() {
    if (++value_nesting > kMaxValueNesting) {
      --value_nesting;
      throw ConfigError(
          fmt::format("a value nested more than {} lists or dicts deep", kMaxValueNesting));
    }
  }
  ~Nested() { --value_nesting; }
  Nested(const Nested&) = delete;
  Nested& operator=(const Nested&) = delete;
};

}  // namespace

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

// ---- scanner ------------------------------------------------------------------------------

namespace {

enum class Tok {
  kText,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEnd
};

struct Token {
  Tok type;
  std::string text;  // the text, name, string's value, number's digits or operator
  int line = 1;
};

[[noreturn]] void fail(const std::string& source, int line, const std::string& what) {
  throw ConfigError(fmt::format("{}: chat template, line {}: {}", source, line, what));
}

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

class Scanner {
 public:
  Scanner(std::string_view text, std::string source) : t_(text), source_(std::move(source)) {}

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;  // the text ahead starts a line (jinja2's lstrip_blocks rule)
    bool strip_next = false;    // the previous tag ended with "-"
    while (pos <= t_.size()) {
      const size_t open = find_open(pos);
      std::string text(t_.substr(pos, (open == std::string_view::npos ? t_.size() : open) - pos));
      if (strip_next) {
        size_t k = 0;
        while (k < text.size() && is_space(text[k])) ++k;
        text.erase(0, k);
      }
      if (open == std::string_view::npos) {
        emit_text(text, line_at(pos));
        break;
      }
      const char kind = t_[open + 1];  // '{', '%' or '#'
      const char mod = open + 2 < t_.size() ? t_[open + 2] : '\0';
      if (mod == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (mod != '+' && kind != '{') {
        // lstrip_blocks: spaces and tabs between a line's start and a block or comment tag.
        const size_t nl = text.rfind('\n');
        const size_t from = nl == std::string::npos ? 0 : nl + 1;
        if (nl != std::string::npos || line_starting) {
          bool blank = true;
          for (size_t k = from; k < text.size(); ++k)
            blank = blank && (text[k] == ' ' || text[k] == '\t');
          if (blank) text.erase(from);
        }
      }
      emit_text(text, line_at(pos));
      const size_t body = open + 2 + ((mod == '-' || mod == '+') ? 1 : 0);
      size_t end = 0;
      bool strip_after = false, keep_newline = false;
      if (kind == '#') {
        const size_t close = t_.find("#}", body);
        if (close == std::string_view::npos)
          fail(source_, line_at(open), "a comment is not closed");
        strip_after = close > body && t_[close - 1] == '-';
        end = close + 2;
      } else {
        const char closer = kind == '{' ? '}' : '%';
        const size_t close = find_close(body, closer, open);
        size_t inner_end = close;
        if (inner_end > body && (t_[inner_end - 1] == '-' || t_[inner_end - 1] == '+')) {
          strip_after = t_[inner_end - 1] == '-';
          keep_newline = t_[inner_end - 1] == '+';
          --inner_end;
        }
        tokens_.push_back({kind == '{' ? Tok::kVarBegin : Tok::kBlockBegin, "", line_at(open)});
        tokenize(body, inner_end);
        tokens_.push_back({kind == '{' ? Tok::kVarEnd : Tok::kBlockEnd, "", line_at(close)});
        end = close + 2;
      }
      line_starting = false;
      // trim_blocks: one newline after a block or comment tag goes.
      if (kind != '{' && !strip_after && !keep_newline && end < t_.size() && t_[end] == '\n') {
        ++end;
        line_starting = true;
      }
      strip_next = strip_after;
      pos = end;
    }
    tokens_.push_back({Tok::kEnd, "", line_at(t_.size())});
    return std::move(tokens_);
  }

 private:
  size_t find_open(size_t from) const {  // NOLINT(readability-convert-member-functions-to-static)
    for (size_t p = t_.find('{', from); p != std::string_view::npos; p = t_.find('{', p + 1)) {
      if (p + 1 < t_.size() && (t_[p + 1] == '{' || t_[p + 1] == '%' || t_[p + 1] == '#')) return p;
    }
    return std::string_view::npos;
  }

  // The closing "}}" or "%}" of a tag whose expression starts at `from`, skipping strings.
  size_t find_close(size_t from, char closer, size_t open) {
    char quote = 0;
    for (size_t p = from; p + 1 < t_.size(); ++p) {
      const char c = t_[p];
      if (quote) {
        if (c == '\\') {
          ++p;
        } else if (c == quote) {
          quote = 0;
        }
      } else if (c == '\'' || c == '"') {
        quote = c;
      } else if (c == closer && t_[p + 1] == '}') {
        return p;
      }
    }
    fail(source_, line_at(open), closer == '}' ? "'{{' is not closed" : "'{%' is not closed");
  }

  int line_at(size_t pos) {
    while (counted_ < pos && counted_ < t_.size()) {
      if (t_[counted_] == '\n') ++line_;
      ++counted_;
    }
    return line_;
  }

  void emit_text(const std::string& text, int line) {
    if (!text.empty()) tokens_.push_back({Tok::kText, text, line});
  }

  void tokenize(size_t from, size_t to) {
    size_t p = from;
    while (p < to) {
      const char c = t_[p];
      const int line = line_at(p);
      if (is_space(c)) {
        ++p;
      } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t q = p;
        while (q < to && (std::isalnum(static_cast<unsigned char>(t_[q])) || t_[q] == '_')) ++q;
        tokens_.push_back({Tok::kName, std::string(t_.substr(p, q - p)), line});
        p = q;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t q = p;
        bool is_float = false;
        while (q < to && (std::isdigit(static_cast<unsigned char>(t_[q])) || t_[q] == '_')) ++q;
        if (q + 1 < to && t_[q] == '.' && std::isdigit(static_cast<unsigned char>(t_[q + 1]))) {
          is_float = true;
          ++q;
          while (q < to && std::isdigit(static_cast<unsigned char>(t_[q]))) ++q;
        }
        if (q < to && (t_[q] == 'e' || t_[q] == 'E')) {
          size_t r = q + 1;
          if (r < to && (t_[r] == '+' || t_[r] == '-')) ++r;
          if (r < to && std::isdigit(static_cast<unsigned char>(t_[r]))) {
            is_float = true;
            q = r;
            while (q < to && std::isdigit(static_cast<unsigned char>(t_[q]))) ++q;
          }
        }
        std::string digits;
        for (size_t k = p; k < q; ++k)
          if (t_[k] != '_') digits += t_[k];
        tokens_.push_back({is_float ? Tok::kFloat : Tok::kInt, digits, line});
        p = q;
      } else if (c == '\'' || c == '"') {
        tokens_.push_back({Tok::kString, read_string(p, to), line});
      } else {
        static const char* const kOps[] = {"==", "!=", "<=", ">=", "//", "**", "<", ">", "+",
                                           "-",  "*",  "/",  "%",  "~",  "|",  ".", ",", ":",
                                           "(",  ")",  "[",  "]",  "{",  "}",  "="};
        bool matched = false;
        for (const char* op : kOps) {
          const std::string_view o(op);
          if (t_.substr(p, o.size()) == o && p + o.size() <= to) {
            tokens_.push_back({Tok::kOp, std::string(o), line});
            p += o.size();
            matched = true;
            break;
          }
        }
        if (!matched) fail(source_, line, fmt::format("unexpected character '{}'", c));
      }
    }
  }

  // A quoted literal from `p` (moved past it), with Python's escapes.
  std::string read_string(size_t& p, size_t to) {
    const char q = t_[p++];
    std::string out;
    while (p < to && t_[p] != q) {
      char c = t_[p++];
      if (c != '\\' || p >= to) {
        out += c;
        continue;
      }
      c = t_[p++];
      switch (c) {
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case '0':
          out += '\0';
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case '\n':
          break;  // a continued line
        case 'u':
        case 'U':
        case 'x': {
          const size_t n = c == 'x' ? 2 : c == 'u' ? 4 : 8;
          if (p + n > to) fail(source_, line_at(p), "a \\x / \\u escape is cut short");
          uint32_t cp = 0;
          for (size_t k = 0; k < n; ++k) {
            const char h = t_[p + k];
            const int digit = std::isdigit(static_cast<unsigned char>(h)) ? h - '0'
                              : (h >= 'a' && h <= 'f')                    ? h - 'a' + 10
                              : (h >= 'A' && h <= 'F')                    ? h - 'A' + 10
                                                                          : -1;
            if (digit < 0) fail(source_, line_at(p), "a \\x / \\u escape with a non-hex digit");
            cp = cp * 16 + static_cast<uint32_t>(digit);
          }
          if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) cp = 0xFFFD;
          text::append_utf8(cp, out);
          p += n;
          break;
        }
        default:
          out += '\\';
          out += c;
      }
    }
    if (p >= to) fail(source_, line_at(p), "a string is not closed");
    ++p;
    return out;
  }

  std::string_view t_;
  std::string source_;
  std::vector<Token> tokens_;
  size_t counted_ = 0;
  int line_ = 1;
};

}  // namespace

// ---- tree ---------------------------------------------------------------------------------

struct Expr {
  enum class Kind {
    kLiteral,
    kName,
    kAttr,
    kItem,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNot,
    kNeg,
    kPos,
    kBinary,
    kAnd,
    kOr,
    kCompare,
    kCond,
    kList,
    kTuple,
    kDict
  };
  Kind kind;
  int line = 1;
  Value value;                              // literal
  std::string name;                         // name, attribute, filter, test, operator
  std::vector<std::shared_ptr<Expr>> args;  // operands, arguments, elements
  std::vector<std::pair<std::string, std::shared_ptr<Expr>>> kwargs;
  std::vector<std::string> ops;  // comparison chain operators
  bool negated = false;          // `is not`
  int depth = 1;                 // of the tree below (evaluation recurses that deep)
};
using ExprPtr = std::shared_ptr<Expr>;

struct Node {
  enum class Kind {
    kBody,
    kText,
    kOutput,
    kIf,
    kFor,
    kSet,
    kSetBlock,
    kMacro,
    kFilterBlock,
    kBreak,
    kContinue,
    kGeneration
  };
  Kind kind = Kind::kBody;
  int line = 1;
  std::string text;                  // text; set / macro name
  ExprPtr expr;                      // output, set value, for iterable, filter call
  ExprPtr target;                    // set target (a name, ns.attr, or a tuple)
  std::vector<std::string> targets;  // for-loop names
  ExprPtr condition;                 // for's `if`
  std::vector<std::pair<ExprPtr, std::shared_ptr<Node>>> branches;  // if / elif (null: else)
  std::vector<std::shared_ptr<Node>> children;                      // body
  std::shared_ptr<Node> otherwise;                                  // for's else
  std::vector<std::pair<std::string, ExprPtr>> params;              // macro (null: required)
};
using NodePtr = std::shared_ptr<Node>;

namespace {

ExprPtr make_expr(Expr::Kind k, int line) {
  auto e = std::make_shared<Expr>();
  e->kind = k;
  e->line = line;
  return e;
}

class Parser {
 public:
  Parser(std::vector<Token> tokens, std::string source)
      : t_(std::move(tokens)), source_(std::move(source)) {}

  NodePtr parse() {
    auto root = std::make_shared<Node>();
    std::string end = parse_body(*root, {});
    if (!end.empty()) fail(source_, peek().line, fmt::format("unexpected '{}'", end));
    return root;
  }

 private:
  const Token& peek(size_t k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Token& next() { return t_[std::min(i_++, t_.size() - 1)]; }
  bool at_op(const char* op, size_t k = 0) const {
    return peek(k).type == Tok::kOp && peek(k).text == op;
  }
  bool at_name(const char* name, size_t k = 0) const {
    return peek(k).type == Tok::kName && peek(k).text == name;
  }
  void expect_op(const char* op) {
    if (!at_op(op))
      fail(source_, peek().line, fmt::format("expected '{}', found '{}'", op, describe(peek())));
    ++i_;
  }
  void expect(Tok type, const char* what) {
    if (peek().type != type)
      fail(source_, peek().line, fmt::format("expected {}, found '{}'", what, describe(peek())));
    ++i_;
  }
  std::string name() {
    if (peek().type != Tok::kName)
      fail(source_, peek().line, fmt::format("expected a name, found '{}'", describe(peek())));
    return next().text;
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::kVarEnd:
        return "}}";
      case Tok::kBlockEnd:
        return "%}";
      case Tok::kEnd:
        return "the end of the template";
      default:
        return t.text;
    }
  }

  // Statements up to one of `ends` (a block tag's first word); returns it ("" at the end).
  std::string parse_body(Node& into, std::initializer_list<const char*> ends) {
    into.kind = Node::Kind::kBody;
    for (;;) {
      const Token& tok = peek();
      if (tok.type == Tok::kEnd) return "";
      if (tok.type == Tok::kText) {
        auto n = std::make_shared<Node>();
        n->kind = Node::Kind::kText;
        n->text = tok.text;
        n->line = tok.line;
        into.children.push_back(n);
        ++i_;
      } else if (tok.type == Tok::kVarBegin) {
        ++i_;
        auto n = std::make_shared<Node>();
        n->kind = Node::Kind::kOutput;
        n->line = tok.line;
        n->expr = expression();
        expect(Tok::kVarEnd, "'}}'");
        into.children.push_back(n);
      } else if (tok.type == Tok::kBlockBegin) {
        const Token& word = peek(1);
        if (word.type != Tok::kName) fail(source_, word.line, "a block tag needs a statement");
        for (const char* end : ends) {
          if (word.text == end) {
            i_ += 2;
            return word.text;
          }
        }
        i_ += 2;
        into.children.push_back(statement(word));
      } else {
        fail(source_, tok.line, fmt::format("unexpected '{}'", describe(tok)));
      }
    }
  }

  void end_tag() { expect(Tok::kBlockEnd, "'%}'"); }

  NodePtr statement(const Token& word) {
    const Deeper deeper(*this, word.line);
    auto n = std::make_shared<Node>();
    n->line = word.line;
    const std::string& w = word.text;
    if (w == "if") {
      n->kind = Node::Kind::kIf;
      ExprPtr cond = expression();
      end_tag();
      for (;;) {
        auto body = std::make_shared<Node>();
        const std::string end = parse_body(*body, {"elif", "else", "endif"});
        if (end.empty()) fail(source_, word.line, "'if' is not closed with 'endif'");
        n->branches.emplace_back(cond, body);
        if (end == "endif") {
          end_tag();
          break;
        }
        if (end == "elif") {
          cond = expression();
        } else {
          cond = nullptr;
        }
        end_tag();
        if (!cond) {
          auto last = std::make_shared<Node>();
          if (parse_body(*last, {"endif"}).empty())
            fail(source_, word.line, "'if' is not closed with 'endif'");
          end_tag();
          n->branches.emplace_back(nullptr, last);
          break;
        }
      }
    } else if (w == "for") {
      n->kind = Node::Kind::kFor;
      n->targets.push_back(name());
      while (at_op(",")) {
        ++i_;
        n->targets.push_back(name());
      }
      if (!at_name("in")) fail(source_, peek().line, "expected 'in' in the for loop");
      ++i_;
      n->expr = expression(/*with_condition=*/false);
      if (at_name("if")) {
        ++i_;
        n->condition = expression(false);
      }
      if (at_name("recursive")) fail(source_, peek().line, "recursive loops are not supported");
      end_tag();
      auto body = std::make_shared<Node>();
      const std::string end = parse_body(*body, {"else", "endfor"});
      if (end.empty()) fail(source_, word.line, "'for' is not closed with 'endfor'");
      n->children.push_back(body);
      end_tag();
      if (end == "else") {
        n->otherwise = std::make_shared<Node>();
        if (parse_body(*n->otherwise, {"endfor"}).empty())
          fail(source_, word.line, "'for' is not closed with 'endfor'");
        end_tag();
      }
    } else if (w == "set") {
      ExprPtr target = set_target();
      if (at_op("=")) {
        ++i_;
        n->kind = Node::Kind::kSet;
        n->target = target;
        n->expr = tuple_or_expression();
        end_tag();
      } else {
        n->kind = Node::Kind::kSetBlock;
        n->target = target;
        if (at_op("|")) n->expr = filter_chain(nullptr);
        end_tag();
        auto body = std::make_shared<Node>();
        if (parse_body(*body, {"endset"}).empty())
          fail(source_, word.line, "'set' is not closed with 'endset'");
        end_tag();
        n->children.push_back(body);
      }
    } else if (w == "macro") {
      n->kind = Node::Kind::kMacro;
      n->text = name();
      expect_op("(");
      while (!at_op(")")) {
        std::string p = name();
        ExprPtr def;
        if (at_op("=")) {
          ++i_;
          def = expression();
        }
        n->params.emplace_back(p, def);
        if (!at_op(")")) expect_op(",");
      }
      expect_op(")");
      end_tag();
      auto body = std::make_shared<Node>();
      if (parse_body(*body, {"endmacro"}).empty())
        fail(source_, word.line, "'macro' is not closed with 'endmacro'");
      end_tag();
      n->children.push_back(body);
    } else if (w == "filter") {
      n->kind = Node::Kind::kFilterBlock;
      n->expr = filter_chain(nullptr, /*first_without_pipe=*/true);
      end_tag();
      auto body = std::make_shared<Node>();
      if (parse_body(*body, {"endfilter"}).empty())
        fail(source_, word.line, "'filter' is not closed with 'endfilter'");
      end_tag();
      n->children.push_back(body);
    } else if (w == "generation") {
      n->kind = Node::Kind::kGeneration;
      end_tag();
      auto body = std::make_shared<Node>();
      if (parse_body(*body, {"endgeneration"}).empty())
        fail(source_, word.line, "'generation' is not closed");
      end_tag();
      n->children.push_back(body);
    } else if (w == "break" || w == "continue") {
      n->kind = w == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      end_tag();
    } else {
      fail(source_, word.line,
           fmt::format("the statement '{}' is not supported (zerotrain renders "
                       "if, for, set, macro, filter and generation blocks)",
                       w));
    }
    return n;
  }

  ExprPtr set_target() {
    const int line = peek().line;
    auto first = make_expr(Expr::Kind::kName, line);
    first->name = name();
    if (at_op(".")) {
      ++i_;
      auto attr = make_expr(Expr::Kind::kAttr, line);
      attr->args.push_back(first);
      attr->name = name();
      return attr;
    }
    if (!at_op(",")) return first;
    auto tuple = make_expr(Expr::Kind::kTuple, line);
    tuple->args.push_back(first);
    while (at_op(",")) {
      ++i_;
      auto e = make_expr(Expr::Kind::kName, line);
      e->name = name();
      tuple->args.push_back(e);
    }
    return tuple;
  }

  // `a, b` without parentheses (set's right side).
  ExprPtr tuple_or_expression() {
    ExprPtr first = expression();
    if (!at_op(",")) return first;
    auto tuple = make_expr(Expr::Kind::kTuple, first->line);
    tuple->args.push_back(first);
    while (at_op(",")) {
      ++i_;
      tuple->args.push_back(expression());
    }
    return tuple;
  }

  ExprPtr expression(bool with_condition = true) {
    const Deeper deeper(*this, peek().line);
    ExprPtr e = or_expr();
    if (with_condition && at_name("if")) {
      ++i_;
      auto c = make_expr(Expr::Kind::kCond, e->line);
      c->args.push_back(or_expr());  // condition
      c->args.push_back(e);          // then
      if (at_name("else")) {
        ++i_;
        c->args.push_back(expression());
      }
      return tree(c);
    }
    return e;
  }

  ExprPtr or_expr() {
    ExprPtr e = and_expr();
    while (at_name("or")) {
      ++i_;
      auto o = make_expr(Expr::Kind::kOr, e->line);
      o->args = {e, and_expr()};
      e = tree(o);
    }
    return e;
  }

  ExprPtr and_expr() {
    ExprPtr e = not_expr();
    while (at_name("and")) {
      ++i_;
      auto a = make_expr(Expr::Kind::kAnd, e->line);
      a->args = {e, not_expr()};
      e = tree(a);
    }
    return e;
  }

  ExprPtr not_expr() {
    const Deeper deeper(*this, peek().line);
    if (at_name("not")) {
      const int line = next().line;
      auto n = make_expr(Expr::Kind::kNot, line);
      n->args.push_back(not_expr());
      return tree(n);
    }
    return compare();
  }

  ExprPtr compare() {
    ExprPtr e = math1();
    ExprPtr chain;
    for (;;) {
      std::string op;
      if (peek().type == Tok::kOp &&
          (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
           peek().text == "<=" || peek().text == ">" || peek().text == ">=")) {
        op = next().text;
      } else if (at_name("in")) {
        ++i_;
        op = "in";
      } else if (at_name("not") && at_name("in", 1)) {
        i_ += 2;
        op = "not in";
      } else {
        break;
      }
      if (!chain) {
        chain = make_expr(Expr::Kind::kCompare, e->line);
        chain->args.push_back(e);
      }
      chain->ops.push_back(op);
      chain->args.push_back(math1());
    }
    return chain ? tree(chain) : e;
  }

  ExprPtr binary(ExprPtr left, const std::string& op, ExprPtr right) {
    auto b = make_expr(Expr::Kind::kBinary, left->line);
    b->name = op;
    b->args = {std::move(left), std::move(right)};
    return tree(b);
  }

  // A node whose operands are built: its depth, refused past kMaxDepth — chains such as
  // `a + a + ...` or `x|f|f|...` grow a tree that evaluation would recurse down.
  ExprPtr tree(ExprPtr e) const {
    int below = 0;
    for (const ExprPtr& a : e->args)
      if (a) below = std::max(below, a->depth);
    for (const auto& kv : e->kwargs)
      if (kv.second) below = std::max(below, kv.second->depth);
    e->depth = below + 1;
    if (e->depth > kMaxDepth)
      fail(source_, e->line,
           fmt::format("an expression nested more than {} levels deep", kMaxDepth));
    return e;
  }

  ExprPtr math1() {
    ExprPtr e = concat();
    while (at_op("+") || at_op("-")) {
      const std::string op = next().text;
      e = binary(e, op, concat());
    }
    return e;
  }

  ExprPtr concat() {
    ExprPtr e = math2();
    while (at_op("~")) {
      ++i_;
      e = binary(e, "~", math2());
    }
    return e;
  }

  ExprPtr math2() {
    ExprPtr e = power();
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      const std::string op = next().text;
      e = binary(e, op, power());
    }
    return e;
  }

  ExprPtr power() {
    ExprPtr e = unary(true);
    while (at_op("**")) {
      ++i_;
      e = binary(e, "**", unary(true));
    }
    return e;
  }

  // Nesting beyond this (brackets, unary signs, blocks) is refused before the stack runs out.
  static constexpr int kMaxDepth = 200;
  struct Deeper {
    Parser& p;
    explicit Deeper(Parser& parser, int line) : p(parser) {
      if (++p.depth_ > kMaxDepth)
        fail(p.source_, line, fmt::format("nested more than {} levels deep", kMaxDepth));
    }
    ~Deeper() { --p.depth_; }
  };

  ExprPtr unary(bool with_filter) {
    const Deeper deeper(*this, peek().line);
    ExprPtr e;
    if (at_op("-") || at_op("+")) {
      const Token& t = next();
      e = make_expr(t.text == "-" ? Expr::Kind::kNeg : Expr::Kind::kPos, t.line);
      e->args.push_back(unary(false));
      e = tree(e);
    } else {
      e = primary();
    }
    e = postfix(e);
    if (with_filter) e = filter_chain(e);
    return e;
  }

  ExprPtr primary() {
    const Token& t = next();
    switch (t.type) {
      case Tok::kName: {
        if (t.text == "true" || t.text == "True") return literal(Value(true), t.line);
        if (t.text == "false" || t.text == "False") return literal(Value(false), t.line);
        if (t.text == "none" || t.text == "None") return literal(Value::none(), t.line);
        auto e = make_expr(Expr::Kind::kName, t.line);
        e->name = t.text;
        return e;
      }
      case Tok::kString: {
        std::string s = t.text;
        while (peek().type == Tok::kString) s += next().text;  // adjacent literals join
        return literal(Value(s), t.line);
      }
      case Tok::kInt:
        return literal(Value(integer_literal(t)), t.line);
      case Tok::kFloat:
        return literal(Value(float_literal(t)), t.line);
      case Tok::kOp:
        if (t.text == "(") {
          if (at_op(")")) {
            ++i_;
            return make_expr(Expr::Kind::kTuple, t.line);
          }
          ExprPtr e = expression();
          if (at_op(",")) {
            auto tuple = make_expr(Expr::Kind::kTuple, t.line);
            tuple->args.push_back(e);
            while (at_op(",")) {
              ++i_;
              if (at_op(")")) break;
              tuple->args.push_back(expression());
            }
            e = tree(tuple);
          }
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          auto list = make_expr(Expr::Kind::kList, t.line);
          while (!at_op("]")) {
            list->args.push_back(expression());
            if (!at_op("]")) expect_op(",");
          }
          ++i_;
          return tree(list);
        }
        if (t.text == "{") {
          auto dict = make_expr(Expr::Kind::kDict, t.line);
          while (!at_op("}")) {
            dict->args.push_back(expression());
            expect_op(":");
            dict->args.push_back(expression());
            if (!at_op("}")) expect_op(",");
          }
          ++i_;
          return tree(dict);
        }
        break;
      default:
        break;
    }
    fail(source_, t.line, fmt::format("unexpected '{}' in an expression", describe(t)));
  }

  int64_t integer_literal(const Token& t) const {
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(t.text.data(), t.text.data() + t.text.size(), v);
    if (ec != std::errc() || end != t.text.data() + t.text.size())
      fail(source_, t.line, fmt::format("the integer {} does not fit 64 bits", t.text));
    return v;
  }

  double float_literal(const Token& t) const {
    char* end = nullptr;
    const double v = std::strtod(t.text.c_str(), &end);
    if (end != t.text.c_str() + t.text.size()) fail(source_, t.line, "a malformed number");
    return v;
  }

  ExprPtr literal(Value v, int line) {
    auto e = make_expr(Expr::Kind::kLiteral, line);
    e->value = std::move(v);
    return e;
  }

  void call_arguments(Expr& call) {
    expect_op("(");
    while (!at_op(")")) {
      if (peek().type == Tok::kName && at_op("=", 1)) {
        std::string key = next().text;
        ++i_;
        call.kwargs.emplace_back(key, expression());
      } else {
        call.args.push_back(expression());
      }
      if (!at_op(")")) expect_op(",");
    }
    ++i_;
  }

  ExprPtr postfix(ExprPtr e) {
    for (;;) {
      if (at_op(".")) {
        ++i_;
        auto a = make_expr(Expr::Kind::kAttr, e->line);
        a->args.push_back(e);
        if (peek().type == Tok::kInt) {  // x.0: an item
          a->kind = Expr::Kind::kItem;
          a->args.push_back(literal(Value(integer_literal(next())), e->line));
        } else {
          a->name = name();
        }
        e = tree(a);
      } else if (at_op("[")) {
        ++i_;
        ExprPtr parts[3];
        int colons = 0;
        while (!at_op("]")) {
          if (at_op(":")) {
            ++i_;
            if (++colons > 2) fail(source_, peek().line, "a slice has at most two ':'");
            continue;
          }
          parts[colons] = expression();
        }
        ++i_;
        if (colons == 0) {
          auto item = make_expr(Expr::Kind::kItem, e->line);
          item->args = {e, parts[0]};
          e = tree(item);
        } else {
          auto slice = make_expr(Expr::Kind::kSlice, e->line);
          slice->args = {e, parts[0], parts[1], parts[2]};
          e = tree(slice);
        }
      } else if (at_op("(")) {
        auto call = make_expr(Expr::Kind::kCall, e->line);
        call->args.push_back(e);
        call_arguments(*call);
        e = tree(call);
      } else {
        return e;
      }
    }
  }

  // `| name(args)` and `is [not] name args` after `e`; `first_without_pipe`: a filter block's
  // header ("filter upper | trim").
  ExprPtr filter_chain(ExprPtr e, bool first_without_pipe = false) {
    for (;;) {
      if (at_op("|") || first_without_pipe) {
        if (!first_without_pipe) ++i_;
        first_without_pipe = false;
        auto f = make_expr(Expr::Kind::kFilter, peek().line);
        f->name = name();
        f->args.push_back(e);  // null in a filter block: the body's text
        if (at_op("(")) call_arguments(*f);
        e = tree(f);
      } else if (at_name("is")) {
        ++i_;
        auto t = make_expr(Expr::Kind::kTest, peek().line);
        if (at_name("not")) {
          ++i_;
          t->negated = true;
        }
        if (peek().type == Tok::kName) {
          t->name = next().text;
        } else if (peek().type == Tok::kOp &&
                   (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                    peek().text == ">" || peek().text == "<=" || peek().text == ">=")) {
          t->name = next().text;
        } else {
          fail(source_, peek().line, "expected a test name after 'is'");
        }
        t->args.push_back(e);
        if (at_op("(")) {
          call_arguments(*t);
        } else if (peek().type == Tok::kString || peek().type == Tok::kInt ||
                   peek().type == Tok::kFloat ||
                   (peek().type == Tok::kName && !at_name("and") && !at_name("or") &&
                    !at_name("else") && !at_name("if") && !at_name("in") && !at_name("is") &&
                    !at_name("not"))) {
          t->args.push_back(unary(false));  // `is divisibleby 3`, `is sameas none`
        }
        e = tree(t);
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  std::string source_;
  size_t i_ = 0;
  int depth_ = 0;
};

// ---- evaluation ---------------------------------------------------------------------------

enum class Flow { kNormal, kBreak, kContinue };

struct Output {
  std::string text;
  std::vector<std::pair<size_t, size_t>> generation;
};

class Renderer;

// Python's sequence index: negative from the end; nullopt when out of range.
std::optional<size_t> index_of(int64_t i, size_t size) {
  const int64_t n = static_cast<int64_t>(size);
  if (i < 0) i += n;
  if (i < 0 || i >= n) return std::nullopt;
  return static_cast<size_t>(i);
}

// Python's slice indices over `size` elements.
std::vector<size_t> slice_indices(const Value& start, const Value& stop, const Value& step,
                                  size_t size) {
  const int64_t n = static_cast<int64_t>(size);
  const int64_t st = step.is_none() || step.is_undefined() ? 1 : step.integer();
  if (st == 0) throw ConfigError("slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t lo_default, int64_t hi_default, bool is_start) {
    if (v.is_none() || v.is_undefined()) return is_start ? lo_default : hi_default;
    int64_t x = v.integer();
    if (x < 0) x += n;
    if (st > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  std::vector<size_t> out;
  if (st > 0) {
    const int64_t a = clamp(start, 0, n, true), b = clamp(stop, 0, n, false);
    for (int64_t i = a; i < b; i += st) out.push_back(static_cast<size_t>(i));
  } else {
    const int64_t a = clamp(start, n - 1, -1, true), b = clamp(stop, n - 1, -1, false);
    for (int64_t i = a; i > b; i += st) out.push_back(static_cast<size_t>(i));
  }
  return out;
}

std::string type_name(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return "undefined";
    case Value::Kind::kNone:
      return "NoneType";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "str";
    case Value::Kind::kList:
      return v.is_tuple() ? "tuple" : "list";
    case Value::Kind::kDict:
      return "dict";
    case Value::Kind::kNamespace:
      return "namespace";
    case Value::Kind::kFunction:
      return "function";
  }
  return "?";
}

// The elements `for` walks: a list's, a dict's keys, a string's characters.
List iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kList:
      return v.list();
    case Value::Kind::kDict:
    case Value::Kind::kNamespace: {
      List keys;
      for (const auto& kv : v.dict()) keys.emplace_back(kv.first);
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      for (uint32_t c : code_points(v.string())) chars.emplace_back(from_code_points({c}));
      return chars;
    }
    case Value::Kind::kUndefined:
      return {};
    default:
      throw ConfigError(fmt::format("'{}' object is not iterable", type_name(v)));
  }
}

int compare_values(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    const double x = a.number(), y = b.number();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string())
    return a.string().compare(b.string()) < 0 ? -1 : a.string() == b.string() ? 0 : 1;
  if (a.is_list() && b.is_list()) {
    const Nested nested;
    for (size_t i = 0; i < std::min(a.list().size(), b.list().size()); ++i) {
      if (const int c = compare_values(a.list()[i], b.list()[i]); c != 0) return c;
    }
    return a.list().size() < b.list().size() ? -1 : a.list().size() > b.list().size() ? 1 : 0;
  }
  throw ConfigError(
      fmt::format("'<' is not supported between '{}' and '{}'", type_name(a), type_name(b)));
}

bool contains(const Value& container, const Value& item) {
  if (container.is_string()) {
    if (!item.is_string()) throw ConfigError("'in <string>' requires a string on the left");
    return container.string().find(item.string()) != std::string::npos;
  }
  if (container.is_list()) {
    for (const Value& v : container.list())
      if (equal(v, item)) return true;
    return false;
  }
  if (container.is_dict()) {
    if ((item.is_list() && !item.is_tuple()) || item.is_dict())
      throw ConfigError(fmt::format("unhashable type: '{}'", type_name(item)));
    return std::any_of(container.dict().begin(), container.dict().end(),
                       [&](const auto& kv) { return equal(kv.first, item); });
  }
  if (container.is_undefined()) return false;
  throw ConfigError(fmt::format("argument of type '{}' is not iterable", type_name(container)));
}

// Python's str.strip / lstrip / rstrip with optional characters, on code points.
std::string strip(const std::string& s, const Value& chars, bool left, bool right) {
  const std::vector<uint32_t> cps = code_points(s);
  std::vector<uint32_t> set;
  const bool whitespace = chars.is_none() || chars.is_undefined();
  if (!whitespace) set = code_points(chars.string());
  auto strip_it = [&](uint32_t c) {
    if (whitespace) return is_python_space(c);
    return std::find(set.begin(), set.end(), c) != set.end();
  };
  size_t a = 0, b = cps.size();
  if (left)
    while (a < b && strip_it(cps[a])) ++a;
  if (right)
    while (b > a && strip_it(cps[b - 1])) --b;
  return from_code_points(std::vector<uint32_t>(cps.begin() + static_cast<std::ptrdiff_t>(a),
                                                cps.begin() + static_cast<std::ptrdiff_t>(b)));
}

List split(const std::string& s, const Value& sep, int64_t maxsplit) {
  List out;
  if (sep.is_none() || sep.is_undefined()) {  // runs of whitespace, empties dropped
    size_t i = 0;
    while (i < s.size()) {
      while (i < s.size() && is_space(s[i])) ++i;
      if (i >= s.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        std::string rest = s.substr(i);
        while (!rest.empty() && is_space(rest.back())) rest.pop_back();
        out.emplace_back(rest);
        return out;
      }
      size_t j = i;
      while (j < s.size() && !is_space(s[j])) ++j;
      out.emplace_back(s.substr(i, j - i));
      i = j;
    }
    return out;
  }
  const std::string& d = sep.string();
  if (d.empty()) throw ConfigError("empty separator");
  size_t from = 0;
  for (;;) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) break;
    const size_t at = s.find(d, from);
    if (at == std::string::npos) break;
    out.emplace_back(s.substr(from, at - from));
    from = at + d.size();
  }
  out.emplace_back(s.substr(from));
  return out;
}

// What a template may write or build at most (a chat is far below): a runaway repetition
// is an error, not an allocation that takes the machine.
constexpr size_t kMaxTextBytes = size_t{64} << 20;

void check_built(size_t size, const char* what) {
  if (size > kMaxTextBytes)
    throw ConfigError(
        fmt::format("{} builds a value larger than a chat template may (64 MiB)", what));
}

// Python's str.replace: `count` occurrences (all when negative) of `from`, left to right; an
// empty `from` matches before every character and at the end.
std::string replace_all(const std::string& s, const std::string& from, const std::string& to,
                        int64_t count) {
  std::string out;
  int64_t n = 0;
  if (from.empty()) {
    const std::vector<uint32_t> cps = code_points(s);
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || n < count) {
        out += to;
        ++n;
      }
      if (i < cps.size()) text::append_utf8(cps[i], out);
      check_built(out.size(), "replace");
    }
    return out;
  }
  size_t at = 0;
  for (; count < 0 || n < count; ++n) {
    const size_t found = s.find(from, at);
    if (found == std::string::npos) break;
    out.append(s, at, found - at);
    out += to;
    at = found + from.size();
    check_built(out.size(), "replace");
  }
  out.append(s, at, std::string::npos);
  check_built(out.size(), "replace");
  return out;
}

// Python's str.splitlines(): the lines without their breaks (\n, \r, \r\n, \v, \f, \x1c-\x1e,
// \x85, U+2028, U+2029).
std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::vector<uint32_t> line;
  const std::vector<uint32_t> cps = code_points(s);
  for (size_t i = 0; i < cps.size(); ++i) {
    const uint32_t c = cps[i];
    const bool is_break = c == '\n' || c == '\r' || c == 0x0b || c == 0x0c ||
                          (c >= 0x1c && c <= 0x1e) || c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!is_break) {
      line.push_back(c);
      continue;
    }
    if (c == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') ++i;
    out.push_back(from_code_points(line));
    line.clear();
  }
  if (!line.empty()) out.push_back(from_code_points(line));
  return out;
}

// d[key] = v: the value replaced where an equal key is (the first key kept, as Python keeps
// it), else appended.
void set_key(Dict& d, const Value& key, Value v) {
  for (auto& kv : d) {
    if (equal(kv.first, key)) {
      kv.second = std::move(v);
      return;
    }
  }
  d.emplace_back(key, std::move(v));
}

// markupsafe's escape of a plain string: & < > " ' as HTML entities.
std::string escape_html(const std::string& s) {
  check_built(s.size(), "escaping");  // at most five times as long
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// markupsafe's escape(): Markup as it is, anything else as its str() escaped.
Value escaped(const Value& v) {
  return v.is_markup() ? v : Value::markup(escape_html(v.str()));
}

// Python's str.upper / str.lower with Unicode's simple case mappings (Python's full mappings
// differ for a few characters: 'ß'.upper() is 'SS' there and stays 'ß' here).
std::string change_case(const std::string& s, bool upper) {
  std::string out;
  out.reserve(s.size());
  for (uint32_t c : code_points(s)) {
    const auto cp = static_cast<utf8proc_int32_t>(c);
    text::append_utf8(static_cast<uint32_t>(upper ? utf8proc_toupper(cp) : utf8proc_tolower(cp)),
                      out);
  }
  return out;
}

// What jinja2's sort, dictsort, unique, min and max compare by default (case_sensitive=False):
// strings lowercased, everything else as it is.
Value ignore_case(const Value& v) {
  return v.is_string() ? Value(change_case(v.string(), false)) : v;
}

// A dict key as json.dumps writes it: strings as they are, numbers, bools and None as JSON.
std::string json_key(const Value& k) {
  switch (k.kind()) {
    case Value::Kind::kString:
      return k.string();
    case Value::Kind::kNone:
      return "null";
    case Value::Kind::kBool:
      return k.boolean() ? "true" : "false";
    case Value::Kind::kInt:
      return std::to_string(k.integer());
    case Value::Kind::kFloat:
      return std::isnan(k.number())   ? "NaN"
             : std::isinf(k.number()) ? (k.number() > 0 ? "Infinity" : "-Infinity")
                                      : float_repr(k.number());
    default:
      throw ConfigError(
          fmt::format("keys must be str, int, float, bool or None, not {}", type_name(k)));
  }
}

// json.dumps as transformers' tojson calls it (ensure_ascii=False, sort_keys optional).
void dump_json(std::string& out, const Value& v, int indent, int depth, bool sort_keys) {
  const Nested nested;
  const auto newline = [&](int d) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * d), ' ');
  };
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      out += "null";
      return;
    case Value::Kind::kBool:
      out += v.boolean() ? "true" : "false";
      return;
    case Value::Kind::kInt:
      out += std::to_string(v.integer());
      return;
    case Value::Kind::kFloat:
      out += std::isnan(v.number())   ? "NaN"
             : std::isinf(v.number()) ? (v.number() > 0 ? "Infinity" : "-Infinity")
                                      : float_repr(v.number());
      return;
    case Value::Kind::kString: {
      out += '"';
      for (char c : v.string()) {
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
          case '\b':
            out += "\\b";
            break;
          case '\f':
            out += "\\f";
            break;
          default:
            if (static_cast<unsigned char>(c) < 0x20) {
              out += fmt::format("\\u{:04x}", static_cast<unsigned char>(c));
            } else {
              out += c;
            }
        }
      }
      out += '"';
      return;
    }
    case Value::Kind::kList: {
      if (v.list().empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < v.list().size(); ++i) {
        if (i) out += indent < 0 ? ", " : ",";
        newline(depth + 1);
        dump_json(out, v.list()[i], indent, depth + 1, sort_keys);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::kDict:
    case Value::Kind::kNamespace: {
      if (v.dict().empty()) {
        out += "{}";
        return;
      }
      Dict items = v.dict();
      if (sort_keys)  // Python sorts the keys themselves: mixed types are a TypeError
        std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) {
          return compare_values(a.first, b.first) < 0;
        });
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += indent < 0 ? ", " : ",";
        newline(depth + 1);
        dump_json(out, Value(json_key(items[i].first)), indent, depth + 1, sort_keys);
        out += ": ";
        dump_json(out, items[i].second, indent, depth + 1, sort_keys);
      }
      newline(depth);
      out += '}';
      return;
    }
    case Value::Kind::kFunction:
      throw ConfigError("a function is not JSON serializable");
  }
}

// json.dumps on one line with the given item and key separators.
void dump_json_with(std::string& out, const Value& v, const std::string& item,
                    const std::string& key) {
  const Nested nested;
  if (v.is_list()) {
    out += '[';
    for (size_t i = 0; i < v.list().size(); ++i) {
      if (i) out += item;
      dump_json_with(out, v.list()[i], item, key);
    }
    out += ']';
  } else if (v.is_dict()) {
    out += '{';
    for (size_t i = 0; i < v.dict().size(); ++i) {
      if (i) out += item;
      dump_json(out, Value(json_key(v.dict()[i].first)), -1, 0, false);
      out += key;
      dump_json_with(out, v.dict()[i].second, item, key);
    }
    out += '}';
  } else {
    dump_json(out, v, -1, 0, false);
  }
}

const Value* kwarg(const Kwargs& kwargs, const char* key) {
  for (const auto& [k, v] : kwargs)
    if (k == key) return &v;
  return nullptr;
}

// Argument `i` or keyword `key`, else `otherwise`.
Value arg(const std::vector<Value>& args, size_t i, const Kwargs& kwargs, const char* key,
          Value otherwise = Value()) {
  if (i < args.size()) return args[i];
  if (const Value* v = kwarg(kwargs, key)) return *v;
  return otherwise;
}

class Renderer {
 public:
  Renderer(std::string source, const Dict& context) : source_(std::move(source)) {
    scopes_.emplace_back();
    for (const auto& [k, v] : context) scopes_.back()[k.str()] = v;
    install_globals();
  }

  void run(const Node& root, Output& out) { exec(root, out); }

 private:
  using Scope = std::unordered_map<std::string, Value>;

  [[noreturn]] void error(int line, const std::string& what) const { fail(source_, line, what); }

  void install_globals() {
    Scope& g = scopes_.front();
    auto set_default = [&](const char* name, Value v) {
      if (!g.count(name)) g[name] = std::move(v);
    };
    set_default(
        "raise_exception", Value::function([](const std::vector<Value>& a, const Kwargs&) -> Value {
          throw ConfigError(fmt::format("the template raised: {}", a.empty() ? "" : a[0].str()));
        }));
    set_default("strftime_now",
                Value::function([](const std::vector<Value>& a, const Kwargs&) -> Value {
                  const std::time_t now = std::time(nullptr);
                  std::tm tm{};
                  localtime_r(&now, &tm);
                  char buf[256];
                  const std::string fmt_text = a.empty() ? "%Y-%m-%d" : a[0].str();
                  const size_t n = std::strftime(buf, sizeof buf, fmt_text.c_str(), &tm);
                  return Value(std::string(buf, n));
                }));
    set_default("range", Value::function([](const std::vector<Value>& a, const Kwargs&) -> Value {
                  int64_t start = 0, stop = 0, step = 1;
                  if (a.size() == 1) {
                    stop = a[0].integer();
                  } else if (a.size() >= 2) {
                    start = a[0].integer();
                    stop = a[1].integer();
                    if (a.size() > 2) step = a[2].integer();
                  }
                  if (step == 0) throw ConfigError("range() arg 3 must not be zero");
                  // Its length first: a range no chat needs is refused before it is built.
                  const long double span = static_cast<long double>(stop) - start;
                  const long double count = span / step;
                  if (count > 1'000'000)
                    throw ConfigError("range() of more than 1,000,000 numbers in a chat template");
                  List out;
                  const auto n = static_cast<int64_t>(std::max<long double>(0, std::ceil(count)));
                  for (int64_t k = 0; k < n; ++k) out.emplace_back(start + k * step);
                  return Value(std::move(out));
                }));
    set_default("namespace",
                Value::function([](const std::vector<Value>& a, const Kwargs& kw) -> Value {
                  Dict attrs;
                  if (!a.empty() && a[0].is_dict()) attrs = a[0].dict();
                  for (const auto& [k, v] : kw) set_key(attrs, Value(k), v);
                  return Value::make_namespace(std::move(attrs));
                }));
    set_default("dict", Value::function([](const std::vector<Value>& a, const Kwargs& kw) -> Value {
                  Dict d;
                  if (!a.empty() && a[0].is_dict()) d = a[0].dict();
                  for (const auto& [k, v] : kw) set_key(d, Value(k), v);
                  return Value(std::move(d));
                }));
  }

  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return Value::undefined(name);
  }

  void assign(const std::string& name, Value v) { scopes_.back()[name] = std::move(v); }

  // ---- statements ----

  Flow exec(const Node& n, Output& out) {
    switch (n.kind) {
      case Node::Kind::kBody:
        for (const auto& c : n.children) {
          const Flow f = exec(*c, out);
          if (f != Flow::kNormal) return f;
        }
        return Flow::kNormal;
      case Node::Kind::kText:
        out.text += n.text;
        return Flow::kNormal;
      case Node::Kind::kOutput:
        out.text += print(eval(*n.expr), n.line);
        if (out.text.size() > kMaxText)
          error(n.line, "the rendered text is larger than a chat template may write (64 MiB)");
        return Flow::kNormal;
      case Node::Kind::kIf:
        for (const auto& [cond, body] : n.branches) {
          if (!cond || eval(*cond).truthy()) return exec(*body, out);
        }
        return Flow::kNormal;
      case Node::Kind::kFor:
        return exec_for(n, out);
      case Node::Kind::kSet:
        assign_target(*n.target, eval(*n.expr), n.line);
        return Flow::kNormal;
      case Node::Kind::kSetBlock: {
        Output inner;
        exec(*n.children[0], inner);
        Value v(inner.text);
        if (n.expr) v = apply_filters(*n.expr, v);
        assign_target(*n.target, v, n.line);
        return Flow::kNormal;
      }
      case Node::Kind::kMacro:
        assign(n.text, make_macro(n));
        return Flow::kNormal;
      case Node::Kind::kFilterBlock: {
        Output inner;
        exec(*n.children[0], inner);
        out.text += print(apply_filters(*n.expr, Value(inner.text)), n.line);
        return Flow::kNormal;
      }
      case Node::Kind::kGeneration: {
        const size_t start = out.text.size();
        const Flow f = exec(*n.children[0], out);
        out.generation.emplace_back(start, out.text.size());
        return f;
      }
      case Node::Kind::kBreak:
        return Flow::kBreak;
      case Node::Kind::kContinue:
        return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  std::string print(const Value& v, int line) const {
    try {
      return v.str();
    } catch (const ConfigError& e) {  // a value nested too deep to print
      error(line, e.what());
    }
  }

  // A filter chain whose innermost argument is null (set / filter blocks) applied to `v`.
  Value apply_filters(const Expr& e, const Value& v) {
    if (e.kind != Expr::Kind::kFilter) return v;
    const Value inner = e.args[0] ? apply_filters(*e.args[0], v) : v;
    std::vector<Value> args{inner};
    for (size_t i = 1; i < e.args.size(); ++i) args.push_back(eval(*e.args[i]));
    return call_filter(e.name, args, eval_kwargs(e), e.line);
  }

  void assign_target(const Expr& target, const Value& v, int line) {
    if (target.kind == Expr::Kind::kName) {
      assign(target.name, v);
    } else if (target.kind == Expr::Kind::kAttr) {
      const Value ns = eval(*target.args[0]);
      if (ns.kind() != Value::Kind::kNamespace)
        error(line, fmt::format("cannot assign the attribute '{}' of a non-namespace object",
                                target.name));
      set_key(ns.mutable_dict(), Value(target.name), v);
    } else {  // a tuple of names
      const List items = iterate(v);
      if (items.size() != target.args.size())
        error(line, fmt::format("cannot unpack {} values into {} names", items.size(),
                                target.args.size()));
      for (size_t i = 0; i < items.size(); ++i) assign(target.args[i]->name, items[i]);
    }
  }

  Flow exec_for(const Node& n, Output& out) {
    List items = iterate(eval(*n.expr));
    const auto bind = [&](const Value& item) {
      if (n.targets.size() == 1) {
        assign(n.targets[0], item);
        return;
      }
      const List parts = iterate(item);
      if (parts.size() != n.targets.size())
        error(n.line,
              fmt::format("cannot unpack {} values into {} names", parts.size(), n.targets.size()));
      for (size_t i = 0; i < parts.size(); ++i) assign(n.targets[i], parts[i]);
    };
    if (n.condition) {  // `for x in xs if cond`: the loop sees only what passes
      List kept;
      scopes_.emplace_back();
      for (const Value& item : items) {
        bind(item);
        if (eval(*n.condition).truthy()) kept.push_back(item);
      }
      scopes_.pop_back();
      items = std::move(kept);
    }
    if (items.empty()) {
      if (n.otherwise) return exec(*n.otherwise, out);
      return Flow::kNormal;
    }
    scopes_.emplace_back();
    const size_t count = items.size();
    for (size_t i = 0; i < count; ++i) {
      step(n.line);
      scopes_.back().clear();  // as jinja2: what one iteration sets, the next does not see
      bind(items[i]);
      Dict loop{{"index", Value(static_cast<int64_t>(i + 1))},
                {"index0", Value(static_cast<int64_t>(i))},
                {"revindex", Value(static_cast<int64_t>(count - i))},
                {"revindex0", Value(static_cast<int64_t>(count - i - 1))},
                {"first", Value(i == 0)},
                {"last", Value(i + 1 == count)},
                {"length", Value(static_cast<int64_t>(count))},
                {"previtem", i > 0 ? items[i - 1] : Value::undefined("previtem")},
                {"nextitem", i + 1 < count ? items[i + 1] : Value::undefined("nextitem")}};
      loop.emplace_back("cycle", Value::function([i](const std::vector<Value>& a, const Kwargs&) {
                          return a.empty() ? Value() : a[i % a.size()];
                        }));
      assign("loop", Value(std::move(loop)));
      const Flow f = exec(*n.children[0], out);
      if (f == Flow::kBreak) break;
    }
    scopes_.pop_back();
    return Flow::kNormal;
  }

  Value make_macro(const Node& n) {
    const Node* node = &n;
    return Value::function([this, node](const std::vector<Value>& args, const Kwargs& kwargs) {
      if (calls_ >= kMaxCalls)
        error(node->line, fmt::format("macros nested more than {} calls deep", kMaxCalls));
      ++calls_;
      step(node->line);
      struct Leave {
        int& n;
        ~Leave() { --n; }
      } leave{calls_};
      // A macro sees the template's globals and its own parameters.
      std::vector<Scope> saved;
      saved.swap(scopes_);
      scopes_.push_back(saved.front());
      scopes_.emplace_back();
      for (size_t i = 0; i < node->params.size(); ++i) {
        const auto& [pname, def] = node->params[i];
        Value v;
        if (i < args.size()) {
          v = args[i];
        } else if (const Value* k = kwarg(kwargs, pname.c_str())) {
          v = *k;
        } else if (def) {
          v = eval(*def);
        } else {
          v = Value::undefined(pname);
        }
        assign(pname, v);
      }
      Output inner;
      try {
        exec(*node->children[0], inner);
      } catch (...) {
        scopes_.swap(saved);
        throw;
      }
      scopes_.swap(saved);
      return Value(inner.text);
    });
  }

  // ---- expressions ----

  Kwargs eval_kwargs(const Expr& e) {
    Kwargs kw;
    for (const auto& [k, v] : e.kwargs) kw.emplace_back(k, eval(*v));
    return kw;
  }

  Value eval(const Expr& e) {
    try {
      return eval_inner(e);
    } catch (const ConfigError& err) {
      const std::string what = err.what();
      if (what.rfind(source_ + ": chat template", 0) == 0) throw;
      error(e.line, what);
    }
  }

  Value eval_inner(const Expr& e) {
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.value;
      case Expr::Kind::kName:
        return lookup(e.name);
      case Expr::Kind::kAttr: {
        const Value obj = eval(*e.args[0]);
        return attribute(obj, e.name, e.line);
      }
      case Expr::Kind::kItem: {
        const Value obj = eval(*e.args[0]);
        const Value key = eval(*e.args[1]);
        return item(obj, key, e.line);
      }
      case Expr::Kind::kSlice: {
        const Value obj = eval(*e.args[0]);
        const Value a = e.args[1] ? eval(*e.args[1]) : Value::none();
        const Value b = e.args[2] ? eval(*e.args[2]) : Value::none();
        const Value c = e.args[3] ? eval(*e.args[3]) : Value::none();
        if (obj.is_string()) {
          const std::vector<uint32_t> cps = code_points(obj.string());
          std::vector<uint32_t> picked;
          for (size_t i : slice_indices(a, b, c, cps.size())) picked.push_back(cps[i]);
          return obj.is_markup() ? Value::markup(from_code_points(picked))
                                 : Value(from_code_points(picked));
        }
        if (obj.is_list()) {
          List picked;
          for (size_t i : slice_indices(a, b, c, obj.list().size()))
            picked.push_back(obj.list()[i]);
          return obj.is_tuple() ? Value::tuple(std::move(picked)) : Value(std::move(picked));
        }
        if (obj.is_undefined())
          error(e.line, fmt::format("'{}' is undefined", obj.undefined_name()));
        error(e.line, fmt::format("'{}' object cannot be sliced", type_name(obj)));
      }
      case Expr::Kind::kCall: {
        const Value f = eval(*e.args[0]);
        std::vector<Value> args;
        for (size_t i = 1; i < e.args.size(); ++i) args.push_back(eval(*e.args[i]));
        if (f.kind() != Value::Kind::kFunction) {
          if (f.is_undefined()) error(e.line, fmt::format("'{}' is undefined", f.undefined_name()));
          error(e.line, fmt::format("'{}' object is not callable", type_name(f)));
        }
        return f.fn()(args, eval_kwargs(e));
      }
      case Expr::Kind::kFilter: {
        std::vector<Value> args;
        for (const auto& a : e.args) args.push_back(eval(*a));
        return call_filter(e.name, args, eval_kwargs(e), e.line);
      }
      case Expr::Kind::kTest: {
        std::vector<Value> args;
        for (const auto& a : e.args) args.push_back(eval(*a));
        const bool r = call_test(e.name, args, e.line);
        return Value(e.negated ? !r : r);
      }
      case Expr::Kind::kNot:
        return Value(!eval(*e.args[0]).truthy());
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        const Value v = eval(*e.args[0]);
        if (!v.is_number())
          error(e.line, fmt::format("bad operand type for unary {}: '{}'",
                                    e.kind == Expr::Kind::kNeg ? '-' : '+', type_name(v)));
        if (e.kind == Expr::Kind::kPos) return v;
        if (v.kind() == Value::Kind::kFloat) return Value(-v.number());
        if (v.integer() == std::numeric_limits<int64_t>::min())
          error(e.line, "integer - overflows 64 bits");
        return Value(-v.integer());
      }
      case Expr::Kind::kAnd: {
        const Value a = eval(*e.args[0]);
        return a.truthy() ? eval(*e.args[1]) : a;
      }
      case Expr::Kind::kOr: {
        const Value a = eval(*e.args[0]);
        return a.truthy() ? a : eval(*e.args[1]);
      }
      case Expr::Kind::kCond: {
        if (eval(*e.args[0]).truthy()) return eval(*e.args[1]);
        return e.args.size() > 2 ? eval(*e.args[2]) : Value::undefined("else");
      }
      case Expr::Kind::kCompare: {
        Value left = eval(*e.args[0]);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          const Value right = eval(*e.args[i + 1]);
          const std::string& op = e.ops[i];
          bool r = false;
          if (op == "==")
            r = equal(left, right);
          else if (op == "!=")
            r = !equal(left, right);
          else if (op == "in")
            r = contains(right, left);
          else if (op == "not in")
            r = !contains(right, left);
          else {
            const int c = compare_values(left, right);
            r = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
          }
          if (!r) return Value(false);
          left = right;
        }
        return Value(true);
      }
      case Expr::Kind::kBinary:
        return binary(e.name, eval(*e.args[0]), eval(*e.args[1]), e.line);
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        List l;
        for (const auto& a : e.args) l.push_back(eval(*a));
        return e.kind == Expr::Kind::kTuple ? Value::tuple(std::move(l)) : Value(std::move(l));
      }
      case Expr::Kind::kDict: {
        Dict d;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2)
          set_key(d, eval(*e.args[i]), eval(*e.args[i + 1]));
        return Value(std::move(d));
      }
    }
    return Value();
  }

  Value binary(const std::string& op, const Value& a, const Value& b, int line) {
    const auto bounded = [&](size_t size) {
      if (size > kMaxText)
        error(line,
              fmt::format("'{}' builds a value larger than a chat template may (64 MiB)", op));
    };
    if (op == "~") {
      const std::string x = a.str(), y = b.str();
      bounded(x.size() + y.size());
      return Value(x + y);
    }
    if (op == "+") {
      if (a.is_string() && b.is_string()) {
        bounded(a.string().size() + b.string().size());
        // Markup + str and str + Markup: the plain side is escaped, the sum is Markup.
        if (a.is_markup() || b.is_markup()) {
          const std::string x = escaped(a).string(), y = escaped(b).string();
          bounded(x.size() + y.size());
          return Value::markup(x + y);
        }
        return Value(a.string() + b.string());
      }
      if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple()) {
        bounded((a.list().size() + b.list().size()) * sizeof(Value));
        List l = a.list();
        l.insert(l.end(), b.list().begin(), b.list().end());
        return a.is_tuple() ? Value::tuple(std::move(l)) : Value(std::move(l));
      }
    }
    if (op == "*") {
      const Value* s = a.is_string() || a.is_list()   ? &a
                       : b.is_string() || b.is_list() ? &b
                                                      : nullptr;
      const Value* n = s == &a ? &b : &a;
      if (s && n->kind() == Value::Kind::kInt) {
        const int64_t times = std::max<int64_t>(0, n->integer());
        const size_t unit = s->is_string() ? s->string().size() : s->list().size();
        if (unit > 0 && static_cast<uint64_t>(times) > kMaxText / unit)
          error(line, fmt::format("'{}' * {} is larger than a chat template may build",
                                  type_name(*s), times));
        if (s->is_string()) {
          std::string out;
          for (int64_t i = 0; i < times; ++i) out += s->string();
          return s->is_markup() ? Value::markup(out) : Value(out);
        }
        List out;
        for (int64_t i = 0; i < times; ++i)
          out.insert(out.end(), s->list().begin(), s->list().end());
        return s->is_tuple() ? Value::tuple(std::move(out)) : Value(std::move(out));
      }
    }
    if (!a.is_number() || !b.is_number()) {
      if (a.is_undefined() || b.is_undefined())
        error(line, fmt::format("'{}' is undefined",
                                a.is_undefined() ? a.undefined_name() : b.undefined_name()));
      error(line, fmt::format("unsupported operand types for {}: '{}' and '{}'", op, type_name(a),
                              type_name(b)));
    }
    const bool floats = a.kind() == Value::Kind::kFloat || b.kind() == Value::Kind::kFloat;
    if (op == "/") {
      if (b.number() == 0) error(line, "division by zero");
      return Value(a.number() / b.number());
    }
    if (op == "**") {
      if (!floats && b.integer() >= 0) {
        int64_t r = 1;
        for (int64_t i = 0; i < b.integer(); ++i) {
          if (__builtin_mul_overflow(r, a.integer(), &r))
            error(line, "an integer power overflows 64 bits");
        }
        return Value(r);
      }
      return Value(std::pow(a.number(), b.number()));
    }
    if (floats) {
      const double x = a.number(), y = b.number();
      if (op == "+") return Value(x + y);
      if (op == "-") return Value(x - y);
      if (op == "*") return Value(x * y);
      if (y == 0) error(line, "division by zero");
      if (op == "//") return Value(std::floor(x / y));
      return Value(x - std::floor(x / y) * y);  // %
    }
    const int64_t x = a.integer(), y = b.integer();
    int64_t r = 0;
    if (op == "+" || op == "-" || op == "*") {
      const bool overflow = op == "+"   ? __builtin_add_overflow(x, y, &r)
                            : op == "-" ? __builtin_sub_overflow(x, y, &r)
                                        : __builtin_mul_overflow(x, y, &r);
      if (overflow) error(line, fmt::format("integer {} overflows 64 bits", op));
      return Value(r);
    }
    if (y == 0) error(line, "division by zero");
    if (x == std::numeric_limits<int64_t>::min() && y == -1)
      error(line, "integer // overflows 64 bits");
    int64_t q = x / y;
    r = x % y;
    if (r != 0 && ((r < 0) != (y < 0))) {  // Python floors
      --q;
      r += y;
    }
    return op == "//" ? Value(q) : Value(r);
  }

  Value item(const Value& obj, const Value& key, int line) {
    if (obj.is_dict()) return obj.item(key);
    if (obj.is_list() && key.is_number()) {
      if (auto i = index_of(key.integer(), obj.list().size())) return obj.list()[*i];
      return Value::undefined(fmt::format("[{}]", key.integer()));
    }
    if (obj.is_string() && key.is_number()) {
      const std::vector<uint32_t> cps = code_points(obj.string());
      if (auto i = index_of(key.integer(), cps.size()))
        return obj.is_markup() ? Value::markup(from_code_points({cps[*i]}))
                               : Value(from_code_points({cps[*i]}));
      return Value::undefined(fmt::format("[{}]", key.integer()));
    }
    if (key.is_string()) return attribute(obj, key.string(), line);
    if (obj.is_undefined()) error(line, fmt::format("'{}' is undefined", obj.undefined_name()));
    return Value::undefined(key.str());
  }

  // obj.name: a dict's member, else a method of a string, list or dict.
  Value attribute(const Value& obj, const std::string& name, int line) {
    if (obj.is_undefined())
      error(line, fmt::format("'{}' is undefined (reading its '{}')", obj.undefined_name(), name));
    if (obj.is_dict()) {
      // jinja2 tries Python's attribute first: a dict's methods win over its keys.
      const bool method = name == "items" || name == "keys" || name == "values" || name == "get";
      if (!method || obj.kind() == Value::Kind::kNamespace) return obj.get(name);
      {
        return Value::function([obj, name](const std::vector<Value>& a, const Kwargs& kw) -> Value {
          if (name == "get") {
            const Value k = arg(a, 0, kw, "key");
            for (const auto& [key, v] : obj.dict())
              if (equal(key, k)) return v;
            return arg(a, 1, kw, "default", Value::none());
          }
          List out;
          for (const auto& [k, v] : obj.dict()) {
            if (name == "items")
              out.push_back(Value::tuple({k, v}));
            else if (name == "keys")
              out.emplace_back(k);
            else
              out.push_back(v);
          }
          return Value(std::move(out));
        });
      }
    }
    if (obj.is_string()) return string_method(obj, name, line);
    return Value::undefined(name);
  }

  // str's method `name` bound to `self` (a string); on Markup, markupsafe's: the result keeps
  // the mark, and string arguments of strip, replace, join and format are escaped first.
  Value string_method(const Value& self, const std::string& name, int line) {
    static const char* const kMethods[] = {
        "strip", "lstrip", "rstrip",  "split",   "rsplit",     "startswith", "endswith",
        "upper", "lower",  "replace", "title",   "capitalize", "join",       "find",
        "count", "format", "isdigit", "isspace", "splitlines"};
    if (std::find_if(std::begin(kMethods), std::end(kMethods),
                     [&](const char* m) { return name == m; }) == std::end(kMethods))
      return Value::undefined(name);
    (void)line;
    const bool markup = self.is_markup();
    return Value::function([s = self.string(), name, markup](const std::vector<Value>& a,
                                                             const Kwargs& kw) -> Value {
      const auto text = [markup](std::string t) {
        return markup ? Value::markup(std::move(t)) : Value(std::move(t));
      };
      const auto text_list = [&](List parts) {
        if (markup)
          for (Value& part : parts) part = Value::markup(part.string());
        return Value(std::move(parts));
      };
      // An argument as markupsafe passes it to str's method: a plain string escaped.
      const auto argument = [markup](Value v) {
        return markup && v.is_string() && !v.is_markup() ? Value(escape_html(v.string())) : v;
      };
      if (name == "strip" || name == "lstrip" || name == "rstrip")
        return text(strip(s, argument(arg(a, 0, kw, "chars", Value::none())), name != "rstrip",
                          name != "lstrip"));
      if (name == "split")
        return text_list(split(s, arg(a, 0, kw, "sep", Value::none()),
                               arg(a, 1, kw, "maxsplit", Value(int64_t{-1})).integer()));
      if (name == "rsplit") {
        const Value sep = arg(a, 0, kw, "sep", Value::none());
        const int64_t maxsplit = arg(a, 1, kw, "maxsplit", Value(int64_t{-1})).integer();
        if (maxsplit < 0 || sep.is_none()) return text_list(split(s, sep, maxsplit));
        List parts = split(s, sep, -1);
        while (static_cast<int64_t>(parts.size()) > maxsplit + 1) {
          parts[0] = Value(parts[0].string() + sep.string() + parts[1].string());
          parts.erase(parts.begin() + 1);
        }
        return text_list(std::move(parts));
      }
      if (name == "startswith" || name == "endswith") {
        const Value p = arg(a, 0, kw, "prefix");
        List options = p.is_list() ? p.list() : List{p};
        for (const Value& o : options) {
          const std::string& t = o.string();
          if (t.size() <= s.size() &&
              (name == "startswith" ? s.compare(0, t.size(), t) == 0
                                    : s.compare(s.size() - t.size(), t.size(), t) == 0))
            return Value(true);
        }
        return Value(false);
      }
      if (name == "upper" || name == "lower") return text(change_case(s, name == "upper"));
      if (name == "replace")
        return text(replace_all(s, argument(arg(a, 0, kw, "old")).str(),
                                argument(arg(a, 1, kw, "new")).str(),
                                arg(a, 2, kw, "count", Value(int64_t{-1})).integer()));
      if (name == "title" || name == "capitalize") {
        std::string out = s;
        bool start = true;
        for (size_t i = 0; i < out.size(); ++i) {
          const auto c = static_cast<unsigned char>(out[i]);
          if (name == "capitalize") {
            out[i] = static_cast<char>(i == 0 ? std::toupper(c) : std::tolower(c));
          } else {
            out[i] = static_cast<char>(start ? std::toupper(c) : std::tolower(c));
            start = !std::isalpha(c);
          }
        }
        return text(out);
      }
      if (name == "join") {
        std::string out;
        const List items = iterate(arg(a, 0, kw, "iterable"));
        for (size_t i = 0; i < items.size(); ++i) {
          out += (i ? s : "") + (markup ? escaped(items[i]) : items[i]).str();
          check_built(out.size(), "join");
        }
        return text(out);
      }
      if (name == "find") {
        const size_t at = s.find(arg(a, 0, kw, "sub").str());
        return Value(at == std::string::npos
                         ? int64_t{-1}
                         : static_cast<int64_t>(code_points(s.substr(0, at)).size()));
      }
      if (name == "count") {
        const std::string sub = arg(a, 0, kw, "sub").str();
        int64_t n = 0;
        if (sub.empty()) return Value(static_cast<int64_t>(code_points(s).size() + 1));
        for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size()))
          ++n;
        return Value(n);
      }
      if (name == "isdigit")
        return Value(!s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
          return std::isdigit(static_cast<unsigned char>(c));
        }));
      if (name == "isspace")
        return Value(!s.empty() &&
                     std::all_of(s.begin(), s.end(), [](char c) { return is_space(c); }));
      if (name == "splitlines") {
        List out;
        for (std::string& l : split_lines(s)) out.emplace_back(std::move(l));
        return text_list(std::move(out));
      }
      // format: positional {} fields only
      std::string out;
      size_t next = 0;
      for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '{' && i + 1 < s.size() && s[i + 1] == '}') {
          if (next < a.size()) out += (markup ? escaped(a[next]) : a[next]).str();
          ++next;
          ++i;
        } else {
          out += s[i];
        }
      }
      return text(out);
    });
  }

  // ---- filters ----

  Value call_filter(const std::string& name, std::vector<Value> args, const Kwargs& kw, int line) {
    const Value v = args.empty() ? Value() : args[0];
    const std::vector<Value> rest(args.begin() + (args.empty() ? 0 : 1), args.end());
    auto need_string = [&]() -> std::string {
      if (v.is_undefined()) return "";
      return v.str();
    };
    // Filters that are str methods keep Markup as Markup (jinja2 calls them on soft_str(value)).
    const Value as_text = v.is_markup() ? v : Value(need_string());
    if (name == "trim") return string_method(as_text, "strip", line).fn()(rest, kw);
    if (name == "length" || name == "count") {
      if (v.is_string()) return Value(static_cast<int64_t>(code_points(v.string()).size()));
      if (v.is_list()) return Value(static_cast<int64_t>(v.list().size()));
      if (v.is_dict()) return Value(static_cast<int64_t>(v.dict().size()));
      if (v.is_undefined()) return Value(int64_t{0});
      error(line, fmt::format("object of type '{}' has no len()", type_name(v)));
    }
    if (name == "list") return Value(iterate(v));
    if (name == "first" || name == "last") {
      const List items = iterate(v);
      if (items.empty()) return Value::undefined(name);
      return name == "first" ? items.front() : items.back();
    }
    if (name == "join") {
      const Value sep = arg(rest, 0, kw, "d", Value(""));
      const Value attr = arg(rest, 1, kw, "attribute");
      List items = iterate(v);
      if (!attr.is_undefined())
        for (Value& x : items) x = item(x, attr, line);
      // Without autoescape jinja2 joins str(d) and the items' str(): no Markup, no escaping.
      return string_method(Value(sep.str()), "join", line).fn()({Value(std::move(items))}, {});
    }
    if (name == "upper" || name == "lower" || name == "capitalize")
      return string_method(as_text, name, line).fn()({}, {});
    if (name == "title") {
      // jinja2's own title (not str.title): a word starts after '-', '(', '{', '[', '<' or
      // whitespace; its first character is upper-cased, the rest lower-cased.
      std::string out;
      bool start = true;
      for (uint32_t c : code_points(need_string())) {
        const std::string one = from_code_points({c});
        out += change_case(one, start);
        start = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_python_space(c);
      }
      return Value(out);
    }
    if (name == "replace")
      return Value(replace_all(need_string(), arg(rest, 0, kw, "old").str(),
                               arg(rest, 1, kw, "new").str(),
                               arg(rest, 2, kw, "count", Value(int64_t{-1})).integer()));
    if (name == "default" || name == "d") {
      const bool boolean = arg(rest, 1, kw, "boolean", Value(false)).truthy();
      if (v.is_undefined() || (boolean && !v.truthy()))
        return arg(rest, 0, kw, "default_value", Value(""));
      return v;
    }
    if (name == "string") return v.is_markup() ? v : Value(v.str());
    if (name == "safe") return v.is_markup() ? v : Value::markup(v.str());
    if (name == "e" || name == "escape") return escaped(v);
    if (name == "forceescape") return Value::markup(escape_html(v.str()));
    if (name == "int") {
      if (v.is_number()) return Value(v.integer());
      try {
        return Value(static_cast<int64_t>(std::stoll(v.str())));
      } catch (const std::exception&) {
        return arg(rest, 0, kw, "default", Value(int64_t{0}));
      }
    }
    if (name == "float") {
      if (v.is_number()) return Value(v.number());
      try {
        return Value(std::stod(v.str()));
      } catch (const std::exception&) {
        return arg(rest, 0, kw, "default", Value(0.0));
      }
    }
    if (name == "abs")
      return v.kind() == Value::Kind::kFloat ? Value(std::fabs(v.number()))
                                             : Value(static_cast<int64_t>(std::llabs(v.integer())));
    if (name == "round") {
      const int64_t precision = arg(rest, 0, kw, "precision", Value(int64_t{0})).integer();
      const double scale = std::pow(10.0, static_cast<double>(precision));
      return Value(std::round(v.number() * scale) / scale);
    }
    if (name == "reverse") {
      if (v.is_string()) {
        std::vector<uint32_t> cps = code_points(v.string());
        std::reverse(cps.begin(), cps.end());
        return v.is_markup() ? Value::markup(from_code_points(cps)) : Value(from_code_points(cps));
      }
      List items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value(std::move(items));
    }
    // sort, unique, min and max compare an item (or its `attribute`) with strings lowercased
    // unless case_sensitive, as jinja2 does.
    const auto sort_key = [&](const Value& x, const Value& attr, bool case_sensitive) {
      const Value k = attr.is_undefined() ? x : item(x, attr, line);
      return case_sensitive ? k : ignore_case(k);
    };
    if (name == "sort") {
      List items = iterate(v);
      const bool reverse = arg(rest, 0, kw, "reverse", Value(false)).truthy();
      const bool case_sensitive = arg(rest, 1, kw, "case_sensitive", Value(false)).truthy();
      const Value attr = arg(rest, 2, kw, "attribute");
      std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
        const Value x = sort_key(a, attr, case_sensitive), y = sort_key(b, attr, case_sensitive);
        return reverse ? compare_values(y, x) < 0 : compare_values(x, y) < 0;
      });
      return Value(std::move(items));
    }
    if (name == "unique") {
      const bool case_sensitive = arg(rest, 0, kw, "case_sensitive", Value(false)).truthy();
      const Value attr = arg(rest, 1, kw, "attribute");
      List out, seen;
      for (const Value& x : iterate(v)) {
        const Value k = sort_key(x, attr, case_sensitive);
        if (std::any_of(seen.begin(), seen.end(), [&](const Value& y) { return equal(k, y); }))
          continue;
        seen.push_back(k);
        out.push_back(x);
      }
      return Value(std::move(out));
    }
    if (name == "min" || name == "max") {
      const List items = iterate(v);
      const bool case_sensitive = arg(rest, 0, kw, "case_sensitive", Value(false)).truthy();
      const Value attr = arg(rest, 1, kw, "attribute");
      if (items.empty()) return Value::undefined(name);
      // Python's min / max: the first item whose key no other beats.
      size_t best = 0;
      for (size_t i = 1; i < items.size(); ++i) {
        const int c = compare_values(sort_key(items[i], attr, case_sensitive),
                                     sort_key(items[best], attr, case_sensitive));
        if (name == "min" ? c < 0 : c > 0) best = i;
      }
      return items[best];
    }
    if (name == "sum") {
      const Value attr = arg(rest, 0, kw, "attribute");
      Value total = arg(rest, 1, kw, "start", Value(int64_t{0}));
      for (const Value& x : iterate(v))
        total = binary("+", total, attr.is_undefined() ? x : item(x, attr, line), line);
      return total;
    }
    if (name == "items" || name == "dictsort") {
      if (v.is_undefined()) return Value(List{});
      if (!v.is_dict())
        error(line, fmt::format("{}: expected a dict, found '{}'", name, type_name(v)));
      Dict d = v.dict();
      if (name == "dictsort") {
        // dictsort(case_sensitive=False, by='key', reverse=False)
        const bool case_sensitive = arg(rest, 0, kw, "case_sensitive", Value(false)).truthy();
        const std::string by = arg(rest, 1, kw, "by", Value("key")).str();
        if (by != "key" && by != "value")
          error(line, "dictsort: you can only sort by either 'key' or 'value'");
        const bool reverse = arg(rest, 2, kw, "reverse", Value(false)).truthy();
        const auto key = [&](const std::pair<Value, Value>& kv) {
          const Value& k = by == "key" ? kv.first : kv.second;
          return case_sensitive ? k : ignore_case(k);
        };
        std::stable_sort(d.begin(), d.end(), [&](const auto& a, const auto& b) {
          return reverse ? compare_values(key(b), key(a)) < 0 : compare_values(key(a), key(b)) < 0;
        });
      }
      List out;
      for (const auto& [k, x] : d) out.push_back(Value::tuple({k, x}));
      return Value(std::move(out));
    }
    if (name == "tojson") {
      // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None,
      // sort_keys=False): json.dumps with those.
      const Value indent = arg(rest, 1, kw, "indent", Value::none());
      std::string out;
      dump_json(out, v,
                indent.is_none() || indent.is_undefined() ? -1 : static_cast<int>(indent.integer()),
                0, arg(rest, 3, kw, "sort_keys", Value(false)).truthy());
      const Value separators = arg(rest, 2, kw, "separators", Value::none());
      if (separators.is_list() && separators.list().size() == 2 &&
          (separators.list()[0].str() != ", " || separators.list()[1].str() != ": ")) {
        // Re-dump with the given separators (compact JSON: (",", ":")).
        out.clear();
        dump_json_with(out, v, separators.list()[0].str(), separators.list()[1].str());
      }
      return Value(out);
    }
    if (name == "indent") {
      const Value w = arg(rest, 0, kw, "width", Value(int64_t{4}));
      if (!w.is_string() && w.integer() > 4096) error(line, "indent wider than 4096");
      const std::string pad =
          w.is_string() ? w.string()
                        : std::string(static_cast<size_t>(std::max<int64_t>(0, w.integer())), ' ');
      const bool first = arg(rest, 1, kw, "first", Value(false)).truthy();
      const bool blank = arg(rest, 2, kw, "blank", Value(false)).truthy();
      // As jinja2: the text's lines (str.splitlines of it + "\n", so any line break becomes
      // "\n"), every one after the first indented (blank ones only when `blank`), the first
      // too when `first`.
      const std::vector<std::string> lines = split_lines(v.str() + "\n");
      std::string out = first ? pad : "";
      for (size_t i = 0; i < lines.size(); ++i) {
        if (i) out += (blank || !lines[i].empty()) ? "\n" + pad : "\n";
        out += lines[i];
        check_built(out.size(), "indent");
      }
      return v.is_markup() ? Value::markup(out) : Value(out);
    }
    // map, select, reject, selectattr and rejectattr yield nothing for a false value (None, an
    // empty string): jinja2 walks the value only `if value`.
    if (name == "map") {
      List out;
      const Value attr = arg({}, 0, kw, "attribute");
      for (const Value& x : v.truthy() ? iterate(v) : List{}) {
        if (!attr.is_undefined()) {
          Value got = item(x, attr, line);
          if (got.is_undefined()) got = arg({}, 0, kw, "default");
          out.push_back(got);
        } else {
          if (rest.empty()) error(line, "map needs a filter name or attribute=");
          std::vector<Value> fargs{x};
          fargs.insert(fargs.end(), rest.begin() + 1, rest.end());
          out.push_back(call_filter(rest[0].str(), fargs, {}, line));
        }
      }
      return Value(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      const bool by_attr = name == "selectattr" || name == "rejectattr";
      const bool keep_true = name == "select" || name == "selectattr";
      List out;
      for (const Value& x : v.truthy() ? iterate(v) : List{}) {
        Value subject = x;
        size_t at = 0;
        if (by_attr) {
          if (rest.empty()) error(line, name + " needs an attribute");
          subject = item(x, rest[0], line);
          at = 1;
        }
        bool r;
        if (at < rest.size()) {
          std::vector<Value> targs{subject};
          targs.insert(targs.end(), rest.begin() + static_cast<std::ptrdiff_t>(at) + 1, rest.end());
          r = call_test(rest[at].str(), targs, line);
        } else {
          r = subject.truthy();
        }
        if (r == keep_true) out.push_back(x);
      }
      return Value(std::move(out));
    }
    if (name == "batch") {
      const int64_t n = std::max<int64_t>(1, arg(rest, 0, kw, "linecount").integer());
      List out, cur;
      for (const Value& x : iterate(v)) {
        cur.push_back(x);
        if (static_cast<int64_t>(cur.size()) == n) {
          out.emplace_back(cur);
          cur.clear();
        }
      }
      if (!cur.empty()) out.emplace_back(cur);
      return Value(std::move(out));
    }
    if (name == "wordcount")
      return Value(static_cast<int64_t>(split(v.str(), Value::none(), -1).size()));
    if (name == "center") {
      const int64_t width = arg(rest, 0, kw, "width", Value(int64_t{80})).integer();
      if (width > 65536) error(line, "center wider than 65536");
      std::string s = v.str();
      const int64_t len = static_cast<int64_t>(code_points(s).size());
      if (len >= width) return Value(s);
      const int64_t margin = width - len;
      const int64_t left = margin / 2 + (margin & width & 1);  // as CPython's str.center
      return Value(std::string(static_cast<size_t>(left), ' ') + s +
                   std::string(static_cast<size_t>(width - len - left), ' '));
    }
    error(line, fmt::format("the filter '{}' is not supported", name));
  }

  bool call_test(const std::string& name, const std::vector<Value>& args, int line) {
    const Value v = args.empty() ? Value() : args[0];
    const Value other = args.size() > 1 ? args[1] : Value();
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "boolean") return v.kind() == Value::Kind::kBool;
    if (name == "true") return v.kind() == Value::Kind::kBool && v.boolean();
    if (name == "false") return v.kind() == Value::Kind::kBool && !v.boolean();
    if (name == "integer") return v.kind() == Value::Kind::kInt;
    if (name == "float") return v.kind() == Value::Kind::kFloat;
    if (name == "number") return v.is_number();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_dict();
    if (name == "iterable") return v.is_list() || v.is_dict() || v.is_string();
    if (name == "sequence") return v.is_list() || v.is_dict() || v.is_string();
    if (name == "callable") return v.kind() == Value::Kind::kFunction;
    if (name == "sameas")
      return (v.is_none() && other.is_none()) ||
             (v.kind() == Value::Kind::kBool && other.kind() == Value::Kind::kBool &&
              v.boolean() == other.boolean()) ||
             (v.is_list() && other.is_list() && &v.list() == &other.list()) ||
             (v.is_dict() && other.is_dict() && &v.dict() == &other.dict());
    if (name == "equalto" || name == "eq" || name == "==") return equal(v, other);
    if (name == "ne" || name == "!=") return !equal(v, other);
    if (name == "lt" || name == "lessthan" || name == "<") return compare_values(v, other) < 0;
    if (name == "le" || name == "<=") return compare_values(v, other) <= 0;
    if (name == "gt" || name == "greaterthan" || name == ">") return compare_values(v, other) > 0;
    if (name == "ge" || name == ">=") return compare_values(v, other) >= 0;
    if (name == "in") return contains(other, v);
    if (name == "odd" || name == "even") return (v.integer() % 2 != 0) == (name == "odd");
    if (name == "divisibleby") return other.integer() != 0 && v.integer() % other.integer() == 0;
    if (name == "lower" || name == "upper") {
      const std::string s = v.str();
      return std::none_of(s.begin(), s.end(), [&](char c) {
        return name == "lower" ? std::isupper(static_cast<unsigned char>(c))
                               : std::islower(static_cast<unsigned char>(c));
      });
    }
    if (name == "escaped") return false;
    error(line, fmt::format("the test '{}' is not supported", name));
  }

  // Loop iterations and macro calls one rendering may make: far beyond a chat's, short of a
  // template that would run for hours (loops in loops over long ranges, branching recursion).
  static constexpr int64_t kMaxSteps = 10'000'000;
  void step(int line) {
    if (++steps_ > kMaxSteps)
      error(line,
            fmt::format("the template runs more than {} loop steps and macro calls", kMaxSteps));
  }

  static constexpr int kMaxCalls = 100;
  static constexpr size_t kMaxText = kMaxTextBytes;

  std::string source_;
  std::vector<Scope> scopes_;
  int calls_ = 0;
  int64_t steps_ = 0;
};

}  // namespace

Template::Template(std::string_view text, std::string source) : source_(std::move(source)) {
  Scanner scanner(text, source_);
  Parser parser(scanner.run(), source_);
  root_ = parser.parse();
}

Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

Rendered Template::render(const Dict& context) const {
  Renderer r(source_, context);
  Output out;
  r.run(*root_, out);
  return {std::move(out.text), std::move(out.generation)};
}

}  // namespace zt::jinja
