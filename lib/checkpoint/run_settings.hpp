// What a run recorded of the model it trained, read back from the folders it wrote, for the
// commands that rebuild that model afterwards (merge, verify: load_trained_model).
#pragma once

#include <optional>
#include <string>

#include "zerotrain/model.hpp"

namespace zt::checkpoint {

/// The run's settings that shape its model, from its training_args.json (in `dir`, or in the
/// run's output_dir above a checkpoint-<step> folder); defaults where there is no such file
/// (`recorded` false).
struct RunSettings {
  bool recorded = false;
  std::string run_dir;  ///< the folder whose training_args.json was read ("" when none)
  std::optional<QuantizationConfig> quantization;  ///< the 4-bit base it trained over
  int64_t seed = 42;                               ///< PiSSA's random start, prompt inits
  std::string adapter_name_or_path;                ///< the adapter it continued, if any
};
RunSettings run_settings(const std::string& dir);

/// The pissa_init/ folder of the run that wrote `dir` (beside it, or in the run's output_dir
/// above a checkpoint-<step> folder); "" when there is none.
std::string pissa_start_dir(const std::string& dir);

}  // namespace zt::checkpoint
