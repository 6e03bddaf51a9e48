// Training-step throughput and peak GPU memory of zerotrain's decoder on a real model shape,
// printed as `RESULT {json}` to set beside shared/bench/hf_baseline.py in the same run.
//
//   zt_bench_model SHAPE MODE SEQ MICRO_BATCH CKPT [STEPS]
//
// MODE full: pure bf16 (DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states,
// i.e. bf16 weights, gradients and Adam moments, as the peer's "full" row), ZeRO-2 at one rank;
// full_amp: bf16 compute with fp32 masters and moments; lora: LoRA r16 / alpha 32 on all linear
// layers (the peer's PEFT row); qlora: the same over a 4-bit NF4 base with double
// quantization (QLoRA); dora / qdora: DoRA instead of LoRA, over the bf16 / 4-bit base; freeze: the
// last two layers train. The adapter modes keep the trainable parameters' masters and moments in
// fp32 (mixed precision, as the peer's PEFT run). Weights are random (seeded) and never built whole
// on the host: the engine reads them bucket by bucket from a random source. No gradient clipping,
// as the peer (ZT_BENCH_CLIP=1.0 clips). ZeRO stage 2 unless ZT_BENCH_STAGE says otherwise. Updates
// run inside backward where the engine allows it (EngineOptions::update_in_backward: full mode
// without clipping); ZT_BENCH_IN_BACKWARD=0 keeps them in step(). ZT_BENCH_KEEP=none|auto|GiB: what
// checkpointed layers keep to skip products (gradient_checkpointing_keep; default auto).
// ZT_BENCH_OFFLOAD=1: recomputed layers hold their saved inputs in host memory (use_unsloth_gc),
// within ZT_BENCH_HOST_GIB of it if given. ZT_BENCH_SPAN=N: one checkpoint per N layers
// (recompute_num_layers). ZT_BENCH_TILED=1: the tiled MLP (ZT_BENCH_TILES its shards).
// ZT_BENCH_LAYERS=L: the shape's width with L layers. The result adds the activations' host
// peak (host_activations_gib) and the process's peak resident host memory (host_rss_gib).
// ZT_BENCH_PHASES=1 synchronizes between forward, backward and the optimizer step and reports
// each one's time (fwd_s, bwd_s, opt_s); the synchronization costs a little overlap.
// Real lengths (LoRA as above, examples from ZT_BENCH_LENGTHS: a file of lengths, one per line —
// the peer's varlen_lengths(), so both sides see the same ones), batched as the trainer does:
// lora_varlen pads each micro-batch of MICRO_BATCH examples to its longest (the peer's
// lora_varlen; padding at row ends needs no mask); lora_packed packs them in order into rows of
// SEQ tokens (zt::pack), MICRO_BATCH rows a step, documents kept apart by variable-length
// attention on the GPU. tokens_per_s counts real tokens; padding is the fraction of the batch's
// positions that are padding.
// Preference training (docs/preference.md), LoRA as above: dpo is a DPO step (sigmoid) over
// MICRO_BATCH / 2 pairs — MICRO_BATCH rows of SEQ tokens, the chosen then the rejected ones, the
// first quarter of each row prompt — with the reference pass online (the same forward with the
// adapters off, without gradients); dpo_pre the same with the reference's log-probs given (as
// precompute_ref_log_probs). tokens_per_s counts every row's tokens, so it sits beside lora at
// the same SEQ and MICRO_BATCH.
#include <sys/resource.h>

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <vector>

#include <fmt/format.h>

#include "model/blocks.hpp"
#include "model/quantized_weights.hpp"
#include "peft/init_sources.hpp"
#include "quant/blockwise.hpp"
#include "quant/four_bit_weight.hpp"
#include "shapes.hpp"
#include "train/preference.hpp"
#include "util/device_stats.hpp"
#include "zerotrain/comm.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"

using namespace zt;

namespace {

// ZT_BENCH_RANDOM_4BIT=1: a 4-bit base's storage drawn directly — random codes, the scales of a
// small quantized sample repeated — instead of random values quantized on the host, which takes
// minutes for a 100B shape. Speed and memory do not depend on the values.
class RandomFourBitSource final : public ParameterSource {
 public:
  RandomFourBitSource(std::shared_ptr<ParameterSource> other,
                      std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> layouts)
      : other_(std::move(other)), layouts_(std::move(layouts)) {}

