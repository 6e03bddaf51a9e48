// libFuzzer: a SentencePiece tokenizer.model read, then text encoded and decoded with it. The
// input is a little-endian 4-byte length, that many bytes of model (protobuf has NUL bytes, so
// no separator), and the text.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "tokenizer/sentencepiece_model.hpp"
#include "zerotrain/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  uint32_t n = 0;
  std::memcpy(&n, data, 4);
  const size_t model_size = std::min<size_t>(n, size - 4);
  const char* bytes = reinterpret_cast<const char*>(data) + 4;
  try {
    const zt::SentencePieceModel model(std::string(bytes, model_size), "fuzz/tokenizer.model");
    const std::string text(bytes + model_size, size - 4 - model_size);
    (void)model.decode(model.encode(text));
  } catch (const zt::Error&) {
  }
  return 0;
}
