// What a resumed run keeps: every recorded option that says what the model or the data is
// (quantization, method and adapter settings, targets, template, max length, stage, loss, ...)
// is compared with the checkpoint's training_args.json; a declared list names the options that
// may change (learning rate, steps, batch sizes, logging, saving, evaluation, ...).
#pragma once

#include <string>
#include <vector>

#include "zerotrain/config.hpp"

namespace zt::train {

/// The options (by their first name in the option table) whose value may differ from what a
/// resumed checkpoint recorded; every other option is compared.
const std::vector<std::string>& options_resume_may_change();

/// How a difference is settled: kTakeRecorded takes what the checkpoint recorded for an option
/// the arguments did not give (a logged line says so) and refuses one they gave; kRefuse refuses
/// every difference (the model is built already: Trainer::load_checkpoint).
enum class ResumeDifferences { kTakeRecorded, kRefuse };

/// Compares `args` with the arguments `checkpoint_dir/training_args.json` recorded (an older
/// checkpoint without that file is not compared: a warning says so). A difference in an option
/// that may not change is a ConfigError naming the option, both values and the file; or, with
/// kTakeRecorded and the option not given, the recorded value replaces the argument's. Spellings
/// of one setting are compared by what they mean (quantization_bit 4 / load_in_4bit with their
/// types; pissa_init / init_lora_weights; ChatGLM-Finetuning's train_type as finetuning_type).
/// Returns the lines to log for the values taken. IoError when the file is unreadable.
std::vector<std::string> reconcile_resumed_arguments(TrainingArguments& args,
                                                     const std::string& checkpoint_dir,
                                                     ResumeDifferences mode);

}  // namespace zt::train