  void read(const std::string& name, const std::vector<int64_t>& shape, int64_t offset,
            const at::Tensor& out) override {
    auto it = layouts_.find(name);
    if (it == layouts_.end() || out.scalar_type() != at::kByte) {
      other_->read(name, shape, offset, out);
      return;
    }
    if (name != current_) {
      storage_ = draw(*it->second);
      current_ = name;
    }
    out.copy_(storage_.narrow(0, offset, out.numel()));
  }

 private:
  static at::Tensor draw(const quant::FourBitLayout& l) {
    quant::FourBitLayout small = l;
    small.groups = 1;
    small.rows = quant::kNestedBlocksize;
    small.cols = l.blocksize;
    const at::Tensor sample =
        quant::quantize_weight(small, at::randn({small.rows, small.cols}) * 0.02);
    at::Tensor s = at::empty({l.bytes()}, at::kByte);
    s.narrow(0, 0, l.codes_bytes()).random_(0, 256);
    auto tile = [&](int64_t at, int64_t from, int64_t unit, int64_t count) {
      const at::Tensor piece = sample.narrow(0, from, unit);
      at::Tensor dest = s.narrow(0, at, count * unit).view({count, unit});
      dest.copy_(piece.view({1, unit}).expand({count, unit}));
    };
    if (l.double_quant) {
      tile(l.absmax_offset(), small.absmax_offset(), 1, l.blocks());  // the first block's code
      tile(l.nested_absmax_offset(), small.nested_absmax_offset(), 4, l.nested_blocks());
      s.narrow(0, l.nested_code_offset(), 4 * 256 + 4)
          .copy_(sample.narrow(0, small.nested_code_offset(), 4 * 256 + 4));
    } else {
      tile(l.absmax_offset(), small.absmax_offset(), 4, l.blocks());
    }
    return s;
  }

