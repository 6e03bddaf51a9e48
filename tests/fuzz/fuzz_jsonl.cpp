// libFuzzer: a data file (JSONL lines or one JSON array) tokenized with the byte tokenizer
// through an instruction template and a model's chat format.
#include <cstdint>

#include "fuzz_support.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = zt::fuzz::write_input("data.jsonl", data, size);
  for (const char* t : {"alpaca_zh", "qwen2.5", "llama2"}) {
    zt::DataOptions o;
    o.template_name = t;
    o.max_length = 64;
    o.skip_bad_lines = size % 2 == 0;
    try {
      zt::tokenize_jsonl(path, *zt::byte_tokenizer(), o);
    } catch (const zt::Error&) {
    }
  }
  return 0;
}
