// The Jinja interpreter's parser: tokens → a tree of statements and expressions (Node, Expr),
// refusing what the interpreter does not build and trees nested past its depth limit. Part of
// the interpreter split over lib/data/jinja*.cpp (jinja_internal.hpp lists the parts).
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <initializer_list>

#include "data/jinja_internal.hpp"

namespace zt::jinja {

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
          if (parts[colons]) fail(source_, peek().line, "expected ':' or ']' in a subscript");
          parts[colons] = expression();
        }
        ++i_;
        if (colons == 0) {
          if (!parts[0]) fail(source_, e->line, "an empty subscript '[]': expected an index");
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

}  // namespace

NodePtr parse(std::vector<Token> tokens, std::string source) {
  return Parser(std::move(tokens), std::move(source)).parse();
}

}  // namespace zt::jinja
