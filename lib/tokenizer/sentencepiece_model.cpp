// SentencePiece's BPE model read from its serialized ModelProto, with its encoder and decoder.
#include "tokenizer/sentencepiece_model.hpp"

#include <cstring>
#include <queue>

#include <fmt/format.h>

#include "zerotrain/error.hpp"

namespace zt {
namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581 ▁
constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// A reader of protobuf's wire format over a bounded span; every read is checked.
class Wire {
 public:
  Wire(std::string_view data, const std::string& source) : d_(data), source_(source) {}
  bool done() const { return at_ >= d_.size(); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (at_ >= d_.size()) fail("a truncated varint");
      const uint8_t b = static_cast<uint8_t>(d_[at_++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return v;
    }
    fail("a varint longer than 10 bytes");
  }
  std::string_view bytes() {
    const uint64_t n = varint();
    if (n > d_.size() - at_) fail("a length beyond the end of the file");
    std::string_view s = d_.substr(at_, n);
    at_ += n;
    return s;
  }
  float fixed32() {
    if (d_.size() - at_ < 4) fail("a truncated float");
    float f;
    std::memcpy(&f, d_.data() + at_, 4);  // little-endian, as every supported machine
    at_ += 4;
    return f;
  }
  void skip(int wire) {
    switch (wire) {
      case 0:
        varint();
        return;
      case 1:
        if (d_.size() - at_ < 8) fail("a truncated fixed64");
        at_ += 8;
        return;
      case 2:
        bytes();
        return;
      case 5:
        fixed32();
        return;
      default:
        fail(fmt::format("wire type {}", wire));
    }
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw ConfigError(
        fmt::format("'{}' is not a SentencePiece model: {} at byte {}", source_, what, at_));
  }

 private:
  std::string_view d_;
  const std::string& source_;
  size_t at_ = 0;
};

// One UTF-8 character at the start of `s`: its length, or 0 when the bytes are not one.
size_t utf8_length(std::string_view s) {
  const auto c = static_cast<unsigned char>(s[0]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
  if (n == 0 || n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(s[k]) & 0xc0) != 0x80) return 0;
  }
  // Overlong forms, surrogates and code points past U+10FFFF are not characters either.
  uint32_t cp = n == 1 ? c : c & (0x7f >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[k]) & 0x3f);
  static const uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}

}  // namespace

