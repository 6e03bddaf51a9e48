// TensorBoard event files (`--report_to tensorboard`): scalars written as TFRecord-framed
// `Event` protocol buffers, the format TensorBoard's SummaryWriter produces, without depending
// on protobuf or TensorFlow.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace zt::train {

class TensorBoardWriter {
 public:
  /// Creates `dir` and `dir/events.out.tfevents.<seconds>.<host>.<pid>.0` (TensorBoard finds
  /// event files by that name), starting with the file-version event. IoError when it cannot.
  explicit TensorBoardWriter(const std::string& dir);

  /// Appends one scalar and flushes it, so that a TensorBoard watching the folder sees it at
  /// once and a killed run loses nothing written. IoError when the write fails.
  void scalar(const std::string& tag, double value, int64_t step);

  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event);

  std::string path_;
  std::ofstream out_;
};

/// HF Trainer's default logging_dir under `output_dir`: runs/<Mon><DD>_<HH>-<MM>-<SS>_<host>.
std::string default_logging_dir(const std::string& output_dir);

}  // namespace zt::train
