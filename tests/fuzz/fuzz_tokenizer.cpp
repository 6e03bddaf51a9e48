// libFuzzer: a tokenizer.json (up to the first NUL byte) loaded, then the rest encoded and
// decoded with it.
#include <sys/stat.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "fuzz_support.hpp"
#include "tokenizer/hf_tokenizer.hpp"
#include "zerotrain/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* nul = static_cast<const uint8_t*>(std::memchr(data, 0, size));
  const size_t json_size = nul != nullptr ? static_cast<size_t>(nul - data) : size;
  const std::string dir = zt::fuzz::scratch() + "/tokenizer";
  ::mkdir(dir.c_str(), 0755);
  zt::fuzz::write_input("tokenizer/tokenizer.json", data, json_size);
  try {
    auto tok = zt::HfTokenizer::load(dir);
    if (nul != nullptr) {
      const std::string text(reinterpret_cast<const char*>(nul + 1), size - json_size - 1);
      const std::vector<int32_t> ids = tok->encode(text);
      (void)tok->decode(ids);
      (void)tok->decode(ids, /*skip_special_tokens=*/false);
    }
  } catch (const zt::Error&) {
  }
  return 0;
}
