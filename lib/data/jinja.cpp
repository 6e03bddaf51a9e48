// See jinja.hpp. The interpreter is split over lib/data/jinja*.cpp (jinja_internal.hpp lists
// the parts); this file holds the Template and the evaluator's statements and expressions (the
// tree + a context → text): globals, scopes, if / for / set / macro / filter / generation
// blocks, operators and item access.
#include "data/jinja.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <limits>

#include "data/jinja_internal.hpp"
#include "zerotrain/error.hpp"

namespace zt::jinja {

void Renderer::install_globals() {
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

Value Renderer::lookup(const std::string& name) const {
  for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
    auto f = it->find(name);
    if (f != it->end()) return f->second;
  }
  return Value::undefined(name);
}

// ---- statements ----

Flow Renderer::exec(const Node& n, Output& out) {
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

std::string Renderer::print(const Value& v, int line) const {
  try {
    return v.str();
  } catch (const ConfigError& e) {  // a value nested too deep to print
    error(line, e.what());
  }
}

// A filter chain whose innermost argument is null (set / filter blocks) applied to `v`.
Value Renderer::apply_filters(const Expr& e, const Value& v) {
  if (e.kind != Expr::Kind::kFilter) return v;
  const Value inner = e.args[0] ? apply_filters(*e.args[0], v) : v;
  std::vector<Value> args{inner};
  for (size_t i = 1; i < e.args.size(); ++i) args.push_back(eval(*e.args[i]));
  return call_filter(e.name, args, eval_kwargs(e), e.line);
}

void Renderer::assign_target(const Expr& target, const Value& v, int line) {
  if (target.kind == Expr::Kind::kName) {
    assign(target.name, v);
  } else if (target.kind == Expr::Kind::kAttr) {
    const Value ns = eval(*target.args[0]);
    if (ns.kind() != Value::Kind::kNamespace)
      error(line,
            fmt::format("cannot assign the attribute '{}' of a non-namespace object", target.name));
    set_key(ns.mutable_dict(), Value(target.name), v);
  } else {  // a tuple of names
    const List items = iterate(v);
    if (items.size() != target.args.size())
      error(line,
            fmt::format("cannot unpack {} values into {} names", items.size(), target.args.size()));
    for (size_t i = 0; i < items.size(); ++i) assign(target.args[i]->name, items[i]);
  }
}

Flow Renderer::exec_for(const Node& n, Output& out) {
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

Value Renderer::make_macro(const Node& n) {
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

Kwargs Renderer::eval_kwargs(const Expr& e) {
  Kwargs kw;
  for (const auto& [k, v] : e.kwargs) kw.emplace_back(k, eval(*v));
  return kw;
}

Value Renderer::eval(const Expr& e) {
  try {
    return eval_inner(e);
  } catch (const ConfigError& err) {
    const std::string what = err.what();
    if (what.rfind(source_ + ": chat template", 0) == 0) throw;
    error(e.line, what);
  }
}

Value Renderer::eval_inner(const Expr& e) {
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
        for (size_t i : slice_indices(a, b, c, obj.list().size())) picked.push_back(obj.list()[i]);
        return obj.is_tuple() ? Value::tuple(std::move(picked)) : Value(std::move(picked));
      }
      if (obj.is_undefined()) error(e.line, fmt::format("'{}' is undefined", obj.undefined_name()));
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

Value Renderer::binary(const std::string& op, const Value& a, const Value& b, int line) {
  const auto bounded = [&](size_t size) {
    if (size > kMaxText)
      error(line, fmt::format("'{}' builds a value larger than a chat template may (64 MiB)", op));
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
        error(line, fmt::format("'{}' * {} is larger than a chat template may build", type_name(*s),
                                times));
      if (s->is_string()) {
        std::string out;
        for (int64_t i = 0; i < times; ++i) out += s->string();
        return s->is_markup() ? Value::markup(out) : Value(out);
      }
      List out;
      for (int64_t i = 0; i < times; ++i) out.insert(out.end(), s->list().begin(), s->list().end());
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

Value Renderer::item(const Value& obj, const Value& key, int line) {
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

void Renderer::step(int line) {
  if (++steps_ > kMaxSteps)
    error(line,
          fmt::format("the template runs more than {} loop steps and macro calls", kMaxSteps));
}

Template::Template(std::string_view text, std::string source) : source_(std::move(source)) {
  root_ = parse(scan(text, source_), source_);
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
