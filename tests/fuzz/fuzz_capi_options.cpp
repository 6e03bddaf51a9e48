// libFuzzer: the C API's options string, through zt_trainer_create. Inputs that would name a
// model, an output folder or other ranks are left out: those run (or wait for) a real job; the
// rest is parsed and validated in full and refused with a status.
#include <cstdint>
#include <cstring>
#include <string>

#include "fuzz_support.hpp"
#include "zerotrain/zerotrain.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  zt::fuzz::scratch();
  const std::string options(reinterpret_cast<const char*>(data), size);
  for (const char* skip : {"model", "output_dir", "distributed", "deepspeed\"", "train_file",
                           "eval_file", "cache_dir", "logging_dir", "resume", "adapter"}) {
    if (options.find(skip) != std::string::npos) return 0;
  }
  zt_trainer* t = nullptr;
  const zt_status s = zt_trainer_create(options.c_str(), &t);
  if (s == ZT_OK) zt_trainer_free(t);
  (void)zt_last_error();
  return 0;
}
