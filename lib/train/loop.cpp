// The training loop: epochs, steps, the log window, evaluation, cancellation and preemption,
// and the final model at the end of train().
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <exception>
#include <filesystem>

#include <fmt/format.h>

#include "train/trainer_impl.hpp"
#include "util/log.hpp"
#include "zerotrain/error.hpp"

namespace zt {

using comm::on_every_rank;
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

void Trainer::Impl::check_cancel() {
  // [cancel, preempting signal], the largest of every rank's: one agreement per step.
  int preempt = preempt_requested.load();
  bool cancel = cancel_requested.load();
  if (world > 1) {
    const std::vector<double> flags = comm::reduce_scalars(
        *comm, {cancel ? 1.0 : 0.0, static_cast<double>(preempt)}, ReduceOp::kMax);
    cancel = flags[0] > 0;
    preempt = static_cast<int>(flags[1]);
  }
  if (preempt > 0) {
    // A scheduler's warning before preemption: keep this step's state, then stop.
    stop_signal = preempt;
    if (state.global_step > 0 &&
        !checkpoint_in(args.output_dir, fmt::format("checkpoint-{}", state.global_step))) {
      save_checkpoint();
    }
    throw CancelledError(
        fmt::format("stopped by signal {} at step {}; the state is in checkpoint-{}: continue with "
                    "--resume_from_checkpoint True",
                    preempt, state.global_step, state.global_step));
  }
  if (cancel) {
    throw CancelledError(fmt::format("training cancelled at step {}; the newest checkpoint is kept",
                                     state.global_step));
  }
}

namespace {

// Whether every row of a (host) attention mask is its real tokens followed by padding. Causal
// attention never lets a real token see a later position, so such padding is unreachable
// without a mask: the real tokens' results are the same, and on the GPU attention runs in the
// flash kernels, which take no mask (transformers passes the mask and gets the slower kernel).
bool padding_only_at_row_ends(const at::Tensor& mask) {
  if (mask.size(1) < 2) return true;
  const at::Tensor m = mask.ne(0);
  return m.narrow(1, 1, m.size(1) - 1).le(m.narrow(1, 0, m.size(1) - 1)).all().item<bool>();
}

}  // namespace

LossSum Trainer::Impl::forward(const Batch& b) {
  const at::Device device = comm->device();
  at::Tensor mask;
  at::Tensor positions;
  if (b.document_ids.defined()) {
    mask =
        (b.document_ids + 1).to(device);  // documents numbered from 1, padding 0 (CausalLM::loss)
    positions = b.position_ids.to(device);
  } else if (!padding_only_at_row_ends(b.attention_mask)) {
    mask = b.attention_mask.to(device);
  }
  return model->loss(b.input_ids.to(device), b.labels, mask, 1024, positions);
}

void Trainer::Impl::log(const LogRecord& record) {
  state.log_history.push_back(record);
  if (rank != 0) return;
  log::info("{}", train::describe(record, total_steps));
  try {
    fs::create_directories(args.output_dir);
    std::ofstream out(args.output_dir + "/trainer_log.jsonl", std::ios::app);
    out << record.json() << "\n";
    if (!out)
      throw IoError(fmt::format("cannot append to '{}/trainer_log.jsonl'", args.output_dir));
  } catch (const std::exception& e) {
    log::warn("{}", e.what());  // a log line lost is not worth the run
  }
  report_to_tensorboard(record);
  if (callbacks.on_log) callbacks.on_log(record);
}

void Trainer::Impl::report_to_tensorboard(const LogRecord& r) {
  if (args.report_to.find("tensorboard") == std::string::npos &&
      args.report_to.find("all") == std::string::npos) {
    return;
  }
  try {
    if (!tensorboard) {
      const std::string dir =
          args.logging_dir.empty() ? train::default_logging_dir(args.output_dir) : args.logging_dir;
      tensorboard = std::make_unique<train::TensorBoardWriter>(dir);
      log::info("TensorBoard: {}", tensorboard->path());
    }
    // HF's tags: train/<key> for training records, eval/<key> for evaluation.
    auto put = [&](const char* tag, const std::optional<double>& v) {
      if (v) tensorboard->scalar(tag, *v, r.step);
    };
    put("train/loss", r.loss);
    put("train/learning_rate", r.learning_rate);
    put("train/grad_norm", r.grad_norm);
    put("train/tokens_per_second", r.tokens_per_second);
    put("train/loss_scale", r.loss_scale);
    put("train/peak_memory_gib", r.peak_memory_gib);
    put("train/train_loss", r.train_loss);
    put("train/train_runtime", r.train_runtime);
    put("eval/loss", r.eval_loss);
    if (r.loss || r.eval_loss) tensorboard->scalar("train/epoch", r.epoch, r.step);
  } catch (const std::exception& e) {
    log::warn("{} (TensorBoard reporting stops)",
              e.what());  // the run is worth more than its plots
    args.report_to = "none";
  }
}

double Trainer::Impl::run_evaluation() {
  if (!has_eval) throw ConfigError("evaluate: no eval_file given");
  at::NoGradGuard no_grad;
  model->eval();
  std::vector<std::vector<int64_t>> batches =
      eval_batches(eval_data.size(), world, rank, args.per_device_eval_batch_size);
  double sum = 0.0, tokens = 0.0;
  for (const std::vector<int64_t>& indices : batches) {
    // A rank with nothing left still runs a forward (ZeRO-3 forwards are collective), unweighted.
    const bool empty = indices.empty();
    Batch b = collate(eval_data, empty ? std::vector<int64_t>{0} : indices, pad_id);
    LossSum l = forward(b);
    if (!empty) {
      sum += l.sum.item<double>();
      tokens += static_cast<double>(l.tokens);
    }
  }
  model->train();
  const std::vector<double> global = comm::reduce_scalars(*comm, {sum, tokens});
  if (global[1] <= 0) {
    throw ConfigError(fmt::format("'{}' has no token that counts in the loss", args.eval_file));
  }
  return global[0] / global[1];
}

double Trainer::evaluate() {
  Impl& I = *impl_;
  const double loss = I.run_evaluation();
  LogRecord r;
  r.step = I.state.global_step;
  r.epoch = I.epoch_progress();
  r.eval_loss = loss;
  I.log(r);
  I.last_eval_loss = loss;
  I.last_eval_step = I.state.global_step;
  return loss;
}

TrainResult Trainer::train() {
  Impl& I = *impl_;
  if (!I.has_train) throw ConfigError("train: no train_file given (--train_file DATA.jsonl)");
  I.announce();
  on_every_rank(*I.comm, fmt::format("preparing output_dir '{}'", I.args.output_dir), [&] {
    if (I.rank != 0) return;
    fs::create_directories(I.args.output_dir);
    if (!I.superseded.empty()) {
      for (const std::string& dir : I.superseded) {
        log::warn(
            "overwrite_output_dir: removing '{}', which is newer than the checkpoint resumed from",
            dir);
        files::remove_tree(dir);
      }
      std::error_code ec;
      const fs::path resumed = fs::absolute(*I.resume_dir).lexically_normal();
      if (fs::equivalent(resumed.parent_path(), I.args.output_dir, ec)) {
        files::write_atomic(I.args.output_dir + "/latest", resumed.filename().string() + "\n");
      }
    }
    I.write_run_settings(I.args.output_dir);
  });
  I.superseded.clear();
  if (I.args.eval_on_start && I.has_eval) evaluate();
  I.model->train();

  const Clock::time_point start = Clock::now();
  const int64_t first_step = I.state.global_step;
  Clock::time_point window_start = start;
  at::Tensor window_loss =
      at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(I.comm->device()));
  int64_t window_steps = 0, window_tokens = 0;
  double run_loss_sum = 0.0;
  int64_t run_loss_steps = 0;
  double last_logged_loss = 0.0;
  const int64_t megabatch = length_megabatch(I.train_data.size(), I.batch.size());

