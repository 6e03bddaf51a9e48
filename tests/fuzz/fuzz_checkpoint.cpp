// libFuzzer: a checkpoint's metadata — layout.json, trainer_state.json (HF's keys and the
// "zerotrain" resume position), latest — as resume and merge read them.
#include <sys/stat.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "fuzz_support.hpp"
#include "train/reporting.hpp"
#include "zerotrain/checkpoint.hpp"
#include "zerotrain/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string dir = zt::fuzz::scratch() + "/checkpoint-1";
  ::mkdir(dir.c_str(), 0755);
  zt::fuzz::write_input("checkpoint-1/layout.json", data, size);
  zt::fuzz::write_input("checkpoint-1/trainer_state.json", data, size);
  zt::fuzz::write_input("latest", data, size);
  try {
    (void)zt::read_engine_state(dir);
    (void)zt::checkpoint_parameters(dir);
  } catch (const zt::Error&) {
  }
  try {
    (void)zt::train::read_trainer_state(dir);
  } catch (const zt::Error&) {
  }
  try {
    (void)zt::latest_checkpoint(zt::fuzz::scratch());
  } catch (const zt::Error&) {
  }
  return 0;
}
