// Private to the Jinja interpreter (jinja.hpp): what its parts, lib/data/jinja*.cpp, share.
//   jinja_value.cpp    Value and Python's value semantics (truth, str / repr, ==, Markup), JSON in
//   jinja_scanner.cpp  template text → tokens (jinja2's whitespace rules)
//   jinja_parser.cpp   tokens → the tree (Node, Expr)
//   jinja_python.cpp   Python's operations the evaluator and filters share (slices, ordering,
//                      `in`, str operations, escaping, json.dumps)
//   jinja.cpp          Template, and the Renderer's statements and expressions
//   jinja_filters.cpp  the Renderer's attributes, str / dict methods, filters and tests
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "data/jinja.hpp"

namespace zt::jinja {

// ---- values (jinja_value.cpp) -------------------------------------------------------------

// UTF-8 → code points (bounds-checked: the text may be ill-formed), for Python's str indexing,
// slicing and len; back with text::append_utf8.
std::vector<uint32_t> code_points(std::string_view s);
std::string from_code_points(const std::vector<uint32_t>& cps);
// Python's repr of a float: the shortest text that reads back, with ".0" on integral values.
std::string float_repr(double d);

// Held while printing, comparing or dumping one level of a list or dict: past the nesting
// limit it throws ConfigError before the recursion exhausts the stack.
struct Nested {
  Nested();
  ~Nested();
  Nested(const Nested&) = delete;
  Nested& operator=(const Nested&) = delete;
};

// ---- scanner (jinja_scanner.cpp) ----------------------------------------------------------

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

[[noreturn]] void fail(const std::string& source, int line, const std::string& what);
bool is_space(char c);

std::vector<Token> scan(std::string_view text, std::string source);

// ---- tree (jinja_parser.cpp) -------------------------------------------------------------

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

NodePtr parse(std::vector<Token> tokens, std::string source);

// ---- Python's operations (jinja_python.cpp) -----------------------------------------------

std::optional<size_t> index_of(int64_t i, size_t size);
std::vector<size_t> slice_indices(const Value& start, const Value& stop, const Value& step,
                                  size_t size);
std::string type_name(const Value& v);
List iterate(const Value& v);
int compare_values(const Value& a, const Value& b);
bool contains(const Value& container, const Value& item);
std::string strip(const std::string& s, const Value& chars, bool left, bool right);
List split(const std::string& s, const Value& sep, int64_t maxsplit);

// What a template may write or build at most (a chat is far below): a runaway repetition
// is an error, not an allocation that takes the machine.
constexpr size_t kMaxTextBytes = size_t{64} << 20;

void check_built(size_t size, const char* what);
std::string replace_all(const std::string& s, const std::string& from, const std::string& to,
                        int64_t count);
std::vector<std::string> split_lines(const std::string& s);
void set_key(Dict& d, const Value& key, Value v);
std::string escape_html(const std::string& s);
Value escaped(const Value& v);
std::string change_case(const std::string& s, bool upper);
Value ignore_case(const Value& v);
std::string json_key(const Value& k);
void dump_json(std::string& out, const Value& v, int indent, int depth, bool sort_keys);
void dump_json_with(std::string& out, const Value& v, const std::string& item,
                    const std::string& key);
const Value* kwarg(const Kwargs& kwargs, const char* key);
Value arg(const std::vector<Value>& args, size_t i, const Kwargs& kwargs, const char* key,
          Value otherwise = Value());

// ---- evaluation (jinja.cpp, jinja_filters.cpp) --------------------------------------------

enum class Flow { kNormal, kBreak, kContinue };

struct Output {
  std::string text;
  std::vector<std::pair<size_t, size_t>> generation;
};

// The evaluator: the tree + a context → text, for one render() call.
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

  void install_globals();
  Value lookup(const std::string& name) const;

  void assign(const std::string& name, Value v) { scopes_.back()[name] = std::move(v); }

  // ---- statements (jinja.cpp) ----

  Flow exec(const Node& n, Output& out);
  std::string print(const Value& v, int line) const;
  Value apply_filters(const Expr& e, const Value& v);
  void assign_target(const Expr& target, const Value& v, int line);
  Flow exec_for(const Node& n, Output& out);
  Value make_macro(const Node& n);

  // ---- expressions (jinja.cpp) ----

  Kwargs eval_kwargs(const Expr& e);
  Value eval(const Expr& e);
  Value eval_inner(const Expr& e);
  Value binary(const std::string& op, const Value& a, const Value& b, int line);
  Value item(const Value& obj, const Value& key, int line);

  // ---- attributes, methods, filters and tests (jinja_filters.cpp) ----

  Value attribute(const Value& obj, const std::string& name, int line);
  Value string_method(const Value& self, const std::string& name, int line);
  Value call_filter(const std::string& name, std::vector<Value> args, const Kwargs& kw, int line);
  bool call_test(const std::string& name, const std::vector<Value>& args, int line);

  // Loop iterations and macro calls one rendering may make: far beyond a chat's, short of a
  // template that would run for hours (loops in loops over long ranges, branching recursion).
  static constexpr int64_t kMaxSteps = 10'000'000;
  void step(int line);

  static constexpr int kMaxCalls = 100;
  static constexpr size_t kMaxText = kMaxTextBytes;

  std::string source_;
  std::vector<Scope> scopes_;
  int calls_ = 0;
  int64_t steps_ = 0;
};

}  // namespace zt::jinja
