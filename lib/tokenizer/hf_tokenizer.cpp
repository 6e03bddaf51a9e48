// The tokenizer.json pipeline: added tokens → normalizer → added tokens matched after
// normalization → pre-tokenizer → BPE, and ids → tokens → decoder chain → text; as HF
// tokenizers' `TokenizerImpl::encode` / `decode` do it, with the same per-segment rules.
#include "tokenizer/hf_tokenizer.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "tokenizer/bpe_model.hpp"
#include "util/files.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"

namespace zt {
namespace {

// Added tokens found by leftmost-longest matching, as HF's Aho-Corasick automaton does:
// candidates bucketed by their first byte, longest first.
struct AddedMatcher {
  std::vector<std::string> patterns;  // what is matched (content, or normalized content)
  std::vector<const hf::AddedToken*> tokens;
  std::array<std::vector<uint32_t>, 256> by_first_byte;
  int single_first_byte = -1;  // when all patterns start with the same byte: memchr for it

  void build() {
    for (uint32_t i = 0; i < patterns.size(); ++i) {
      by_first_byte[static_cast<unsigned char>(patterns[i][0])].push_back(i);
    }
    int distinct = 0;
    for (int b = 0; b < 256; ++b) {
      auto& bucket = by_first_byte[b];
      std::stable_sort(bucket.begin(), bucket.end(), [&](uint32_t x, uint32_t y) {
        return patterns[x].size() > patterns[y].size();
      });
      if (!bucket.empty()) {
        ++distinct;
        single_first_byte = b;
      }
    }
    if (distinct != 1) single_first_byte = -1;
  }
  bool empty() const { return patterns.empty(); }
};

// The last / first character of a string, as Rust's regex `\w$` and `^\w` see it.
bool ends_with_word(std::string_view s) {
  if (s.empty()) return false;
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  uint32_t len;
  return text::is_word_char(text::decode_at(s, i, len));
}

bool starts_with_word(std::string_view s) {
  uint32_t len;
  return !s.empty() && text::is_word_char(text::decode_at(s, 0, len));
}

// Where the whitespace at the end of `s` starts (`\s*$`), and how long the whitespace at the
// start of `s` is (`^\s*`).
size_t trailing_space_start(std::string_view s) {
  size_t i = s.size();
  while (i > 0) {
    size_t k = i - 1;
    while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
    uint32_t len;
    if (!text::is_space(text::decode_at(s, k, len))) break;
    i = k;
  }
  return i;
}

size_t leading_space_length(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    uint32_t len;
    if (!text::is_space(text::decode_at(s, i, len))) break;
    i += len;
  }
  return i;
}

std::string hex64(uint64_t v) {
  return fmt::format("{:016x}", v);
}

}  // namespace

struct HfTokenizer::Segment {
  uint32_t begin;
  uint32_t end;
  int32_t id;  // an added token's id, or -1 for text
};

struct HfTokenizer::Impl {
  AddedMatcher raw;         // added tokens with normalized: false, matched in the input
  AddedMatcher normalized;  // normalized: true, matched in the normalized text
  StringIdMap added_ids;    // content → id
  std::vector<const std::string*> id_token;  // the token of each id (added tokens win)
  std::vector<uint8_t> skip;                 // left out by decode(..., skip_special_tokens)
  // The pre-tokenizer is one Split (optionally before a plain ByteLevel): no text rewriting.
  std::optional<text::SplitPattern> split_only;
  bool no_pre_tokenizer = false;
};

// Scratch buffers of one encode call, kept per thread so encoding allocates only its result.
namespace {
struct Piece {
  uint32_t begin, end;
  bool first;  // starts the input (Metaspace's prepend_scheme "first")
};
struct EncodeScratch {
  std::string repaired, normalized, normalize_tmp;
  std::string arenas[2];
  std::vector<text::Span> spans, matches;
  std::vector<Piece> pieces, next_pieces;
};
thread_local EncodeScratch scratch;
}  // namespace