SentencePieceModel::SentencePieceModel(const std::string& bytes, const std::string& source) {
  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  int64_t model_type = 1;  // UNIGRAM, protobuf's default
  std::string normalizer = "(none)";
  bool charsmap = false, whitespace_suffix = false;
  Wire top(bytes, source);
  while (!top.done()) {
    const uint64_t key = top.varint();
    const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
    if (field == 1 && wire == 2) {  // SentencePiece
      Wire p(top.bytes(), source);
      Piece piece;
      while (!p.done()) {
        const uint64_t k = p.varint();
        const int f = static_cast<int>(k >> 3), w = static_cast<int>(k & 7);
        if (f == 1 && w == 2) {
          piece.text = std::string(p.bytes());
        } else if (f == 2 && w == 5) {
          piece.score = p.fixed32();
        } else if (f == 3 && w == 0) {
          const uint64_t t = p.varint();
          if (t < 1 || t > 6) p.fail(fmt::format("piece type {}", t));
          piece.type = static_cast<PieceType>(t);
        } else {
          p.skip(w);
        }
      }
      pieces_.push_back(std::move(piece));
    } else if (field == 2 && wire == 2) {  // TrainerSpec
      Wire t(top.bytes(), source);
      while (!t.done()) {
        const uint64_t k = t.varint();
        const int f = static_cast<int>(k >> 3), w = static_cast<int>(k & 7);
        if (w != 0) {
          if (f == 44 && w == 2) {
            unk_surface_ = std::string(t.bytes());
          } else {
            t.skip(w);
          }
          continue;
        }
        const auto v = static_cast<int64_t>(t.varint());  // int32 negatives are sign-extended
        if (f == 3) model_type = v;
        if (f == 24) whitespace_suffix = v != 0;
        if (f == 35) byte_fallback_ = v != 0;
        if (f == 40) unk_id_ = static_cast<int32_t>(v);
        if (f == 41) bos_id_ = static_cast<int32_t>(v);
        if (f == 42) eos_id_ = static_cast<int32_t>(v);
      }
    } else if (field == 3 && wire == 2) {  // NormalizerSpec
      Wire n(top.bytes(), source);
      while (!n.done()) {
        const uint64_t k = n.varint();
        const int f = static_cast<int>(k >> 3), w = static_cast<int>(k & 7);
        if (f == 1 && w == 2) {
          normalizer = std::string(n.bytes());
        } else if (f == 2 && w == 2) {
          charsmap = !n.bytes().empty();
        } else if (f >= 3 && f <= 5 && w == 0) {
          const bool v = n.varint() != 0;
          (f == 3   ? add_dummy_prefix_
           : f == 4 ? remove_extra_whitespaces_
                    : escape_whitespaces_) = v;
        } else {
          n.skip(w);
        }
      }
    } else {
      top.skip(wire);
    }
  }
  auto refuse = [&](const std::string& what) {
    throw ConfigError(
        fmt::format("'{}': {}; zerotrain reads SentencePiece BPE models with the "
                    "identity normalizer (ChatGLM2/3's tokenizer.model)",
                    source, what));
  };
  if (pieces_.empty()) refuse("the model has no pieces");
  if (model_type != 2) refuse(fmt::format("model_type {} is not BPE (2)", model_type));
  if (charsmap)
    refuse(fmt::format("the \"{}\" normalizer (a character map) is not supported", normalizer));
  if (whitespace_suffix) refuse("treat_whitespace_as_suffix is not supported");
  const auto n = static_cast<int32_t>(pieces_.size());
  byte_value_.assign(pieces_.size(), -1);
  for (int32_t id = 0; id < n; ++id) {
    const Piece& p = pieces_[id];
    if (p.text.empty()) refuse(fmt::format("piece {} is empty", id));
    if (p.type == kUnused) refuse(fmt::format("piece {} is UNUSED, which is not supported", id));
    auto& table = p.type == kNormal || p.type == kUserDefined ? mergeable_ : reserved_;
    if (!table.emplace(std::string_view(p.text), id).second) {
      refuse(fmt::format("piece \"{}\" appears twice", p.text));
    }
    if (p.type == kUserDefined) user_defined_.push_back(p.text);
    if (p.type == kByte) {
      // Exactly "<0x" two hex digits ">" (sscanf's %X would take a sign or a space).
      auto hex = [](char c) {
        return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      };
      const int hi = p.text.size() == 6 ? hex(p.text[3]) : -1, lo = hi >= 0 ? hex(p.text[4]) : -1;
      if (lo < 0 || p.text.compare(0, 3, "<0x") != 0 || p.text[5] != '>') {
        refuse(fmt::format("byte piece \"{}\" is not <0xXX>", p.text));
      }
      const auto value = static_cast<unsigned>(hi * 16 + lo);
      byte_ids_[value] = id;
      byte_value_[id] = static_cast<int16_t>(value);
    }
  }
  if (unk_id_ < 0 || unk_id_ >= n || pieces_[unk_id_].type != kUnknown) {
    refuse(fmt::format("unk_id {} is not an UNKNOWN piece", unk_id_));
  }
  for (int32_t* id : {&bos_id_, &eos_id_}) {
    if (*id >= n) refuse(fmt::format("bos/eos id {} is outside the {} pieces", *id, n));
  }
  if (byte_fallback_) {
    for (int b = 0; b < 256; ++b) {
      if (byte_ids_[b] < 0) refuse(fmt::format("byte_fallback without the piece <0x{:02X}>", b));
    }
  }
}

int32_t SentencePieceModel::piece_to_id(std::string_view piece) const {
  if (auto it = reserved_.find(piece); it != reserved_.end()) return it->second;
  if (auto it = mergeable_.find(piece); it != mergeable_.end()) return it->second;
  return unk_id_;
}

// SentencePiece's Normalizer with an identity map: the dummy prefix, spaces as ▁, extra spaces
// removed when asked, an ill-formed byte as U+FFFD.
std::string SentencePieceModel::normalize(std::string_view in) const {
  if (remove_extra_whitespaces_) {
    while (!in.empty() && in[0] == ' ') in.remove_prefix(1);
  }
  std::string out;
  if (in.empty()) return out;
  const std::string_view space = escape_whitespaces_ ? kSpaceSymbol : std::string_view(" ");
  if (add_dummy_prefix_) out += space;
  bool prev_space = remove_extra_whitespaces_;
  while (!in.empty()) {
    size_t n = utf8_length(in);
    std::string_view ch = n == 0 ? kReplacement : in.substr(0, n);
    if (n == 0) n = 1;
    in.remove_prefix(n);
    if (remove_extra_whitespaces_ && prev_space && ch == " ") continue;  // runs become one
    out += ch == " " ? space : ch;
    prev_space = ch == " ";
  }
  if (remove_extra_whitespaces_) {
    while (out.size() >= space.size() &&
           out.compare(out.size() - space.size(), space.size(), space) == 0) {
      out.resize(out.size() - space.size());
    }
  }
  return out;
}

