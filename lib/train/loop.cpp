// The training loop: epochs, steps, the log window, evaluation, cancellation and preemption,
// and the final model at the end of train().
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <exception>
#include <filesystem>

#include <fmt/format.h>

#include "peft/pissa.hpp"
#include "train/log_window.hpp"
#include "train/objective.hpp"
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

std::pair<bool, int> Trainer::Impl::asked_to_stop(bool agree) {
  bool cancel = requests.asked->cancelled();
  int preempt = requests.asked->preempt_signal();
  if (agree && world > 1) {
    const std::vector<double> flags = comm::reduce_scalars(
        *comm, {cancel ? 1.0 : 0.0, static_cast<double>(preempt)}, ReduceOp::kMax);
    cancel = flags[0] > 0;
    preempt = static_cast<int>(flags[1]);
  }
  return {cancel, preempt};
}

CancelledError Trainer::Impl::stopped_before_first_step(int signal,
                                                        const std::string& during) const {
  const std::string who = signal > 0 ? fmt::format("stopped by signal {}", signal) : "cancelled";
  const std::string when = during.empty() ? "" : during + ",";
  if (run_dir.resume) {
    return CancelledError(fmt::format(
        "{}{} before the first step of this run: no checkpoint was saved; continue from '{}' "
        "with --resume_from_checkpoint {}",
        who, when, *run_dir.resume, *run_dir.resume));
  }
  return CancelledError(fmt::format(
      "{}{} before the first step: no checkpoint was saved; run again to start over", who, when));
}

void Trainer::Impl::poll_stop() const {
  if (requests.asked->cancelled() || requests.asked->preempt_signal() > 0) {
    throw CancelledError("a stop was asked");  // run_phase's agreement says what stopped
  }
}

void Trainer::Impl::stop_if_asked(const std::string& during, bool agree) {
  const auto [cancel, preempt] = asked_to_stop(agree);
  if (!cancel && preempt == 0) return;
  requests.stop_signal = preempt;
  throw stopped_before_first_step(preempt, during);
}

train::PhaseMeter Trainer::Impl::phase_meter(std::string what, std::string unit, double total,
                                             double scale) const {
  return train::PhaseMeter(std::move(what), std::move(unit), total, scale, rank == 0,
                           callbacks.on_progress);
}

void Trainer::Impl::run_phase(const std::string& what, const train::PhaseMeter* meter,
                              const std::function<void()>& fn) {
  std::exception_ptr stopped;
  on_every_rank(*comm, what, [&] {
    try {
      fn();
    } catch (const CancelledError&) {
      // A stop seen at one of fn's polls (poll_stop): asked on this rank, so the agreement
      // below sees it and ends the phase on every rank, not only here.
      stopped = std::current_exception();
    }
  });
  stop_if_asked(fmt::format(" while {}{}", what, meter ? " (" + meter->position() + ")" : ""),
                /*agree=*/true);
  if (stopped) std::rethrow_exception(stopped);  // never reached: the requests are sticky
}

