// SentencePiece BPE models (a tokenizer.model file): the serialized ModelProto read directly,
// and SentencePiece's encoding and decoding for BPE with the identity normalizer — what
// ChatGLM2/3's tokenizer.model is. Debian's libsentencepiece cannot be linked into a process
// with LibTorch: it carries its own protobuf-lite 3.14 whose exported symbols clash with
// LibTorch's protobuf 3.21 at start-up (docs/tokenizers.md).
//
// Thread-safety: immutable after construction; const methods may be called concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace zt {

class SentencePieceModel {
 public:
  enum PieceType {
    kNormal = 1,
    kUnknown = 2,
    kControl = 3,
    kUserDefined = 4,
    kUnused = 5,
    kByte = 6
  };

  /// Parses `bytes` (tokenizer.model's content). Anything but a well-formed BPE model with the
  /// identity normalizer is a ConfigError naming `source` and what is unsupported.
  SentencePieceModel(const std::string& bytes, const std::string& source);
  // The lookup tables view the pieces' own strings: not copyable.
  SentencePieceModel(const SentencePieceModel&) = delete;
  SentencePieceModel& operator=(const SentencePieceModel&) = delete;

  /// SentencePiece's ids of `text` (normalized, BPE-merged by piece score, unknown characters
  /// as byte pieces when byte_fallback is on, else unk).
  std::vector<int32_t> encode(std::string_view text) const;
  /// SentencePiece's text of `ids`: ▁ as spaces (one leading one dropped with the dummy
  /// prefix), byte pieces joined into UTF-8 (U+FFFD for invalid bytes), control pieces empty,
  /// unk as " ⁇ ". Ids outside the model are skipped.
  std::string decode(const std::vector<int32_t>& ids) const;

  int32_t size() const { return static_cast<int32_t>(pieces_.size()); }
  int32_t unk_id() const { return unk_id_; }
  int32_t bos_id() const { return bos_id_; }  ///< -1 when none
  int32_t eos_id() const { return eos_id_; }  ///< -1 when none
  /// The id of a piece string (NORMAL, USER_DEFINED, or a CONTROL / BYTE / UNKNOWN piece), or
  /// unk_id() when it has none — SentencePiece's PieceToId.
  int32_t piece_to_id(std::string_view piece) const;

 private:
  struct Piece {
    std::string text;
    float score = 0;
    PieceType type = kNormal;
  };
  std::vector<Piece> pieces_;
  // Keys view pieces_' strings (so encoding looks pieces up without allocating).
  std::unordered_map<std::string_view, int32_t> mergeable_;  // NORMAL and USER_DEFINED pieces
  std::unordered_map<std::string_view, int32_t> reserved_;   // CONTROL, UNKNOWN, BYTE
  std::vector<int16_t> byte_value_;                          // per id: a BYTE piece's byte, or -1
  std::vector<std::string> user_defined_;
  int32_t byte_ids_[256];
  int32_t unk_id_ = 0, bos_id_ = 1, eos_id_ = 2;
  bool byte_fallback_ = false;
  bool add_dummy_prefix_ = true, remove_extra_whitespaces_ = true, escape_whitespaces_ = true;
  std::string unk_surface_ = " \xE2\x81\x87 ";

  std::string normalize(std::string_view text) const;
};

}  // namespace zt
