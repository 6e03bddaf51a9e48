// The Jinja interpreter's attributes, methods, filters and tests: a dict's items / keys /
// values / get, str's methods (markupsafe's on Markup), jinja2's filters (with transformers'
// tojson) and tests, as Renderer members. Part of the interpreter split over lib/data/jinja*.cpp
// (jinja_internal.hpp lists the parts).
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <iterator>

#include "data/jinja_internal.hpp"
#include "zerotrain/error.hpp"

namespace zt::jinja {

// obj.name: a dict's member, else a method of a string, list or dict.
Value Renderer::attribute(const Value& obj, const std::string& name, int line) {
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
Value Renderer::string_method(const Value& self, const std::string& name, int line) {
  static const char* const kMethods[] = {
      "strip", "lstrip", "rstrip",  "split",   "rsplit",     "startswith", "endswith",
      "upper", "lower",  "replace", "title",   "capitalize", "join",       "find",
      "count", "format", "isdigit", "isspace", "splitlines"};
  if (std::find_if(std::begin(kMethods), std::end(kMethods),
                   [&](const char* m) { return name == m; }) == std::end(kMethods))
    return Value::undefined(name);
  (void)line;
  const bool markup = self.is_markup();
  return Value::function(
      [s = self.string(), name, markup](const std::vector<Value>& a, const Kwargs& kw) -> Value {
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

Value Renderer::call_filter(const std::string& name, std::vector<Value> args, const Kwargs& kw,
                            int line) {
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

bool Renderer::call_test(const std::string& name, const std::vector<Value>& args, int line) {
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

}  // namespace zt::jinja
