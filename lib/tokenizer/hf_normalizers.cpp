// The normalizer steps of tokenizer.json, each as HF tokenizers' `normalizers` module applies
// it to a whole text. Character classes: Rust's char::is_whitespace (= text::is_space),
// char::to_lowercase (utf8proc's simple mapping plus U+0130's two-character one), and for
// BertNormalizer the unicode_categories 0.1.1 tables HF links (bert_categories.inc).
#include <algorithm>

#include <utf8proc.h>

#include "tokenizer/bpe_model.hpp"
#include "tokenizer/hf_tokenizer.hpp"
#include "tokenizer/precompiled_charsmap.hpp"

namespace zt::hf {
namespace {

struct CodeRange {
  uint32_t first, last;
};
#include "tokenizer/bert_categories.inc"

template <size_t N>
bool in(const CodeRange (&table)[N], uint32_t cp) {
  const CodeRange* it =
      std::upper_bound(std::begin(table), std::end(table), cp,
                       [](uint32_t c, const CodeRange& r) { return c < r.first; });
  return it != std::begin(table) && cp <= (it - 1)->last;
}

// Calls f(code point, its bytes) for each character of well-formed UTF-8.
template <typename F>
void for_each_char(std::string_view s, F&& f) {
  for (size_t i = 0; i < s.size();) {
    uint32_t len;
    const uint32_t cp = text::decode_at(s, i, len);
    f(cp, s.substr(i, len));
    i += len;
  }
}

// The length of the ASCII run `s` starts with.
size_t ascii_run(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && static_cast<unsigned char>(s[i]) < 0x80) ++i;
  return i;
}

// Calls ascii(run) for each maximal ASCII run of `s` and other(run) for each run of other
// characters between them: for the steps that leave ASCII alone or map it byte by byte.
template <typename Ascii, typename Other>
void by_runs(std::string_view s, Ascii&& ascii, Other&& other) {
  for (size_t i = 0; i < s.size();) {
    const size_t a = ascii_run(s.substr(i));
    if (a > 0) ascii(s.substr(i, a));
    i += a;
    size_t j = i;
    while (j < s.size() && static_cast<unsigned char>(s[j]) >= 0x80) ++j;
    if (j > i) other(s.substr(i, j - i));
    i = j;
  }
}

void lowercase(std::string_view s, std::string& out) {
  for_each_char(s, [&](uint32_t cp, std::string_view bytes) {
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp >= 'A' && cp <= 'Z' ? cp + 32 : cp));
    } else if (cp == 0x130) {  // İ: i + combining dot above, Rust's only multi-char lowercase
      out.append("i\xCC\x87");
    } else {
      const auto lower = static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp)));
      if (lower == cp) {
        out.append(bytes);
      } else {
        text::append_utf8(lower, out);
      }
    }
  });
}

bool is_mark(uint32_t cp) {
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
      return true;
    default:
      return false;
  }
}

// BertNormalizer's steps, in its order: clean_text, handle_chinese_chars, strip_accents (NFD,
// then without nonspacing marks), lowercase. Each acts on a character alone (NFD too, at the
// starters ASCII characters are), so ASCII runs take one pass and the rest the steps in turn.
void bert_steps(const NormalizerStep& step, std::string_view s, std::string& out);