  std::shared_ptr<ParameterSource> other_;
  std::map<std::string, std::shared_ptr<const quant::FourBitLayout>> layouts_;
  std::string current_;
  at::Tensor storage_;
};

// The micro-batches of a real-length mode: `count` batches from the lengths in `path`, random
// token ids (labels = ids, as the peer), padded per batch or packed into rows of `seq`.
std::vector<Batch> real_length_batches(const std::string& path, bool packed, int64_t seq,
                                       int64_t mbs, int64_t count, int64_t vocab) {
  std::ifstream in(path);
  if (!in) throw IoError("ZT_BENCH_LENGTHS: cannot read '" + path + "'");
  Dataset examples;
  at::manual_seed(0);
  for (int64_t n; in >> n;) {
    if (n < 1 || n > seq)
      throw ConfigError(fmt::format("ZT_BENCH_LENGTHS: length {} not in [1, SEQ]", n));
    at::Tensor ids = at::randint(0, vocab, {n}, at::kInt).contiguous();
    std::vector<int32_t> v(ids.data_ptr<int32_t>(), ids.data_ptr<int32_t>() + n);
    examples.add(v, v);
  }
  std::vector<int64_t> order(static_cast<size_t>(examples.size()));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  const Dataset rows = packed ? pack(examples, seq, order) : examples;
  if (rows.size() < mbs * count) {
    throw ConfigError(fmt::format("ZT_BENCH_LENGTHS: {} {} for {} batches of {}; give more lengths",
                                  rows.size(), packed ? "packed rows" : "examples", count, mbs));
  }
  std::vector<Batch> batches;
  for (int64_t b = 0; b < count; ++b) {
    std::vector<int64_t> indices;
    for (int64_t i = 0; i < mbs; ++i) indices.push_back(b * mbs + i);
    batches.push_back(collate(rows, indices, 0));
  }
  return batches;
}

// The most resident host memory this process has held, in GiB (page-locked memory included).
double peak_rss_gib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / (1024.0 * 1024.0);  // ru_maxrss is in KiB
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: zt_bench_model SHAPE MODE SEQ MICRO_BATCH CKPT [STEPS]\n");
    return 2;
  }
  const std::string shape = argv[1], mode = argv[2];
  const int64_t seq = std::atol(argv[3]), mbs = std::atol(argv[4]);
  const bool ckpt = std::atoi(argv[5]) != 0;
  const int steps = argc > 6 ? std::atoi(argv[6]) : 8;
  // Untimed steps first (3; ZT_BENCH_WARMUP=0 for the long-context ladder's single steps).
  const int warm = std::getenv("ZT_BENCH_WARMUP") ? std::atoi(std::getenv("ZT_BENCH_WARMUP")) : 3;
  const at::Device device = at::getNumGPUs() > 0 ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  try {
    ModelConfig c = bench::shape_config(shape);
    // ZT_BENCH_LAYERS: the shape's width with fewer layers (the memory per layer at lengths
    // whose whole-depth step would not fit one run).
    if (const char* layers = std::getenv("ZT_BENCH_LAYERS"))
      c.num_hidden_layers = std::atol(layers);
    // qlora: LoRA over a 4-bit base, NF4 with double quantization (QLoRA's recipe).
    if (mode == "qlora" || mode == "qdora") c.quantization = QuantizationConfig{};
    auto model =
        std::make_shared<CausalLM>(c, at::TensorOptions().dtype(at::kBFloat16).device(device),
                                   /*allocate=*/false);
    const bool real_lengths = mode == "lora_varlen" || mode == "lora_packed";
    const bool preference = mode == "dpo" || mode == "dpo_pre";
    const bool adapter =
        mode == "lora" || mode == "qlora" || mode == "dora" || mode == "qdora" || preference;
    if (mode != "full" && mode != "full_amp" && mode != "freeze" && !adapter && !real_lengths) {
      throw ConfigError(
          "MODE must be full, full_amp, lora, qlora, dora, qdora, freeze, lora_varlen, "
          "lora_packed, dpo or dpo_pre, not '" +
          mode + "'");
    }
    if (const char* cap = std::getenv("ZT_BENCH_CAP_GIB"); cap != nullptr && device.is_cuda()) {
      // A smaller card: the allocator may hold no more than this (the 24 GB card row).
      device_stats::cap_memory(0, static_cast<int64_t>(std::atof(cap) * (1LL << 30)));
    }
    std::vector<Batch> batches;
    if (real_lengths) {
      const char* lengths = std::getenv("ZT_BENCH_LENGTHS");
      if (lengths == nullptr) throw ConfigError(mode + " needs ZT_BENCH_LENGTHS");
      batches =
          real_length_batches(lengths, mode == "lora_packed", seq, mbs, steps + warm, c.vocab_size);
    }
    const bool pure = mode == "full";
    DeepSpeedConfig ds = parse_deepspeed_config(fmt::format(
        R"({{"bf16": {{"enabled": true{}}}, "gradient_clipping": {},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-5}}}},
            "zero_optimization": {{"stage": {}, "reduce_bucket_size": "auto"}}}})",
        pure ? R"(, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true)" : "",
        std::getenv("ZT_BENCH_CLIP") ? std::atof(std::getenv("ZT_BENCH_CLIP")) : 0.0,
        std::getenv("ZT_BENCH_STAGE") ? std::atoi(std::getenv("ZT_BENCH_STAGE")) : 2));
    TrainingArguments args;
    args.per_device_train_batch_size = mbs;
    args.lr_scheduler_type = "constant";
    if (adapter || real_lengths) {
      const char* target = std::getenv("ZT_BENCH_TARGET");  // all-linear unless given
      apply_training_flags(args,
                           {"--finetuning_type", "lora", "--lora_r", "16", "--lora_alpha", "32",
                            "--lora_target_modules", target ? target : "all-linear", "--use_dora",
                            mode == "dora" || mode == "qdora" ? "true" : "false"});
    } else if (mode == "freeze") {
      apply_training_flags(args, {"--finetuning_type", "freeze", "--freeze_trainable_layers", "2"});
    }
    const ParameterCount counts = apply_peft_from_args(*model, args, 0);
    // ZT_BENCH_TILED=1: ALST's tiled MLP (tiled_mlp; ZT_BENCH_TILES: its shards, else ALST's).
    if (std::getenv("ZT_BENCH_TILED") && std::string(std::getenv("ZT_BENCH_TILED")) == "1") {
      const char* tiles = std::getenv("ZT_BENCH_TILES");
      model->set_tiled_mlp(true, tiles ? std::atol(tiles) : 0);
    }
    resolve_config(ds, args, ResolveContext{1, c.hidden_size, steps + warm});
    CommOptions co;
    co.device = device;
    std::shared_ptr<Communicator> comm = create_communicator(LaunchEnv{}, co);
    EngineOptions eo;
    eo.device = device;
    eo.units = model->units();
    eo.gate = &model->gate();
    eo.activation_checkpointing = ckpt;
    if (const char* keep = std::getenv("ZT_BENCH_KEEP")) {  // as gradient_checkpointing_keep
      args.gradient_checkpointing_keep = keep;
      eo.recompute_keep_bytes = recompute_keep_bytes_for(args);
    }
    args.use_unsloth_gc =
        std::getenv("ZT_BENCH_OFFLOAD") && std::string(std::getenv("ZT_BENCH_OFFLOAD")) == "1";
    eo.offload_activations = args.use_unsloth_gc;
    // ZT_BENCH_SPAN: recompute_num_layers; ZT_BENCH_HOST_GIB: the host budget of use_unsloth_gc.
    if (const char* span = std::getenv("ZT_BENCH_SPAN")) eo.units_per_checkpoint = std::atol(span);
    if (const char* host = std::getenv("ZT_BENCH_HOST_GIB")) {
      eo.offload_activations_host_bytes = static_cast<int64_t>(std::atof(host) * (1LL << 30));
    }
    eo.total_train_steps = steps + warm;
    std::shared_ptr<ParameterSource> base = random_source(c, 0);
    if (auto quantized = model::quantized_weights(*model); !quantized.empty()) {
      const char* direct = std::getenv("ZT_BENCH_RANDOM_4BIT");
      base = direct != nullptr && std::string(direct) == "1"
                 ? std::make_shared<RandomFourBitSource>(base, std::move(quantized))
                 : model::quantizing_source(*base, std::move(quantized), base);
    }
    base = peft::dora_source(base, *model, peft_config_for(args).lora);
    eo.source = with_adapter_values(base, *model);
    eo.update_in_backward = !(std::getenv("ZT_BENCH_IN_BACKWARD") &&
                              std::string(std::getenv("ZT_BENCH_IN_BACKWARD")) == "0");
    auto t_init = std::chrono::steady_clock::now();
    Engine engine(model, ds, comm, eo);
    const double init_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_init).count();

    at::manual_seed(0);
    at::Tensor ids = at::randint(0, c.vocab_size, {mbs, seq}, at::kLong);
    if (preference && mbs % 2 != 0) throw ConfigError("dpo needs an even MICRO_BATCH (pairs)");
    at::Tensor pref_labels = ids.clone();
    pref_labels.narrow(1, 0, seq / 4).fill_(kIgnoreLabel);
    const int64_t pairs = mbs / 2;
    const at::Tensor given_reference =
        at::full({mbs}, -1.0 * seq, at::TensorOptions().device(device));
    train::PreferenceOptions dpo;
    const bool phases =
        std::getenv("ZT_BENCH_PHASES") && std::string(std::getenv("ZT_BENCH_PHASES")) == "1";
    using Clock = std::chrono::steady_clock;
    double total = 0, loss_value = 0, phase_s[3] = {0, 0, 0};
    int64_t real_tokens = 0, positions = 0;  // of the timed steps
    Clock::time_point mark;
    auto lap = [&](int phase, bool timed) {  // with ZT_BENCH_PHASES: the time since the last mark
      if (!phases) return;
      if (device.is_cuda()) torch::cuda::synchronize();
      const Clock::time_point now = Clock::now();
      if (timed) phase_s[phase] += std::chrono::duration<double>(now - mark).count();
      mark = now;
    };
    for (int s = 0; s < steps + warm; ++s) {
      if (s == warm && warm > 0) device_stats::reset_peak(0);
      if (device.is_cuda()) torch::cuda::synchronize();
      auto t0 = Clock::now();
      mark = t0;
      LossSum loss;
      if (real_lengths) {  // as the trainer's forward: a mask only for packed rows
        const Batch& b = batches[static_cast<size_t>(s)];
        const bool packed_rows = b.document_ids.defined();
        loss = model->loss(b.input_ids.to(device), b.labels,
                           packed_rows ? b.document_ids + 1 : at::Tensor(), 1024,
                           packed_rows ? b.position_ids.to(device) : at::Tensor());
        if (s >= warm) {
          real_tokens += b.attention_mask.sum().item<int64_t>();
          positions += b.attention_mask.numel();
        }
      } else if (preference) {
        const at::Tensor on_device = ids.to(device);
        at::Tensor reference = given_reference;
        if (mode == "dpo") {
          at::NoGradGuard no_grad;
          model->eval();
          model->set_adapters_enabled(false);
          reference = model->label_log_probs(on_device, pref_labels).sum(1);
          model->set_adapters_enabled(true);
          model->train();
        }
        // As the trainer: the log-probs and the logits metrics' mean logits of one forward.
        at::Tensor mean_logits;
        const at::Tensor logps =
            model->label_log_probs(on_device, pref_labels, {}, 1024, {}, &mean_logits).sum(1);
        const at::Tensor logits = train::answer_logit_sums(mean_logits, pref_labels);
        const at::Tensor tokens = at::full({pairs}, 0.75 * seq, logps.options());
        train::PairLogProbs lp;
        lp.chosen = logps.narrow(0, 0, pairs);
        lp.rejected = logps.narrow(0, pairs, pairs);
        lp.ref_chosen = reference.narrow(0, 0, pairs);
        lp.ref_rejected = reference.narrow(0, pairs, pairs);
        lp.chosen_tokens = lp.rejected_tokens = tokens;
        lp.chosen_logits = logits.narrow(0, 0, pairs);
        lp.rejected_logits = logits.narrow(0, pairs, pairs);
        const train::PreferenceLosses out = train::preference_losses(dpo, lp);
        loss = {out.loss.sum(), pairs};
      } else {
        loss = model->loss(ids, ids);  // labels = inputs, as the peer does
      }
      lap(0, s >= warm);
      engine.backward(loss.sum, static_cast<double>(loss.tokens));
      lap(1, s >= warm);
      engine.step();
      lap(2, s >= warm);
      if (device.is_cuda()) torch::cuda::synchronize();
      if (s >= warm) total += std::chrono::duration<double>(Clock::now() - t0).count();
      loss_value = loss.sum.item<double>() / static_cast<double>(loss.tokens);
    }
    const double step_s = total / steps;
    const double tokens_per_s = real_lengths ? static_cast<double>(real_tokens) / total
                                             : static_cast<double>(mbs * seq) / step_s;
    const std::string padding =
        real_lengths
            ? fmt::format(R"(, "padding": {:.3f})",
                          1.0 - static_cast<double>(real_tokens) / static_cast<double>(positions))
            : std::string();
    // A mixture of experts multiplies only each token's chosen experts.
    const int64_t active = model::parameter_count(model::decoder_spec(c), c.hidden_size,
                                                  c.vocab_size, c.tie_word_embeddings,
                                                  /*active=*/true);
    const double n = static_cast<double>(active);
    const double flops_token = 6 * n + 12.0 * c.num_hidden_layers * c.hidden_size * seq;
    std::printf(
        "RESULT %s\n",
        fmt::format(
            R"J({{"impl": "zerotrain", "shape": "{}", "mode": "{}", "stage": {}, "seq": {}, "mbs": {}, "ckpt": {}, "params": {}, "active_params": {}, "trainable": {}, "step_s": {:.4f}, "tokens_per_s": {:.0f}, "tflops_6N": {:.1f}, "peak_gib": {:.1f}, "init_s": {:.1f}, "loss": {:.4f}, "in_backward": {}, "keep": "{}", "offload": {}, "layers": {}, "span": {}, "host_activations_gib": {:.1f}, "host_rss_gib": {:.1f}{}{}}})J",
            shape, mode, engine.stage(), seq, mbs, ckpt ? 1 : 0, c.parameter_count(), active,
            counts.trainable, step_s, tokens_per_s, tokens_per_s * flops_token / 1e12,
            device_stats::peak_allocated(0) / 1073741824.0, init_s, loss_value,
            engine.updates_in_backward() ? "true" : "false", args.gradient_checkpointing_keep,
            args.use_unsloth_gc ? "true" : "false", c.num_hidden_layers, eo.units_per_checkpoint,
            static_cast<double>(engine.memory().host_activations_peak) / 1073741824.0,
            peak_rss_gib(), padding,
            phases ? fmt::format(R"(, "fwd_s": {:.4f}, "bwd_s": {:.4f}, "opt_s": {:.4f})",
                                 phase_s[0] / steps, phase_s[1] / steps, phase_s[2] / steps)
                   : std::string())
            .c_str());
    return 0;
  } catch (const std::exception& e) {
    std::printf(
        "RESULT %s\n",
        fmt::format(
            R"J({{"impl": "zerotrain", "shape": "{}", "mode": "{}", "seq": {}, "mbs": {}, "error": "{}"}})J",
            shape, mode, seq, mbs, std::string(e.what()).substr(0, 300))
            .c_str());
    return 1;
  }
}
