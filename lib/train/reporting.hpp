// What a run writes about itself: trainer_state.json (HF TrainerState's keys, so HF's own
// TrainerState.load_from_json reads it), zerotrain_state.json (the resume position),
// trainer_log.jsonl and loss.svg.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "zerotrain/trainer.hpp"

namespace zt::train {

/// A run's state: HF Trainer's TrainerState (trainer_state.json: global_step, epoch,
/// log_history, best_metric, best_model_checkpoint, ...) and zerotrain's resume position
/// (zerotrain_state.json).
struct TrainerState {
  int64_t global_step = 0;
  double epoch = 0.0;  ///< epochs done, with the fraction of the one in progress
  double total_flos = 0.0;
  int64_t max_steps = 0;
  int64_t logging_steps = 0, eval_steps = 0, save_steps = 0;
  int64_t train_batch_size = 0;  ///< per device, as HF records it
  double num_train_epochs = 0.0;
  std::vector<LogRecord> log_history;
  std::optional<double> best_metric;
  std::optional<std::string> best_model_checkpoint;
  std::optional<int64_t> best_global_step;
  // Resume position (zerotrain_state.json).
  int world_size = 1;
  int64_t global_batch_size = 0;
  int64_t gradient_accumulation_steps = 1;
  int64_t epoch_index = 0;     ///< the epoch in progress
  int64_t steps_in_epoch = 0;  ///< optimizer steps of it already done
  int64_t data_seed = 0;
  int64_t tokens_seen = 0;
  /// The run's training loss through global_step (train::RunLoss): the sum of its steps'
  /// losses and their count, so that a resumed run's train_loss covers the whole run. In a
  /// checkpoint written before they were saved: from its log history, the steps its training
  /// records cover.
  double train_loss_sum = 0.0;
  int64_t train_loss_steps = 0;
  std::string finetuning_type;
  /// Which run wrote a checkpoint: made when a run starts afresh, kept when it resumes, so a
  /// resumed run tells its own checkpoints from another run's in the same folder.
  std::string run_id;
  /// The engine save this state belongs to (checkpoint_save_id of the same folder): a resume
  /// refuses a trainer state beside another save's optimizer state.
  std::string save_id;
};

/// A fresh TrainerState::run_id: 64 random bits as hex.
std::string new_run_id();

/// trainer_state.json: exactly the keys of HF's TrainerState dataclass.
std::string trainer_state_json(const TrainerState& state);
/// zerotrain_state.json: the resume position (world size, batch, epoch and step in it, seed).
std::string zerotrain_state_json(const TrainerState& state);
/// Reads `<checkpoint>/trainer_state.json` and `<checkpoint>/zerotrain_state.json` (or, in
/// checkpoints written before that file existed, trainer_state.json's "zerotrain" object);
/// errors name the file and key.
TrainerState read_trainer_state(const std::string& checkpoint_dir);

/// An SVG plot of training loss (line) and evaluation loss (points) against steps.
std::string loss_svg(const std::vector<LogRecord>& history);

/// One plain log line for a record: "step 10/100 | epoch 0.50 | loss 2.3456 | ...".
std::string describe(const LogRecord& record, int64_t total_steps);

}  // namespace zt::train