HfTokenizer::HfTokenizer(hf::TokenizerJson spec)
    : spec_(std::move(spec)), impl_(std::make_unique<Impl>()) {
  const TokenModel& model = *spec_.model;
  id_end_ = model.id_end();
  for (const hf::AddedToken& t : spec_.added) id_end_ = std::max<int64_t>(id_end_, t.id + 1);
  impl_->id_token.assign(static_cast<size_t>(id_end_), nullptr);
  impl_->skip.assign(static_cast<size_t>(id_end_), 0);
  for (int32_t id = 0; id < model.id_end(); ++id) impl_->id_token[id] = model.token(id);
  for (const hf::AddedToken& t : spec_.added) {
    impl_->id_token[t.id] = &t.content;
    impl_->added_ids.insert(t.content, t.id);
  }
  // HF checks decoded token strings against the special ones; an added token that is also in
  // the vocabulary has the vocabulary's id, so the string has this one id.
  for (const hf::AddedToken& t : spec_.added) {
    if (t.special) impl_->skip[t.id] = 1;
  }
  for (const hf::AddedToken& t : spec_.added) {
    AddedMatcher& m = t.normalized ? impl_->normalized : impl_->raw;
    std::string pattern;
    if (t.normalized && !spec_.normalizers.empty()) {
      normalize(t.content, pattern);
    } else {
      pattern = t.content;
    }
    if (pattern.empty()) continue;
    m.patterns.push_back(std::move(pattern));
    m.tokens.push_back(&t);
  }
  impl_->raw.build();
  impl_->normalized.build();
  const auto& steps = spec_.pre_tokenizers;
  impl_->no_pre_tokenizer = steps.empty();
  const bool plain_byte_level = [](const hf::PreTokenizerStep& s) {
    return s.kind == hf::PreTokenizerStep::kByteLevel && !s.add_prefix_space && !s.use_regex;
  }(steps.empty() ? hf::PreTokenizerStep{hf::PreTokenizerStep::kSplit} : steps.back());
  const auto hand_written = [](const hf::PreTokenizerStep& s) {
    return s.kind == hf::PreTokenizerStep::kSplit && !s.matcher;
  };
  if (steps.size() == 1 && hand_written(steps[0])) {
    impl_->split_only = steps[0].pattern;
  } else if (steps.size() == 2 && hand_written(steps[0]) && plain_byte_level) {
    impl_->split_only = steps[0].pattern;
  } else if (steps.size() == 1 && steps[0].kind == hf::PreTokenizerStep::kByteLevel &&
             !steps[0].add_prefix_space) {
    if (steps[0].use_regex) {
      impl_->split_only = text::SplitPattern::kGpt2;
    } else {
      impl_->no_pre_tokenizer = true;
    }
  }
}

HfTokenizer::~HfTokenizer() = default;

std::shared_ptr<HfTokenizer> HfTokenizer::load(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(dir) / "tokenizer.json").string();
  std::optional<hf::ClassPipeline> pipeline = hf::class_pipeline(dir);
  if (pipeline) {
    log::debug(
        "'{}': transformers 5 builds {}'s normalizer, pre-tokenizer and decoder itself; zerotrain "
        "does "
        "the same (docs/tokenizers.md)",
        dir, pipeline->name);
  }
  auto tokenizer = std::make_shared<HfTokenizer>(hf::read_tokenizer_json(path, pipeline));
  if (const auto& t = tokenizer->spec_.post_template) {
    // The post-processor's ids go straight into batches: each must be a token of this tokenizer.
    for (const std::vector<int32_t>* ids : {&t->before, &t->after}) {
      for (int32_t id : *ids) {
        if (id < 0 || id >= tokenizer->id_end_) {
          throw ConfigError(
              fmt::format("'{}': post_processor: the template's special token id {} is outside the "
                          "vocabulary [0, {})",
                          path, id, tokenizer->id_end_));
        }
      }
    }
  }
  tokenizer->special_ = hf::read_special_tokens(dir, *tokenizer, tokenizer->spec_.post_template);
  for (int32_t id :
       {tokenizer->special_.bos_id, tokenizer->special_.eos_id, tokenizer->special_.pad_id}) {
    if (id >= 0 && id < tokenizer->id_end_) tokenizer->impl_->skip[id] = 1;
  }
  // Everything encode and the special tokens depend on is in these files.
  std::string key = "hf-tokenizer-v2";  // v2: transformers 5's class pipelines
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}) {
    const fs::path file = fs::path(dir) / name;
    std::error_code ec;
    const std::string content =
        fs::exists(file, ec)
            ? files::read_text(file.string(), "tokenizer file", files::kMaxTokenizerBytes)
            : std::string();
    key += fmt::format(":{}={}", name, hex64(hash_bytes(content)));
  }
  tokenizer->fingerprint_ = key;
  return tokenizer;
}

