// libFuzzer: a safetensors file (header and data) as SafetensorsFile opens and reads it.
#include <cstdint>

#include "fuzz_support.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = zt::fuzz::write_input("input.safetensors", data, size);
  try {
    zt::SafetensorsFile f(path);
    for (const std::string& name : f.names()) {
      const zt::TensorInfo& info = f.info(name);
      if (info.numel <= (1 << 20)) f.load(name);
      f.metadata();
    }
  } catch (const zt::Error&) {
  }
  return 0;
}
