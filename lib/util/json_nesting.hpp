// JSON's bracket structure over a stream of characters, strings skipped: the one scan behind
// json::check_depth (nesting limit before parsing) and the JSON-array record reader (where one
// element ends). Not a validator: it only follows brackets and string quotes.
#pragma once

namespace zt::json {

class NestingScanner {
 public:
  /// +1 for `{` or `[` outside a string, -1 for `}` or `]` outside a string, else 0.
  int feed(int c) {
    if (in_string_) {
      if (escaped_) {
        escaped_ = false;
      } else if (c == '\\') {
        escaped_ = true;
      } else if (c == '"') {
        in_string_ = false;
      }
      return 0;
    }
    if (c == '"') in_string_ = true;
    if (c == '{' || c == '[') return 1;
    if (c == '}' || c == ']') return -1;
    return 0;
  }
  /// Whether the last character fed was inside a string (or its closing quote's opening).
  bool in_string() const { return in_string_; }

 private:
  bool in_string_ = false, escaped_ = false;
};

}  // namespace zt::json