int32_t HfTokenizer::token_id(std::string_view token) const {
  const int32_t id = impl_->added_ids.find(token);
  return id >= 0 ? id : spec_.model->token_id(token);
}

// ---- encoding ------------------------------------------------------------------------------

void HfTokenizer::find_added(std::string_view text, bool normalized_set,
                             std::vector<Segment>& out) const {
  const AddedMatcher& m = normalized_set ? impl_->normalized : impl_->raw;
  const size_t n = text.size();
  size_t start_offset = 0;
  size_t i = 0;
  while (i < n) {
    if (m.single_first_byte >= 0) {
      const void* hit = std::memchr(text.data() + i, m.single_first_byte, n - i);
      if (hit == nullptr) break;
      i = static_cast<size_t>(static_cast<const char*>(hit) - text.data());
    }
    const auto& bucket = m.by_first_byte[static_cast<unsigned char>(text[i])];
    const uint32_t* found = nullptr;
    for (const uint32_t& k : bucket) {
      const std::string& p = m.patterns[k];
      if (p.size() <= n - i && std::memcmp(text.data() + i, p.data(), p.size()) == 0) {
        found = &k;
        break;
      }
    }
    if (found == nullptr) {
      ++i;
      continue;
    }
    const hf::AddedToken& token = *m.tokens[*found];
    size_t start = i, stop = i + m.patterns[*found].size();
    i = stop;  // the automaton goes on after the match, whatever is done with it
    if (token.single_word) {
      const bool space_before = start == 0 || !ends_with_word(text.substr(0, start));
      const bool space_after = stop == n || !starts_with_word(text.substr(stop));
      if (!space_before || !space_after) continue;
    }
    if (token.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), start_offset);
    if (token.rstrip) stop += leading_space_length(text.substr(stop));
    if (start_offset < start) {
      out.push_back(Segment{uint32_t(start_offset), uint32_t(start), -1});
    }
    out.push_back(Segment{uint32_t(start), uint32_t(stop), token.id});
    start_offset = stop;
  }
  if (start_offset < n) out.push_back(Segment{uint32_t(start_offset), uint32_t(n), -1});
}

void HfTokenizer::normalize(std::string_view in, std::string& out) const {
  out.assign(in.data(), in.size());
  std::string& tmp = scratch.normalize_tmp;
  for (const hf::NormalizerStep& step : spec_.normalizers) {
    tmp.clear();
    hf::apply_normalizer(step, out, tmp);
    out.swap(tmp);
  }
}