void bert(const NormalizerStep& step, std::string_view s, std::string& out) {
  by_runs(
      s,
      [&](std::string_view run) {
        for (char c : run) {
          if (step.clean_text) {
            // NUL and the controls but tab, line feed and return go; other spaces become ' '.
            if (c == 0 || c == 0x7F || (c < 0x20 && c != '\t' && c != '\n' && c != '\r')) continue;
            if (c == '\t' || c == '\n' || c == '\r') c = ' ';
          }
          if (step.lowercase && c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
          out.push_back(c);
        }
      },
      [&](std::string_view run) { bert_steps(step, run, out); });
}

void bert_steps(const NormalizerStep& step, std::string_view s, std::string& out) {
  thread_local std::string a, b, nfd;
  a.clear();
  b.clear();
  std::string_view cur = s;
  if (step.clean_text) {
    for_each_char(cur, [&](uint32_t cp, std::string_view bytes) {
      const bool control = cp != '\t' && cp != '\n' && cp != '\r' &&
                           (cp < 0x20 || (cp >= 0x7F && cp <= 0x9F) || in(kBertCf, cp) ||
                            (cp >= 0xE000 && cp <= 0xF8FF) || (cp >= 0xF0000 && cp <= 0xFFFFD) ||
                            (cp >= 0x100000 && cp <= 0x10FFFD));
      if (cp == 0 || cp == 0xFFFD || control) return;
      if (text::is_space(cp)) {
        a.push_back(' ');
      } else {
        a.append(bytes);
      }
    });
    cur = a;
  }
  if (step.chinese_chars) {
    for_each_char(cur, [&](uint32_t cp, std::string_view bytes) {
      const bool chinese = (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0x3400 && cp <= 0x4DBF) ||
                           (cp >= 0x20000 && cp <= 0x2A6DF) || (cp >= 0x2A700 && cp <= 0x2B73F) ||
                           (cp >= 0x2B740 && cp <= 0x2B81F) || (cp >= 0x2B920 && cp <= 0x2CEAF) ||
                           (cp >= 0xF900 && cp <= 0xFAFF) || (cp >= 0x2F800 && cp <= 0x2FA1F);
      if (chinese) b.push_back(' ');
      b.append(bytes);
      if (chinese) b.push_back(' ');
    });
    a.swap(b);
    b.clear();
    cur = a;
  }
  if (step.strip_accents) {
    nfd.clear();
    text::normalize(cur, text::NormalForm::kNFD, nfd);
    for_each_char(nfd, [&](uint32_t cp, std::string_view bytes) {
      if (!in(kBertMn, cp)) b.append(bytes);
    });
    a.swap(b);
    cur = a;
  }
  if (step.lowercase) {
    lowercase(cur, out);
  } else {
    out.append(cur);
  }
}

void nmt(std::string_view s, std::string& out) {
  for_each_char(s, [&](uint32_t cp, std::string_view bytes) {
    if ((cp >= 0x01 && cp <= 0x08) || cp == 0x0B || (cp >= 0x0E && cp <= 0x1F) || cp == 0x7F ||
        cp == 0x8F || cp == 0x9F) {
      return;
    }
    const bool space = cp == 0x09 || cp == 0x0A || cp == 0x0C || cp == 0x0D || cp == 0x1680 ||
                       (cp >= 0x200B && cp <= 0x200F) || cp == 0x2028 || cp == 0x2029 ||
                       cp == 0x2581 || cp == 0xFEFF || cp == 0xFFFD;
    if (space) {
      out.push_back(' ');
    } else {
      out.append(bytes);
    }
  });
}

}  // namespace

void apply_normalizer(const NormalizerStep& step, std::string_view s, std::string& out) {
  switch (step.kind) {
    case NormalizerStep::kForm:
      text::normalize(s, step.form, out);
      break;
    case NormalizerStep::kPrepend:
      if (!s.empty()) out.append(step.text);
      out.append(s);
      break;
    case NormalizerStep::kReplace:
      replace_pattern(s, step.matcher.get(), step.text, step.content, out);
      break;
    case NormalizerStep::kLowercase:
      by_runs(
          s,
          [&](std::string_view run) {
            for (char c : run) out.push_back(c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c);
          },
          [&](std::string_view run) { lowercase(run, out); });
      break;
    case NormalizerStep::kStrip: {
      size_t begin = 0, end = s.size();
      uint32_t len;
      if (step.left) {
        while (begin < end && text::is_space(text::decode_at(s, begin, len))) begin += len;
      }
      if (step.right) {
        while (end > begin) {
          size_t k = end - 1;
          while (k > begin && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
          if (!text::is_space(text::decode_at(s, k, len))) break;
          end = k;
        }
      }
      out.append(s.substr(begin, end - begin));
      break;
    }
    case NormalizerStep::kStripAccents:
      by_runs(
          s, [&](std::string_view run) { out.append(run); },
          [&](std::string_view run) {
            for_each_char(run, [&](uint32_t cp, std::string_view bytes) {
              if (!is_mark(cp)) out.append(bytes);
            });
          });
      break;
    case NormalizerStep::kBert:
      bert(step, s, out);
      break;
    case NormalizerStep::kNmt:
      nmt(s, out);
      break;
    case NormalizerStep::kPrecompiled:
      step.charsmap->normalize(s, out);
      break;
    case NormalizerStep::kByteLevel:
      for (char c : s) text::append_utf8(byte_level::char_of(static_cast<uint8_t>(c)), out);
      break;
  }
}

void replace_pattern(std::string_view s, const text::Matcher* matcher, std::string_view literal,
                     std::string_view with, std::string& out) {
  if (matcher == nullptr) {
    size_t i = 0;
    for (size_t hit; (hit = s.find(literal, i)) != std::string_view::npos;
         i = hit + literal.size()) {
      out.append(s.data() + i, hit - i);
      out.append(with);
    }
    out.append(s.data() + i, s.size() - i);
    return;
  }
  thread_local std::vector<text::Span> matches;
  matches.clear();
  matcher->find(s, matches);
  size_t at = 0;
  for (const text::Span& m : matches) {
    out.append(s.data() + at, m.first - at);
    out.append(with);
    at = m.second;
  }
  out.append(s.data() + at, s.size() - at);
}

}  // namespace zt::hf
