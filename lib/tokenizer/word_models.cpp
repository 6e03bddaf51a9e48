// WordPiece and WordLevel as HF tokenizers' `WordPiece::tokenize` / `WordLevel::tokenize` run
// them.
#include "tokenizer/word_models.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "tokenizer/unicode_text.hpp"
#include "zerotrain/error.hpp"

namespace zt {
namespace {

ConfigError missing_unk(const std::string& where, const std::string& unk) {
  return ConfigError(fmt::format(
      "{}: model.unk_token \"{}\" is not in model.vocab, and the text has a word the vocabulary "
      "cannot spell; fix the file's unk_token",
      where, unk));
}

}  // namespace

WordPieceModel::WordPieceModel(const std::vector<std::pair<std::string, int32_t>>& vocab,
                               std::string unk_token, std::string continuing_subword_prefix,
                               size_t max_input_chars_per_word, const std::string& where)
    : VocabularyModel(Vocabulary(vocab, where)),
      unk_token_(std::move(unk_token)),
      prefix_(std::move(continuing_subword_prefix)),
      max_chars_(max_input_chars_per_word),
      where_(where),
      cache_(std::make_unique<PieceCache>()) {
  // Each entry under the id the vocabulary gives its text (a text listed twice: the later id).
  for (const auto& entry : vocab) {
    const std::string_view text = entry.first;
    if (text.empty()) continue;
    const int32_t id = vocab_.find(text);
    first_.insert(text, id);
    if (text.size() > prefix_.size() && text.compare(0, prefix_.size(), prefix_) == 0) {
      continuing_.insert(text.substr(prefix_.size()), id);
    }
  }
}

int32_t WordPieceModel::unk() const {
  const int32_t id = vocab_.find(unk_token_);
  if (id < 0) throw missing_unk(where_, unk_token_);
  return id;
}

void WordPieceModel::encode_piece(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  size_t chars = 0;
  for (size_t i = 0; i < word.size(); ++i)
    chars += (static_cast<unsigned char>(word[i]) & 0xC0) != 0x80;
  if (chars > max_chars_) {
    out.push_back(unk());
    return;
  }
  cache_->encode(word, out,
                 [&](std::string_view w, std::vector<int32_t>& ids) { split_word(w, ids); });
}

// HF looks up prefix + word[start, end) for each end from the word's end back, one character
// at a time; the longest such entry is the last one a walk down the trie meets at a character
// boundary.
void WordPieceModel::split_word(std::string_view word, std::vector<int32_t>& out) const {
  const size_t mark = out.size();
  for (size_t start = 0; start < word.size();) {
    const std::string_view rest = word.substr(start);
    size_t length = 0;
    int32_t found = -1;
    (start == 0 ? first_ : continuing_).prefixes(rest, [&](size_t len, int32_t id) {
      if (len == rest.size() || (static_cast<unsigned char>(rest[len]) & 0xC0) != 0x80) {
        length = len;
        found = id;
      }
    });
    if (found < 0) {  // a part no entry matches: the whole word is unk
      out.resize(mark);
      out.push_back(unk());
      return;
    }
    out.push_back(found);
    start += length;
  }
}

WordLevelModel::WordLevelModel(const std::vector<std::pair<std::string, int32_t>>& vocab,
                               std::string unk_token, const std::string& where)
    : VocabularyModel(Vocabulary(vocab, where)), unk_token_(std::move(unk_token)), where_(where) {}

void WordLevelModel::encode_piece(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  const int32_t id = vocab_.find(word);
  if (id >= 0) {
    out.push_back(id);
    return;
  }
  const int32_t unk = vocab_.find(unk_token_);
  if (unk < 0) throw missing_unk(where_, unk_token_);
  out.push_back(unk);
}

}  // namespace zt