std::vector<int32_t> HfTokenizer::encode(std::string_view input) const {
  std::vector<int32_t> ids;
  ids.reserve(input.size() / 3 + 4);
  std::string_view text = input;
  if (!text::is_valid_utf8(text)) {  // as Python would read the bytes with errors="replace"
    scratch.repaired.clear();
    text::append_lossy_utf8(input, scratch.repaired);
    text = scratch.repaired;
  }
  if (impl_->raw.empty()) {
    if (!text.empty()) encode_normalized(text, true, ids);
    return ids;
  }
  std::vector<Segment> segments;
  find_added(text, false, segments);
  for (const Segment& s : segments) {
    if (s.id >= 0) {
      ids.push_back(s.id);
    } else if (s.end > s.begin) {
      encode_normalized(text.substr(s.begin, s.end - s.begin), s.begin == 0, ids);
    }
  }
  return ids;
}

// One piece of input between added tokens: normalize it, extract the normalized added
// tokens, pre-tokenize and encode the rest.
void HfTokenizer::encode_normalized(std::string_view piece, bool at_start,
                                    std::vector<int32_t>& ids) const {
  std::string_view text = piece;
  if (!spec_.normalizers.empty()) {
    normalize(piece, scratch.normalized);
    text = scratch.normalized;
  }
  if (impl_->normalized.empty()) {
    pre_tokenize_and_encode(text, at_start, ids);
  } else {
    std::vector<Segment> segments;
    find_added(text, true, segments);
    for (const Segment& s : segments) {
      if (s.id >= 0) {
        ids.push_back(s.id);
      } else if (s.end > s.begin) {
        pre_tokenize_and_encode(text.substr(s.begin, s.end - s.begin), at_start && s.begin == 0,
                                ids);
      }
    }
  }
}

void HfTokenizer::pre_tokenize_and_encode(std::string_view text, bool at_start,
                                          std::vector<int32_t>& ids) const {
  const TokenModel& model = *spec_.model;
  if (text.empty()) return;
  if (impl_->no_pre_tokenizer) {
    model.encode_piece(text, ids);
    return;
  }
  if (impl_->split_only) {
    std::vector<text::Span>& spans = scratch.spans;
    spans.clear();
    text::split_with_pattern(*impl_->split_only, text, 0, spans);
    for (const text::Span& s : spans)
      model.encode_piece(text.substr(s.first, s.second - s.first), ids);
    return;
  }
  // The general case: pieces over a text that Metaspace and ByteLevel's prefix space rewrite
  // into the two arenas in turn.
  std::string_view base = text;
  int arena = 0;
  std::vector<Piece>& pieces = scratch.pieces;
  std::vector<Piece>& next = scratch.next_pieces;
  pieces.assign(1, Piece{0, static_cast<uint32_t>(text.size()), at_start});
  auto split = [&](text::SplitPattern pattern) {
    next.clear();
    for (const Piece& p : pieces) {
      scratch.spans.clear();
      text::split_with_pattern(pattern, base.substr(p.begin, p.end - p.begin), p.begin,
                               scratch.spans);
      for (size_t k = 0; k < scratch.spans.size(); ++k) {
        next.push_back(Piece{scratch.spans[k].first, scratch.spans[k].second, p.first && k == 0});
      }
    }
    pieces.swap(next);
  };
  for (const hf::PreTokenizerStep& step : spec_.pre_tokenizers) {
    if (step.kind == hf::PreTokenizerStep::kSplit && step.matcher) {
      next.clear();
      for (const Piece& p : pieces) {
        scratch.spans.clear();
        text::split_by(*step.matcher, step.behavior, step.invert,
                       base.substr(p.begin, p.end - p.begin), p.begin, scratch.spans,
                       scratch.matches);
        for (size_t k = 0; k < scratch.spans.size(); ++k) {
          next.push_back(Piece{scratch.spans[k].first, scratch.spans[k].second, p.first && k == 0});
        }
      }
      pieces.swap(next);
      continue;
    }
    if (step.kind == hf::PreTokenizerStep::kSplit) {
      split(step.pattern);
      continue;
    }
    std::string& out = scratch.arenas[arena];
    arena ^= 1;
    out.clear();
    next.clear();
    for (const Piece& p : pieces) {
      const std::string_view s = base.substr(p.begin, p.end - p.begin);
      if (s.empty()) continue;
      const auto begin = static_cast<uint32_t>(out.size());
      if (step.kind == hf::PreTokenizerStep::kByteLevel) {
        if (step.add_prefix_space && s[0] != ' ') out.push_back(' ');
        out.append(s);
        next.push_back(Piece{begin, static_cast<uint32_t>(out.size()), p.first});
        continue;
      }
      // Metaspace: spaces become the replacement, which may be prepended, and may start pieces.
      const std::string& rep = step.replacement;
      const bool starts_with_rep = s[0] == ' ' || s.substr(0, rep.size()) == rep;
      const bool prepend =
          !starts_with_rep && (step.prepend == hf::PreTokenizerStep::Prepend::kAlways ||
                               (step.prepend == hf::PreTokenizerStep::Prepend::kFirst && p.first));
      if (prepend) out.append(rep);
      hf::replace_pattern(s, nullptr, " ", rep, out);
      const auto end = static_cast<uint32_t>(out.size());
      if (!step.split) {
        next.push_back(Piece{begin, end, p.first});
        continue;
      }
      uint32_t piece_begin = begin;
      const std::string_view written(out.data() + begin, end - begin);
      for (size_t hit = written.find(rep, 1); hit != std::string_view::npos;
           hit = written.find(rep, hit + rep.size())) {
        next.push_back(Piece{piece_begin, begin + static_cast<uint32_t>(hit),
                             p.first && piece_begin == begin});
        piece_begin = begin + static_cast<uint32_t>(hit);
      }
      next.push_back(Piece{piece_begin, end, p.first && piece_begin == begin});
    }
    base = out;
    pieces.swap(next);
    if (step.kind == hf::PreTokenizerStep::kByteLevel && step.use_regex) split(step.pattern);
  }
  for (const Piece& p : pieces) model.encode_piece(base.substr(p.begin, p.end - p.begin), ids);
}

