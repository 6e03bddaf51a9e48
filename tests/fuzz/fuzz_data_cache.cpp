// libFuzzer: a tokenized-data cache file (safetensors with the dataset's tensors and metadata)
// as the trainer reads it back on every rank: every id range-checked against the vocabulary,
// offsets and labels consistent — an IoError for anything else, never a crash or a huge
// allocation.
#include <cstdint>
#include <string>

#include "fuzz_support.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = zt::fuzz::write_input("cache.safetensors", data, size);
  try {
    zt::DatasetStats stats;
    zt::Dataset d = zt::load_dataset(path, &stats, 259);
    for (int64_t i = 0; i < d.size(); ++i) (void)d.ids(i);
  } catch (const zt::Error&) {
  }
  return 0;
}
