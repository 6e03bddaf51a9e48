// Regular expressions a user gives (LoRA and Freeze targets, adapter_config.json's
// target_modules), matched by RE2 in time linear in the subject — never std::regex, whose
// backtracking hangs on `(.*.*)*x` and whose recursion overflows the stack on deep nesting.
#pragma once

#include <memory>
#include <string>
#include <string_view>

namespace re2 {
class RE2;
}

namespace zt {

class Pattern {
 public:
  /// Compiles `text` (RE2 syntax: Python's `re` less backreferences and lookaround) with
  /// bounded memory. A pattern RE2 refuses — a syntax error, a construct it does not take,
  /// nesting deeper than 1000, a program over its memory bound — is a ConfigError naming
  /// `what` (the option or file and key), the pattern (shortened) and RE2's reason.
  Pattern(const std::string& text, const std::string& what);
  ~Pattern();
  Pattern(Pattern&&) noexcept;
  Pattern& operator=(Pattern&&) noexcept;

  /// Whether the whole of `subject` matches (Python's re.fullmatch, as PEFT uses).
  bool full_match(std::string_view subject) const;
  /// Whether a prefix of `subject` matches (Python's re.match).
  bool prefix_match(std::string_view subject) const;

 private:
  std::unique_ptr<re2::RE2> re_;
};

}  // namespace zt