// ---- decoding ------------------------------------------------------------------------------

namespace {

// A <0xXX> byte-fallback token: its byte, or -1. As Rust's u8::from_str_radix, "+F" parses.
int fallback_byte(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  auto digit = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (t[3] == '+') return digit(t[4]);
  const int hi = digit(t[3]), lo = digit(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

void flush_bytes(std::string& bytes, std::vector<std::string>& out) {
  if (bytes.empty()) return;
  if (text::is_valid_utf8(bytes)) {
    out.push_back(bytes);
  } else {
    for (size_t i = 0; i < bytes.size(); ++i) out.emplace_back("\xEF\xBF\xBD");
  }
  bytes.clear();
}

// The WordPiece decoder's cleanup (HF's wordpiece::cleanup): spaces before punctuation and
// English contractions removed, in this order.
std::string wordpiece_cleanup(std::string s) {
  static const std::pair<const char*, const char*> kRules[] = {
      {" .", "."},   {" ?", "?"},     {" !", "!"},    {" ,", ","},
      {" ' ", "'"},  {" n't", "n't"}, {" 'm", "'m"},  {" do not", " don't"},
      {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (const auto& [from, to] : kRules) {
    if (s.find(from) == std::string::npos) continue;
    std::string next;
    hf::replace_pattern(s, nullptr, from, to, next);
    s = std::move(next);
  }
  return s;
}

void apply_decoder(const hf::DecoderStep& step, std::vector<std::string>& tokens) {
  std::vector<std::string> out;
  switch (step.kind) {
    case hf::DecoderStep::kByteLevel: {
      std::string bytes;
      for (const std::string& t : tokens) {
        const size_t mark = bytes.size();
        for (size_t i = 0; i < t.size();) {
          uint32_t len;
          const int b = byte_level::byte_of(text::decode_at(t, i, len));
          if (b < 0) {  // not byte-level text (an added token): its own bytes
            bytes.resize(mark);
            bytes.append(t);
            break;
          }
          bytes.push_back(static_cast<char>(b));
          i += len;
        }
      }
      out.emplace_back();
      text::append_lossy_utf8(bytes, out.back());
      break;
    }
    case hf::DecoderStep::kMetaspace:
      for (size_t i = 0; i < tokens.size(); ++i) {
        std::string s;
        hf::replace_pattern(tokens[i], nullptr, step.text, i == 0 && step.prepend ? "" : " ", s);
        out.push_back(std::move(s));
      }
      break;
    case hf::DecoderStep::kReplace:
      for (const std::string& t : tokens) {
        out.emplace_back();
        hf::replace_pattern(t, step.matcher.get(), step.text, step.content, out.back());
      }
      break;
    case hf::DecoderStep::kWordPiece:
      // Tokens after the first lose the subword prefix or get a space before them.
      for (size_t i = 0; i < tokens.size(); ++i) {
        std::string t = std::move(tokens[i]);
        if (i != 0) {
          t = t.compare(0, step.text.size(), step.text) == 0 ? t.substr(step.text.size()) : " " + t;
        }
        out.push_back(step.cleanup ? wordpiece_cleanup(t) : std::move(t));
      }
      break;
    case hf::DecoderStep::kBpe:
      // The end-of-word suffix becomes a space, and nothing in the last token.
      for (size_t i = 0; i < tokens.size(); ++i) {
        out.emplace_back();
        hf::replace_pattern(tokens[i], nullptr, step.text, i + 1 == tokens.size() ? "" : " ",
                            out.back());
      }
      break;
    case hf::DecoderStep::kCtc:
      // Repeats collapsed, the pad token removed, the word delimiter a space after cleanup.
      for (size_t i = 0; i < tokens.size(); ++i) {
        if (i > 0 && tokens[i] == tokens[i - 1]) continue;
        std::string t;
        hf::replace_pattern(tokens[i], nullptr, step.text, "", t);
        if (step.cleanup) {
          std::string cleaned;
          hf::replace_pattern(wordpiece_cleanup(t), nullptr, step.content, " ", cleaned);
          t = std::move(cleaned);
        }
        if (!t.empty()) out.push_back(std::move(t));
      }
      break;
    case hf::DecoderStep::kByteFallback: {
      std::string bytes;
      for (std::string& t : tokens) {
        const int b = fallback_byte(t);
        if (b >= 0) {
          bytes.push_back(static_cast<char>(b));
        } else {
          flush_bytes(bytes, out);
          out.push_back(std::move(t));
        }
      }
      flush_bytes(bytes, out);
      break;
    }
    case hf::DecoderStep::kFuse: {
      out.emplace_back();
      for (const std::string& t : tokens) out.back().append(t);
      break;
    }
    case hf::DecoderStep::kStrip:
      for (const std::string& t : tokens) {
        // Up to `start` leading and `stop` trailing characters equal to the content.
        const std::string& c = step.text;
        size_t b = 0, e = t.size();
        for (int k = 0; k < step.start && t.compare(b, c.size(), c) == 0; ++k) b += c.size();
        for (int k = 0;
             k < step.stop && e - b >= c.size() && t.compare(e - c.size(), c.size(), c) == 0; ++k) {
          e -= c.size();
        }
        out.push_back(t.substr(b, e - b));
      }
      break;
  }
  tokens.swap(out);
}

}  // namespace

std::string HfTokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= id_end_ || impl_->id_token[id] == nullptr) continue;
    if (skip_special_tokens && impl_->skip[id]) continue;
    tokens.push_back(*impl_->id_token[id]);
  }
  std::string text;
  if (!spec_.decoders) {  // HF joins the tokens with spaces when there is no decoder
    for (size_t i = 0; i < tokens.size(); ++i) text += (i ? " " : "") + tokens[i];
    return text;
  }
  for (const hf::DecoderStep& step : *spec_.decoders) apply_decoder(step, tokens);
  for (const std::string& t : tokens) text += t;
  return text;
}

}  // namespace zt
