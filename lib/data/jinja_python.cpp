// Python's operations on the Jinja interpreter's values that its evaluator and filters share:
// sequence indices and slices, type names, iteration, ordering and `in`, str's strip / split /
// replace / splitlines / case mapping, dict assignment, markupsafe's escaping, json.dumps, and
// call-argument lookup. Part of the interpreter split over lib/data/jinja*.cpp
// (jinja_internal.hpp lists the parts).
#include <fmt/format.h>
#include <utf8proc.h>

#include <algorithm>
#include <cmath>

#include "data/jinja_internal.hpp"
#include "tokenizer/unicode_text.hpp"
#include "zerotrain/error.hpp"

namespace zt::jinja {

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
          Value otherwise) {
  if (i < args.size()) return args[i];
  if (const Value* v = kwarg(kwargs, key)) return *v;
  return otherwise;
}

}  // namespace zt::jinja
