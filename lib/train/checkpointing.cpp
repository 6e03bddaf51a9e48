// The Trainer's checkpoints (saving, rotation through CheckpointWriter, resuming state) and
// the files a user loads directly: adapters or the whole model, in the output folder and in
// every checkpoint.
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "model/kept_parts.hpp"
#include "train/objective.hpp"
#include "train/resume_check.hpp"
#include "train/trainer_impl.hpp"
#include "util/log.hpp"
#include "util/rng.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt {

using comm::on_every_rank;
namespace fs = std::filesystem;

std::vector<std::pair<std::string, at::Tensor>> Trainer::Impl::user_weights(bool& available) {
  available = true;
  engine->wait_for_parameters();  // below stage 3 rank 0 reads the module itself
  if (adapter_method) return engine->gather_full_parameters(/*trainable_only=*/true);
  // Under expert parallelism each rank holds a share of the experts: the whole is gathered.
  if (model->config().expert_shard.size > 1) return engine->gather_full_parameters();
  if (engine->stage() == 3) {
    if (!ds.zero.stage3_gather_16bit_weights_on_model_save) {
      available = false;
      return {};
    }
    return engine->gather_full_parameters();
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (rank == 0) {
    for (const auto& item : model->named_parameters(true))
      out.emplace_back(item.key(), item.value().detach());
  }
  return out;
}

void Trainer::Impl::write_user_files(
    const std::string& dir, bool available,
    const std::vector<std::pair<std::string, at::Tensor>>& weights) {
  if (rank != 0) return;
  if (adapter_method) {
    save_adapter(*model, peft, dir, weights);
  } else {
    // config.json always, so `zerotrain merge` can consolidate a checkpoint without weights.
    const at::ScalarType dtype = engine->compute_dtype();
    ModelConfig c = model_config;
    c.dtype = dtype;
    files::write_atomic(dir + "/config.json", model_config_json(c) + "\n");
    if (available) {
      // A multimodal folder's vision tower and projector, not trained: the base's, as they are.
      const model::KeptParts kept = model::kept_parts_of(c, {model_dir});
      SafetensorsStreamWriter writer(dir, [&] {
        std::vector<TensorEntry> plan;
        for (const auto& [name, value] : weights)
          plan.push_back(TensorEntry{name, dtype, value.sizes().vec()});
        kept.plan(plan, dtype);
        return plan;
      }());
      for (const auto& [name, value] : weights) writer.write(name, value);
      kept.write(writer, dtype);
      writer.finish();
    }
  }
  if (!model_dir.empty()) copy_model_companion_files(model_dir, dir);
  record_template(dir, applied_template());  // what `zerotrain verify` asks with
}

void Trainer::Impl::write_rng_state(const std::string& dir) const {
  std::vector<std::pair<std::string, at::Tensor>> states{{"cpu", rng::state(at::kCPU)}};
  if (comm->device().is_cuda()) states.emplace_back("device", rng::state(comm->device()));
  fs::create_directories(dir + "/rng");
  save_safetensors(fmt::format("{}/rng/rank-{:05d}.safetensors", dir, rank), states);
}

void Trainer::Impl::read_rng_state(const std::string& dir) const {
  const std::string path = fmt::format("{}/rng/rank-{:05d}.safetensors", dir, rank);
  if (!fs::exists(path)) return;  // a rank the saved run did not have keeps its fresh seed
  SafetensorsFile f(path);
  // A state of another size or dtype than the generator's own is another build's or a damaged
  // file: said with the file and the sizes, never LibTorch's text.
  auto restore = [&](const char* name, const at::Device& device) {
    if (!f.contains(name)) {
      throw IoError(
          fmt::format("'{}' lacks the '{}' random state; the checkpoint is damaged", path, name));
    }
    const at::Tensor saved = f.load(name);
    const at::Tensor own = rng::state(device);
    if (saved.scalar_type() != own.scalar_type() || saved.sizes() != own.sizes()) {
      throw IoError(fmt::format(
          "'{}': the '{}' random state has {} elements of {}, but this build's generator keeps "
          "{} of {}; the checkpoint is damaged or from another LibTorch: remove its rng folder to "
          "resume with a fresh random stream",
          path, name, saved.numel(), c10::toString(saved.scalar_type()), own.numel(),
          c10::toString(own.scalar_type())));
    }
    rng::set_state(device, saved);
  };
  restore("cpu", at::kCPU);
  if (comm->device().is_cuda() && f.contains("device")) restore("device", comm->device());
}

void Trainer::Impl::check_disk_space(const std::string& what) const {
  // What a checkpoint holds, generously: every kind of optimizer state in fp32 over all ranks,
  // and the weights a user loads (the adapter, or the whole model in the compute dtype).
  int64_t trainable = 0;
  for (const auto& [name, shape] : engine->trainable_parameters()) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    trainable += n;
  }
  const double state_bytes =
      static_cast<double>(trainable) * 4.0 * static_cast<double>(engine->state_kinds().size());
  const double weights = adapter_method
                             ? static_cast<double>(trainable) * 4.0
                             : static_cast<double>(parameters.all) *
                                   static_cast<double>(c10::elementSize(engine->compute_dtype()));
  const double needed = 1.1 * (state_bytes + weights) + 64.0 * (1 << 20);
  std::optional<uint64_t> free = files::free_bytes(args.output_dir);
  if (const char* fake = std::getenv("ZT_TEST_FREE_BYTES"))
    free = std::strtoull(fake, nullptr, 10);  // tests
  if (free && static_cast<double>(*free) < needed) {
    throw IoError(fmt::format(
        "not enough free disk for {} in '{}': about {:.2f} GiB needed, {:.2f} GiB free; make "
        "room or lower save_total_limit (earlier checkpoints are intact)",
        what, args.output_dir, needed / (1 << 30), static_cast<double>(*free) / (1 << 30)));
  }
}