  auto log_window = [&] {
    if (window_steps == 0) return;
    const double loss = comm::reduce_scalars(*I.comm, {window_loss.item<double>()})[0] /
                        static_cast<double>(window_steps);
    LogRecord r;
    r.step = I.state.global_step;
    r.epoch = I.epoch_progress();
    r.loss = loss;
    r.learning_rate = I.engine->learning_rate();
    r.grad_norm = I.engine->last_grad_norm();
    r.tokens_per_second =
        static_cast<double>(window_tokens) / std::max(1e-9, seconds_since(window_start));
    if (I.ds.fp16.enabled.value()) r.loss_scale = I.engine->loss_scale();
    r.peak_memory_gib = I.window_peak_memory_gib();
    I.log(r);
    run_loss_sum += loss * static_cast<double>(window_steps);
    run_loss_steps += window_steps;
    last_logged_loss = loss;
    window_loss.zero_();
    window_steps = 0;
    window_tokens = 0;
    window_start = Clock::now();
  };

  while (I.state.global_step < I.total_steps) {
    const int64_t epoch = I.state.epoch_index;
    // Each epoch's own order, from the seed and the epoch alone (HF's sampler with set_epoch):
    // a resumed run rebuilds the same one.
    const bool shuffle = I.args.train_sampling_strategy != "sequential";
    const std::vector<int64_t> order =
        epoch_order(I.train_data.size(), I.data_seed, epoch, shuffle,
                    I.args.group_by_length ? &I.train_lengths : nullptr, megabatch);
    bool epoch_end = false;
    while (!epoch_end && I.state.global_step < I.total_steps) {
      I.check_cancel();
      const int64_t s = I.state.steps_in_epoch;
      // The whole global batch's counts, the same on every rank without communication.
      int64_t targets = 0, tokens = 0;
      for (int64_t a = 0; a < I.batch.accumulation; ++a) {
        for (int64_t r = 0; r < I.world; ++r) {
          for (int64_t i : micro_batch_indices(order, I.batch, s, a, r)) {
            targets += I.train_targets[static_cast<size_t>(i)];
            tokens += I.train_lengths[static_cast<size_t>(i)];
          }
        }
      }
      const double divisor = static_cast<double>(std::max<int64_t>(1, targets));
      at::Tensor step_loss = at::zeros({}, window_loss.options());
      for (int64_t a = 0; a < I.batch.accumulation; ++a) {
        Batch b =
            collate(I.train_data, micro_batch_indices(order, I.batch, s, a, I.rank), I.pad_id);
        LossSum l = I.forward(b);
        I.engine->backward(l.sum, divisor);
        I.engine->step();
        step_loss += l.sum.detach() / divisor;
      }
      window_loss += step_loss;
      I.state.global_step = I.engine->global_step();
      I.state.steps_in_epoch = s + 1;
      epoch_end = I.state.steps_in_epoch == I.steps_per_epoch;
      if (epoch_end) {  // the position a checkpoint saved now resumes from
        I.state.epoch_index = epoch + 1;
        I.state.steps_in_epoch = 0;
      }
      I.state.epoch = I.epoch_progress();
      I.state.tokens_seen += tokens;
      I.state.total_flos +=
          6.0 * static_cast<double>(tokens) * static_cast<double>(I.non_embedding_parameters);
      window_tokens += tokens;
      ++window_steps;
      const int64_t step = I.state.global_step;
      if (I.callbacks.on_step) {
        StepStats st;
        st.global_step = step;
        st.stepped = true;
        st.skipped = I.engine->last_step_skipped();
        // This step's mean token loss over all ranks.
        st.loss = comm::reduce_scalars(*I.comm, {step_loss.item<double>()})[0];
        st.grad_norm = I.engine->last_grad_norm();
        st.learning_rate = I.engine->learning_rate();
        st.loss_scale = I.engine->loss_scale();
        I.callbacks.on_step(st);
      }
      const bool last = step == I.total_steps;
      const std::string& logging = I.args.logging_strategy;
      if ((logging == "steps" &&
           (step % I.log_every == 0 || (I.args.logging_first_step && step == 1))) ||
          (logging == "epoch" && epoch_end) || (logging != "no" && last)) {
        log_window();
      }
      if (I.rank == 0 && I.callbacks.on_progress) {
        Progress p;
        p.step = step;
        p.total_steps = I.total_steps;
        p.epoch = I.epoch_progress();
        p.loss = last_logged_loss;
        p.learning_rate = I.engine->learning_rate();
        const double elapsed = seconds_since(start);
        p.tokens_per_second = static_cast<double>(I.state.tokens_seen) / std::max(1e-9, elapsed);
        p.eta_seconds = elapsed / static_cast<double>(step - first_step) *
                        static_cast<double>(I.total_steps - step);
        I.callbacks.on_progress(p);
      }
      const bool delayed = I.args.eval_strategy == "epoch"
                               ? I.state.epoch < I.args.eval_delay
                               : static_cast<double>(step) < I.args.eval_delay;
      if (I.has_eval && !delayed &&
          ((I.args.eval_strategy == "steps" && step % I.eval_every == 0) ||
           (I.args.eval_strategy == "epoch" && epoch_end))) {
        evaluate();
      }
      if ((I.args.save_strategy == "steps" && step % I.save_every == 0) ||
          (I.args.save_strategy == "epoch" && epoch_end)) {
        I.save_checkpoint();
      }
    }
  }