std::vector<int32_t> SentencePieceModel::encode(std::string_view text) const {
  const std::string s = normalize(text);
  struct Symbol {
    size_t start, len;
    int prev, next;
    bool frozen;
  };
  std::vector<Symbol> sym;
  for (size_t at = 0; at < s.size();) {
    size_t len = 0;
    bool frozen = false;
    for (const std::string& u : user_defined_) {  // the longest user-defined piece here
      if (u.size() > len && s.compare(at, u.size(), u) == 0) len = u.size(), frozen = true;
    }
    if (len == 0) len = std::max<size_t>(1, utf8_length(std::string_view(s).substr(at)));
    const int i = static_cast<int>(sym.size());
    sym.push_back({at, len, i - 1, at + len < s.size() ? i + 1 : -1, frozen});
    at += len;
  }
  struct Pair {
    int left, right;
    float score;
    size_t size;
  };
  // Highest score first; among equal scores the leftmost (SentencePiece's agenda order).
  auto later = [](const Pair& a, const Pair& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  std::priority_queue<Pair, std::vector<Pair>, decltype(later)> agenda(later);
  auto consider = [&](int left, int right) {
    if (left < 0 || right < 0 || sym[left].frozen || sym[right].frozen) return;
    const size_t size = sym[left].len + sym[right].len;
    auto it = mergeable_.find(std::string_view(s).substr(sym[left].start, size));
    if (it == mergeable_.end()) return;
    agenda.push({left, right, pieces_[it->second].score, size});
  };
  for (size_t i = 1; i < sym.size(); ++i) consider(static_cast<int>(i) - 1, static_cast<int>(i));
  while (!agenda.empty()) {
    const Pair top = agenda.top();
    agenda.pop();
    Symbol& l = sym[top.left];
    Symbol& r = sym[top.right];
    if (l.len == 0 || r.len == 0 || l.len + r.len != top.size) continue;  // stale
    l.len += r.len;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = top.left;
    r.len = 0;
    consider(l.prev, top.left);
    consider(top.left, l.next);
  }
  std::vector<int32_t> ids;
  for (int i = sym.empty() ? -1 : 0; i >= 0; i = sym[i].next) {
    const std::string_view piece = std::string_view(s).substr(sym[i].start, sym[i].len);
    const int32_t id = piece_to_id(piece);
    if (id == unk_id_ && byte_fallback_) {
      for (unsigned char b : piece) ids.push_back(byte_ids_[b]);
    } else {
      ids.push_back(id);
    }
  }
  return ids;
}

std::string SentencePieceModel::decode(const std::vector<int32_t>& ids) const {
  std::string text, bytes;
  bool first = true;  // no piece decoded yet: its ▁ is the dummy prefix
  auto flush = [&] {
    std::string_view b = bytes;
    while (!b.empty()) {
      const size_t n = utf8_length(b);
      text += n == 0 ? kReplacement : b.substr(0, n);
      b.remove_prefix(n == 0 ? 1 : n);
    }
    bytes.clear();
  };
  for (int32_t id : ids) {
    if (id < 0 || id >= size()) continue;
    const Piece& p = pieces_[id];
    if (p.type == kByte) {
      bytes.push_back(static_cast<char>(byte_value_[id]));
      first = false;
      continue;
    }
    flush();
    if (p.type == kControl) continue;
    const bool at_start = first;
    first = false;
    if (p.type == kUnknown) {
      text += unk_surface_;
      continue;
    }
    std::string_view piece = p.text;
    if (at_start && (add_dummy_prefix_ || remove_extra_whitespaces_) &&
        piece.substr(0, kSpaceSymbol.size()) == kSpaceSymbol) {
      piece.remove_prefix(kSpaceSymbol.size());
    }
    for (size_t at = 0; at < piece.size();) {
      if (piece.compare(at, kSpaceSymbol.size(), kSpaceSymbol) == 0) {
        text += ' ';
        at += kSpaceSymbol.size();
      } else {
        text += piece[at++];
      }
    }
  }
  flush();
  return text;
}

}  // namespace zt