void Trainer::Impl::save_checkpoint() {
  const int64_t step = state.global_step;
  on_every_rank(*comm, "checking free disk space", [&] {
    if (rank == 0) check_disk_space(fmt::format("checkpoint-{}", step));
  });
  const std::string final_dir = fmt::format("{}/checkpoint-{}", args.output_dir, step);
  const bool greater = args.greater_is_better.value_or(false);
  if (last_eval.step == step && last_eval.loss &&
      (!state.best_metric ||
       (greater ? *last_eval.loss > *state.best_metric : *last_eval.loss < *state.best_metric))) {
    state.best_metric = last_eval.loss;
    state.best_model_checkpoint = final_dir;
    state.best_global_step = step;
  }
  CheckpointWriter writer(*comm, args.output_dir, step, args.overwrite_output_dir);
  write_checkpoint(writer, /*in_run=*/true);
  if (rank == 0) log::info("saved {}", final_dir);
}

void Trainer::Impl::write_checkpoint(CheckpointWriter& writer, bool in_run) {
  if (open_window) {
    // The run's loss through this step, the steps not logged yet included: a run resumed from
    // here reports train_loss over all its steps.
    const train::RunLoss loss = run_loss(*open_window);
    state.train_loss_sum = loss.sum;
    state.train_loss_steps = loss.steps;
  }
  state.save_id = save_engine_state(*engine, writer.dir());
  bool available = false;
  std::vector<std::pair<std::string, at::Tensor>> weights = user_weights(available);
  bool ok = true;
  try {
    write_user_files(writer.dir(), available, weights);
    write_rng_state(writer.dir());
    objective->write_state(writer.dir());
    if (rank == 0) {
      files::write_atomic(writer.dir() + "/trainer_state.json", train::trainer_state_json(state));
      files::write_atomic(writer.dir() + "/zerotrain_state.json",
                          train::zerotrain_state_json(state));
      write_run_settings(writer.dir());
    }
  } catch (const std::exception& e) {
    ok = false;
    log::error("rank {}: writing a checkpoint into '{}': {}", rank, writer.dir(), e.what());
  }
  if (in_run) {
    writer.commit(ok, args.save_total_limit, state.best_model_checkpoint.value_or(""));
  } else {
    writer.commit(ok);
  }
}

void Trainer::save_checkpoint(const std::string& dir) {
  Impl& I = *impl_;
  CheckpointWriter writer = CheckpointWriter::to_folder(*I.comm, dir);
  I.write_checkpoint(writer, /*in_run=*/false);
}

void Trainer::load_checkpoint(const std::string& dir) {
  // The model is built: a checkpoint of another model, method or data is refused, not taken.
  on_every_rank(*impl_->comm, fmt::format("checking '{}' against this run", dir), [&] {
    TrainingArguments args = impl_->args;
    train::reconcile_resumed_arguments(args, dir, train::ResumeDifferences::kRefuse);
  });
  impl_->restore(dir);
}

void Trainer::export_model(const std::string& dir) {
  Impl& I = *impl_;
  bool available = false;
  auto weights = I.user_weights(available);
  if (!available) {
    // ZeRO-3 without 16-bit gathering keeps no whole copy anywhere; exporting gathers anyway.
    weights = I.engine->gather_full_parameters();
    available = true;
  }
  on_every_rank(*I.comm, fmt::format("exporting the model to '{}'", dir), [&] {
    if (I.rank != 0) return;
    fs::create_directories(dir);
    I.write_user_files(dir, available, weights);
  });
}

void Trainer::Impl::write_run_settings(const std::string& dir) const {
  const std::string text = fmt::format(
      R"({{"zerotrain_version": "{}", "training_arguments": {}, "deepspeed_config": {}}})",
      ZT_VERSION_STRING, training_arguments_json(args), deepspeed_config_json(ds));
  files::write_atomic(dir + "/training_args.json",
                      json::dump(json::parse(text, "training_args.json"), true) + "\n");
}

}  // namespace zt