  TrainResult result;
  if (I.has_eval && I.last_eval_step != I.state.global_step) evaluate();
  result.eval_loss = I.last_eval_loss;
  if (I.args.load_best_model_at_end && I.state.best_model_checkpoint &&
      I.last_eval_loss != I.state.best_metric) {
    // The best checkpoint is read only from this run's output_dir, whatever the state file says.
    const std::optional<std::string> best = checkpoint_in(
        I.args.output_dir, fs::path(*I.state.best_model_checkpoint).filename().string());
    if (best) {
      if (I.rank == 0)
        log::info("loading the best checkpoint '{}' (eval_loss {:.4f})", *best,
                  *I.state.best_metric);
      load_engine_state(*I.engine, *best);
    } else if (I.rank == 0) {
      log::warn(
          "the best checkpoint '{}' is not a checkpoint folder in '{}'; the final weights stay "
          "those of the "
          "last step",
          *I.state.best_model_checkpoint, I.args.output_dir);
    }
  }
  bool available = false;
  auto weights = I.user_weights(available);
  LogRecord summary;
  summary.step = I.state.global_step;
  summary.epoch = I.epoch_progress();
  summary.train_loss =
      run_loss_steps > 0 ? run_loss_sum / static_cast<double>(run_loss_steps) : 0.0;
  summary.train_runtime = seconds_since(start);
  I.log(summary);
  on_every_rank(*I.comm, "writing the final model", [&] {
    if (I.rank != 0) return;
    fs::create_directories(I.args.output_dir);
    I.write_user_files(I.args.output_dir, available, weights);
    if (!available) {
      log::warn(
          "ZeRO-3 without stage3_gather_16bit_weights_on_model_save: the final weights stay "
          "sharded; "
          "run `zerotrain merge {}/checkpoint-{} OUT` to consolidate them",
          I.args.output_dir, I.state.global_step);
    }
    files::write_atomic(I.args.output_dir + "/trainer_state.json",
                        train::trainer_state_json(I.state));
    files::write_atomic(I.args.output_dir + "/loss.svg", train::loss_svg(I.state.log_history));
  });
  if (!available &&
      !fs::exists(fmt::format("{}/checkpoint-{}", I.args.output_dir, I.state.global_step))) {
    I.save_checkpoint();  // the sharded state is then the final model
  }
  result.global_step = I.state.global_step;
  result.train_loss = *summary.train_loss;
  result.best_checkpoint = I.state.best_model_checkpoint;
  result.output_dir = I.args.output_dir;
  return result;
}

}  // namespace zt
