// A Jinja2 interpreter for chat templates: the language subset Hugging Face chat templates use,
// rendered as transformers renders them (jinja2's ImmutableSandboxedEnvironment with
// trim_blocks, lstrip_blocks and loop controls; its tojson, raise_exception and strftime_now).
//
// Statements: text, {{ expr }}, {# comments #}, if / elif / else, for (tuple targets, `if`
// filters, else, loop.*, break / continue), set (names, namespace attributes, tuples, blocks),
// macro (positional and keyword parameters with defaults), filter blocks, generation blocks
// (transformers' assistant-token marks: recorded as spans of the output), whitespace control
// with `-` and `+`. Expressions: literals (strings, numbers, lists, tuples, dicts, true / false /
// none in either case), names, attributes and items, Python slices, calls with keyword
// arguments, filters and tests, `not`, `and`, `or`, comparisons, `in` / `not in`, arithmetic, `~`
// and the conditional expression. Values follow Python's semantics (truth, equality, printing:
// True / None / 1.0, str methods on code points, dict keys of any hashable type, tuples) and
// markupsafe's for `|safe` text (Markup: what is added to it is HTML-escaped). Not built:
// inheritance, includes, imports, call blocks, recursive loops — a template using one is refused
// when parsed, naming the line.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace zt::jinja {

class Value;
using List = std::vector<Value>;
/// A dict: keys in insertion order, as Python's. Keys are strings, numbers, bools, None or
/// tuples, compared as Python compares them (1, 1.0 and True are one key).
using Dict = std::vector<std::pair<Value, Value>>;
using Kwargs = std::vector<std::pair<std::string, Value>>;
using Function = std::function<Value(const std::vector<Value>& args, const Kwargs& kwargs)>;

/// A value of the template language. Lists, dicts and namespaces are shared handles (as
/// Python's references); everything else is by value.
class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kFunction
  };

  Value() = default;  ///< undefined
  static Value none();
  Value(bool b);                                    // NOLINT(google-explicit-constructor)
  Value(int64_t i);                                 // NOLINT(google-explicit-constructor)
  Value(int i) : Value(static_cast<int64_t>(i)) {}  // NOLINT(google-explicit-constructor)
  Value(double d);                                  // NOLINT(google-explicit-constructor)
  Value(std::string s);                             // NOLINT(google-explicit-constructor)
  Value(const char* s) : Value(std::string(s)) {}   // NOLINT(google-explicit-constructor)
  Value(List l);                                    // NOLINT(google-explicit-constructor)
  /// Throws ConfigError for a key that is a list (not a tuple), dict or namespace (unhashable
  /// in Python).
  Value(Dict d);  // NOLINT(google-explicit-constructor)
  /// markupsafe's Markup: text marked safe (`|safe`, `|escape`). A plain string added to it,
  /// or joined or formatted into it, is HTML-escaped first; its str methods keep the mark.
  static Value markup(std::string s);
  /// A tuple: a list that prints as Python's tuple (`(1, 'a')`) and equals no list.
  static Value tuple(List l);
  static Value function(Function f);
  static Value make_namespace(Dict attributes);
  /// `undefined` named: what an error about using it says.
  static Value undefined(std::string name);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_markup() const { return kind_ == Kind::kString && markup_; }
  bool is_number() const {
    return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool;
  }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_tuple() const { return kind_ == Kind::kList && tuple_; }
  bool is_dict() const { return kind_ == Kind::kDict || kind_ == Kind::kNamespace; }

  bool boolean() const { return b_; }
  int64_t integer() const;
  double number() const;
  const std::string& string() const { return s_; }
  const List& list() const { return *list_; }
  List& mutable_list() const { return *list_; }
  const Dict& dict() const { return *dict_; }
  Dict& mutable_dict() const { return *dict_; }
  const Function& fn() const { return *fn_; }
  const std::string& undefined_name() const { return s_; }
  /// How many lists, dicts and namespaces deep the value is (0: a scalar). Building one past
  /// 256 is a ConfigError, so printing, comparing and destroying never recurse deeper.
  int nesting() const { return nesting_; }

  /// Python's truth value.
  bool truthy() const;
  /// The member `key` of a dict or namespace, else undefined.
  Value get(const std::string& key) const;
  /// The member under any key (Python's d[key]) of a dict or namespace, else undefined.
  Value item(const Value& key) const;
  /// Python's str(): what {{ value }} prints.
  std::string str() const;
  /// Python's repr() (inside lists and dicts when printed).
  std::string repr() const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  int64_t i_ = 0;
  double d_ = 0;
  bool markup_ = false;  // a string marked safe
  bool tuple_ = false;   // a list that is a tuple
  std::string s_;        // the string, or an undefined value's name
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Function> fn_;
  int nesting_ = 0;
};

/// Python's ==.
bool equal(const Value& a, const Value& b);

/// Python's str.isspace for one code point (what str.strip / split strip).
bool is_python_space(uint32_t cp);

/// A JSON text (a chat's messages, tools) as a Value; throws ConfigError naming `source`.
Value from_json(std::string_view text, const std::string& source);

/// What rendering produced: the text, and the byte spans of {% generation %} blocks in it.
struct Rendered {
  std::string text;
  std::vector<std::pair<size_t, size_t>> generation;
};

struct Node;

/// A parsed template. Parsing refuses what the interpreter does not build; rendering throws
/// ConfigError for a template error (an undefined value used where it cannot be, a wrong type,
/// raise_exception), naming `source` and the line. Immutable after parsing; render() may run
/// from any thread.
class Template {
 public:
  Template(std::string_view text, std::string source);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  /// Renders with `context` (a dict of global names: messages, add_generation_prompt,
  /// bos_token, ...). raise_exception, strftime_now, range, namespace and dict are provided.
  Rendered render(const Dict& context) const;
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::shared_ptr<const Node> root_;
};

}  // namespace zt::jinja