void Trainer::Impl::check_cancel() {
  // [cancel, preempting signal], the largest of every rank's: one agreement per step.
  const auto [cancel, preempt] = asked_to_stop(/*agree=*/true);
  if ((cancel || preempt > 0) && state.global_step == 0) {
    // Nothing trained yet (a stop asked after the phases before the first step): nothing to
    // save, and no checkpoint-0 to name.
    requests.stop_signal = preempt;
    throw stopped_before_first_step(preempt, "");
  }
  if (preempt > 0) {
    // A scheduler's warning before preemption: keep this step's state, then stop.
    requests.stop_signal = preempt;
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
    const std::optional<std::string> newest = latest_checkpoint(args.output_dir);
    throw CancelledError(
        newest ? fmt::format("training cancelled at step {}; the newest checkpoint, '{}', is kept: "
                             "continue from it with --resume_from_checkpoint True",
                             state.global_step, *newest)
               : fmt::format("training cancelled at step {}, before any checkpoint was saved: "
                             "a new run starts from the beginning",
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
  // The mask stays on the host: CausalLM::loss reads its document spans there (no device sync)
  // and moves it itself.
  if (b.document_ids.defined()) {
    mask = b.document_ids + 1;  // documents numbered from 1, padding 0 (CausalLM::loss)
    positions = b.position_ids.to(device);
  } else if (!padding_only_at_row_ends(b.attention_mask)) {
    mask = b.attention_mask;
  }
  return model->loss(b.input_ids.to(device), b.labels, mask, 1024, positions);
}

void Trainer::Impl::log(const LogRecord& record) {
  state.log_history.push_back(record);
  if (rank != 0) return;
  log::info("{}", train::describe(record, total_steps));
  try {
    fs::create_directories(args.output_dir);
    files::append_text(args.output_dir + "/trainer_log.jsonl", record.json() + "\n");
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
    for (const auto& [key, value] : r.metrics) {  // HF's tags: eval_x as eval/x
      const bool eval = key.rfind("eval_", 0) == 0;
      tensorboard->scalar(eval ? "eval/" + key.substr(5) : "train/" + key, value, r.step);
    }
    if (r.loss || r.eval_loss) tensorboard->scalar("train/epoch", r.epoch, r.step);
  } catch (const std::exception& e) {
    log::warn("{} (TensorBoard reporting stops)",
              e.what());  // the run is worth more than its plots
    args.report_to = "none";
  }
}

double Trainer::Impl::run_evaluation() {
  if (!has_eval) throw ConfigError("evaluate: no eval_file given");
  objective->check_ready();
  objective->prepare();
  engine->wait_for_parameters();  // ranks may evaluate different numbers of batches
  return objective->evaluate();
}

double Trainer::Impl::evaluate() {
  const double loss = run_evaluation();
  LogRecord r;
  r.step = state.global_step;
  r.epoch = epoch_progress();
  r.eval_loss = loss;
  r.metrics = objective->evaluation_metrics();
  log(r);
  last_eval.loss = loss;
  last_eval.step = state.global_step;
  return loss;
}

double Trainer::evaluate() {
  return impl_->evaluate();
}

void Trainer::Impl::prepare_output_dir() {
  on_every_rank(*comm, fmt::format("preparing output_dir '{}'", args.output_dir), [&] {
    if (rank != 0) return;
    fs::create_directories(args.output_dir);
    // The log holds the run's history so far, each record once: a run that starts afresh starts
    // it afresh (a previous run's outputs are only here with --overwrite_output_dir); a resumed
    // run, with its checkpoint's records, the interrupted run's records past that step gone.
    const std::string log_path = args.output_dir + "/trainer_log.jsonl";
    if (state.log_history.empty()) {
      std::error_code ec;
      fs::remove(log_path, ec);
    } else {
      std::string lines;
      for (const LogRecord& r : state.log_history) lines += r.json() + "\n";
      files::write_atomic(log_path, lines);
    }
    if (!run_dir.superseded.empty()) {
      for (const std::string& dir : run_dir.superseded) {
        log::warn(
            "overwrite_output_dir: removing '{}', which is newer than the checkpoint resumed from",
            dir);
        files::remove_tree(dir);
      }
      std::error_code ec;
      const fs::path resumed = fs::absolute(*run_dir.resume).lexically_normal();
      if (fs::equivalent(resumed.parent_path(), args.output_dir, ec)) {
        files::write_atomic(args.output_dir + "/latest", resumed.filename().string() + "\n");
      }
    }
    write_run_settings(args.output_dir);
  });
  run_dir.superseded.clear();
}

Trainer::Impl::StepResult Trainer::Impl::run_step(const std::vector<int64_t>& order) {
  StepResult out = objective->step(order);
  state.global_step = engine->global_step();
  state.steps_in_epoch += 1;
  out.epoch_end = state.steps_in_epoch == steps_per_epoch;
  if (out.epoch_end) {  // the position a checkpoint saved now resumes from
    state.epoch_index += 1;
    state.steps_in_epoch = 0;
  }
  state.epoch = epoch_progress();
  state.tokens_seen += out.tokens;
  state.total_flos +=
      6.0 * static_cast<double>(out.tokens) * static_cast<double>(non_embedding_parameters);
  return out;
}

train::RunLoss Trainer::Impl::run_loss(const train::LogWindow& window) {
  // Every rank's window holds as many steps: all ranks reduce, or none.
  return window.run_loss(
      window.empty() ? 0.0 : comm::reduce_scalars(*comm, {window.local_loss_sum()})[0]);
}

void Trainer::Impl::log_window(train::LogWindow& window) {
  if (window.empty()) return;
  LogRecord r = window.close(comm::reduce_scalars(*comm, {window.local_loss_sum()})[0]);
  r.step = state.global_step;
  r.epoch = epoch_progress();
  r.learning_rate = engine->learning_rate();
  r.grad_norm = engine->last_grad_norm();
  if (ds.fp16.enabled.value()) r.loss_scale = engine->loss_scale();
  r.peak_memory_gib = window_peak_memory_gib();
  r.metrics = objective->take_window_metrics();
  log(r);
}

void Trainer::Impl::write_comm_timeline(int64_t step) {
  const char* prefix = std::getenv("ZT_COMM_TIMELINE");
  if (prefix == nullptr || *prefix == '\0') return;
  const std::vector<CollectiveTime> times = comm->take_timeline();
  if (times.empty()) return;
  std::string lines;
  for (const CollectiveTime& t : times) {
    lines += fmt::format(
        "{{\"step\": {}, \"op\": \"{}\", \"bytes\": {}, \"in_flight_ms\": {:.4f}, "
        "\"exposed_ms\": {:.4f}}}\n",
        step, t.op, t.bytes, t.in_flight_ms, t.exposed_ms);
  }
  try {
    files::append_text(fmt::format("{}.rank{}.jsonl", prefix, rank), lines);
  } catch (const std::exception& e) {
    log::warn("ZT_COMM_TIMELINE: {}", e.what());
  }
}

void Trainer::Impl::after_step(const StepResult& done, train::LogWindow& window,
                               const RunClock& clock) {
  const int64_t step = state.global_step;
  write_comm_timeline(step);
  if (callbacks.on_step) {
    StepStats st;
    st.global_step = step;
    st.stepped = true;
    st.skipped = engine->last_step_skipped();
    st.loss = comm::reduce_scalars(*comm, {done.loss.item<double>()})[0];  // all ranks' mean
    st.grad_norm = engine->last_grad_norm();
    st.learning_rate = engine->learning_rate();
    st.loss_scale = engine->loss_scale();
    callbacks.on_step(st);
  }
  const bool last = step == total_steps;
  const std::string& logging = args.logging_strategy;
  if ((logging == "steps" && (step % log_every == 0 || (args.logging_first_step && step == 1))) ||
      (logging == "epoch" && done.epoch_end) || (logging != "no" && last)) {
    log_window(window);
  }
  if (rank == 0 && callbacks.on_progress) {
    Progress p;
    p.step = step;
    p.total_steps = total_steps;
    p.epoch = epoch_progress();
    p.loss = window.last_logged_loss();
    p.learning_rate = engine->learning_rate();
    const double elapsed = seconds_since(clock.start);
    p.tokens_per_second = static_cast<double>(state.tokens_seen) / std::max(1e-9, elapsed);
    p.eta_seconds = elapsed / static_cast<double>(step - clock.first_step) *
                    static_cast<double>(total_steps - step);
    callbacks.on_progress(p);
  }
  const bool delayed = args.eval_strategy == "epoch" ? state.epoch < args.eval_delay
                                                     : static_cast<double>(step) < args.eval_delay;
  if (has_eval && !delayed &&
      ((args.eval_strategy == "steps" && step % eval_every == 0) ||
       (args.eval_strategy == "epoch" && done.epoch_end))) {
    evaluate();
  }
  if ((args.save_strategy == "steps" && step % save_every == 0) ||
      (args.save_strategy == "epoch" && done.epoch_end)) {
    save_checkpoint();
  }
}

void Trainer::Impl::load_best_at_end() {
  if (!args.load_best_model_at_end || !state.best_model_checkpoint ||
      last_eval.loss == state.best_metric) {
    return;
  }
  // The best checkpoint is read only from this run's output_dir, whatever the state file says.
  const std::optional<std::string> best =
      checkpoint_in(args.output_dir, fs::path(*state.best_model_checkpoint).filename().string());
  if (best) {
    if (rank == 0) {
      log::info("loading the best checkpoint '{}' (eval_loss {:.4f})", *best, *state.best_metric);
    }
    load_engine_state(*engine, *best);
  } else if (rank == 0) {
    log::warn(
        "the best checkpoint '{}' is not a checkpoint folder in '{}'; the final weights stay "
        "those of the last step",
        *state.best_model_checkpoint, args.output_dir);
  }
}

TrainResult Trainer::Impl::finish_training(const train::LogWindow& window) {
  TrainResult result;
  if (has_eval && last_eval.step != state.global_step) evaluate();
  result.eval_loss = last_eval.loss;
  load_best_at_end();
  bool available = false;
  auto weights = user_weights(available);
  LogRecord summary;
  summary.step = state.global_step;
  summary.epoch = epoch_progress();
  const train::RunLoss loss = run_loss(window);  // every step, a resumed run's earlier ones too
  state.train_loss_sum = loss.sum;
  state.train_loss_steps = loss.steps;
  summary.train_loss = loss.mean();
  summary.train_runtime = seconds_since(created);  // the phases before the first step included
  log(summary);
  on_every_rank(*comm, "writing the final model", [&] {
    if (rank != 0) return;
    fs::create_directories(args.output_dir);
    write_user_files(args.output_dir, available, weights);
    if (!available) {
      log::warn(
          "ZeRO-3 without stage3_gather_16bit_weights_on_model_save: the final weights stay "
          "sharded; run `zerotrain merge {}/checkpoint-{} OUT` to consolidate them",
          args.output_dir, state.global_step);
    }
    if (args.pissa_convert) {
      peft::save_pissa_converted(*model, peft, args.output_dir + "/" + peft::kPissaInitDir,
                                 args.output_dir + "/" + peft::kPissaConvertedDir, weights);
    }
    files::write_atomic(args.output_dir + "/trainer_state.json", train::trainer_state_json(state));
    files::write_atomic(args.output_dir + "/loss.svg", train::loss_svg(state.log_history));
  });
  if (!available &&
      !fs::exists(fmt::format("{}/checkpoint-{}", args.output_dir, state.global_step))) {
    save_checkpoint();  // the sharded state is then the final model
  }
  result.global_step = state.global_step;
  result.train_loss = *summary.train_loss;
  result.best_checkpoint = state.best_model_checkpoint;
  result.output_dir = args.output_dir;
  return result;
}

TrainResult Trainer::train() {
  Impl& I = *impl_;
  if (!I.has_train) throw ConfigError("train: no train_file given (--train_file DATA.jsonl)");
  return I.posting_failures([&] { return I.train(); });
}

TrainResult Trainer::Impl::train() {
  Impl& I = *this;
  I.objective->check_ready();
  I.announce();
  I.prepare_output_dir();
  if (I.state.global_step == 0) I.write_pissa_start();
  I.objective->prepare();
  // Not again at a step the resumed checkpoint evaluated.
  if (I.args.eval_on_start && I.has_eval && I.last_eval.step != I.state.global_step) {
    I.evaluate();
  }
  I.model->train();

  const Impl::RunClock clock{Clock::now(), I.state.global_step};
  train::LogWindow& window = I.open_window.emplace(
      I.comm->device(), train::RunLoss{I.state.train_loss_sum, I.state.train_loss_steps});
  const int64_t megabatch = length_megabatch(I.train_samples, I.batch.size());
  while (I.state.global_step < I.total_steps) {
    // Each epoch's own order, from the seed and the epoch alone (HF's sampler with set_epoch):
    // a resumed run rebuilds the same one.
    const bool shuffle = I.args.train_sampling_strategy != "sequential";
    const std::vector<int64_t> order =
        I.objective->epoch_order(I.state.epoch_index, shuffle, megabatch);
    bool epoch_end = false;
    while (!epoch_end && I.state.global_step < I.total_steps) {
      I.check_cancel();
      const Impl::StepResult done = I.run_step(order);
      window.add_step(done.loss, done.tokens);
      I.after_step(done, window, clock);
      epoch_end = done.epoch_end;
    }
  }
  TrainResult result = I.finish_training(window);
  I.open_window.reset();  // its steps are in state.train_loss_* now
  return result;
}

void Trainer::Impl::write_pissa_start() {
  if (peft.type != FinetuningType::kLora || !peft::pissa_iterations(peft.lora.init_lora_weights))
    return;
  bool available = false;
  const auto weights = user_weights(available);  // collective: the factors as they start
  on_every_rank(*comm, "writing the starting PiSSA adapter", [&] {
    if (rank != 0) return;
    // With init_lora_weights true, as LLaMA-Factory and PEFT's example write it: what the
    // conversion subtracts, and an adapter over the residual base.
    PeftConfig start = peft;
    start.lora.init_lora_weights = "true";
    save_adapter(*model, start, args.output_dir + "/" + peft::kPissaInitDir, weights);
  });
}

double Trainer::Impl::epoch_progress() const {
  return static_cast<double>(state.epoch_index) +
         static_cast<double>(state.steps_in_epoch) /
             static_cast<double>(std::max<int64_t>(1, steps_per_epoch));
}

std::optional<double> Trainer::Impl::window_peak_memory_gib() {
  const at::Device device = comm->device();
  if (!device.is_cuda()) return std::nullopt;
  const int index = device.has_index() ? device.index() : 0;
  const double peak = comm::reduce_scalars(
      *comm, {static_cast<double>(device_stats::peak_allocated(index))}, ReduceOp::kMax)[0];
  device_stats::reset_peak(index);
  return peak / (1024.0 * 1024.0 * 1024.0);
}

}  // namespace zt
