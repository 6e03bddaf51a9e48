// The Jinja interpreter's scanner: template text → text and tag tokens, with jinja2's
// whitespace rules (trim_blocks, lstrip_blocks, `-` and `+`) and Python's string escapes. Part
// of the interpreter split over lib/data/jinja*.cpp (jinja_internal.hpp lists the parts).
#include <fmt/format.h>

#include <cctype>

#include "data/jinja_internal.hpp"
#include "tokenizer/unicode_text.hpp"
#include "zerotrain/error.hpp"

namespace zt::jinja {

[[noreturn]] void fail(const std::string& source, int line, const std::string& what) {
  throw ConfigError(fmt::format("{}: chat template, line {}: {}", source, line, what));
}

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

namespace {

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

std::vector<Token> scan(std::string_view text, std::string source) {
  return Scanner(text, std::move(source)).run();
}

}  // namespace zt::jinja
