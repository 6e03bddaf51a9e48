// Where parameter values come from: checkpoints (read per slice) and seeded random init.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <string_view>
#include <vector>

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "model/families/moe.hpp"
#include "model/family.hpp"
#include "model/kept_parts.hpp"
#include "model/moe.hpp"
#include "model/quantized_weights.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/log.hpp"
#include "util/threads.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt {
namespace {

// Weights are floating point: a tensor of integers or booleans where the model needs a weight
// is another kind of file (token ids, masks, a quantized checkpoint's packed values).
void check_weight_dtype(const std::string& path, const std::string& name, const TensorInfo& info) {
  if (!at::isFloatingType(info.dtype)) {
    throw IoError(fmt::format(
        "checkpoint '{}': tensor '{}' is {}, but the model's weights are floating point (F32, "
        "F16 or BF16); this file is not the model's weights (a quantized checkpoint must be "
        "dequantized first)",
        path, name, info.dtype_name));
  }
}

// Its layer index when `name` lies in a numbered layer ("model.layers.7.mlp..." -> 7).
std::optional<int64_t> layer_of(const std::string& name) {
  const size_t at = name.find(".layers.");
  if (at == std::string::npos) return std::nullopt;
  const size_t first = at + 8, end = name.find('.', first);
  if (end == std::string::npos || end == first || end - first > 9) return std::nullopt;
  int64_t n = 0;
  for (size_t i = first; i < end; ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    n = n * 10 + (name[i] - '0');
  }
  return n;
}

bool ends_with(std::string_view name, std::string_view tail) {
  return name.size() >= tail.size() &&
         name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}

// Buffers transformers recomputes and never loads (older LLaMA and ChatGLM files carry them).
bool is_recomputed_buffer(const std::string& name) {
  return ends_with(name, "rotary_emb.inv_freq") || ends_with(name, "rotary_pos_emb.inv_freq") ||
         ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias");
}

// transformers' renaming of multimodal checkpoints saved in their original layout (Gemma 3 and
// the LLaVA kin as published, and as transformers 5 saves them by default): the file's prefix,
// then the module tree's.
constexpr std::pair<std::string_view, std::string_view> kOriginalLayout[] = {
    {"language_model.model.", "model.language_model."},
    {"language_model.lm_head.", "lm_head."},
    {"vision_tower.", "model.vision_tower."},
    {"multi_modal_projector.", "model.multi_modal_projector."}};

// `name` with its prefix turned from one layout to the other (`to_original`: module tree to
// file), or nullopt where no prefix applies.
std::optional<std::string> in_other_layout(const std::string& name, bool to_original) {
  for (const auto& [original, tree] : kOriginalLayout) {
    const std::string_view from = to_original ? tree : original;
    if (name.compare(0, from.size(), from) == 0) {
      return std::string(to_original ? original : tree) + name.substr(from.size());
    }
  }
  return std::nullopt;
}

// The name a checkpoint gives a parameter of the model: its own; a multimodal folder's in its
// original layout; or Mixtral's 4.x name of the router (`block_sparse_moe.gate` for transformers
// 5's `mlp.gate`) where the file has that.
std::string stored_name(const SafetensorsCheckpoint& ckpt, const std::string& name) {
  if (ckpt.contains(name)) return name;
  if (std::optional<std::string> original = in_other_layout(name, /*to_original=*/true);
      original && ckpt.contains(*original)) {
    return *original;
  }
  constexpr std::string_view kRouter = ".mlp.gate.weight";
  if (ends_with(name, kRouter)) {
    std::string old =
        name.substr(0, name.size() - kRouter.size()) + ".block_sparse_moe.gate.weight";
    if (ckpt.contains(old)) return old;
  }
  return name;
}

// A checkpoint with one module per expert (transformers 4.x, and Qwen3-MoE and Mixtral as
// released) holds in pieces what the model keeps as one fused tensor: `P.experts.gate_up_proj`
// [E, 2I, H] is each expert's gate rows then its up rows, `P.experts.down_proj` [E, H, I] each
// expert's down weight. The pieces are `P.experts.<e>.{gate,up,down}_proj.weight`, or Mixtral's
// `P'.experts.<e>.{w1,w3,w2}.weight` under `block_sparse_moe` in place of `mlp`.
struct ExpertPieces {
  std::string prefix;                 ///< "model.layers.3.mlp.experts."
  std::vector<std::string_view> own;  ///< per expert, in the fused tensor's order
};

std::optional<ExpertPieces> expert_pieces(const SafetensorsCheckpoint& ckpt,
                                          const std::string& name) {
  const bool gate_up = ends_with(name, ".experts.gate_up_proj");
  if (!gate_up && !ends_with(name, ".experts.down_proj")) return std::nullopt;
  const std::string experts = name.substr(0, name.rfind('.') + 1);  // "...mlp.experts."
  std::vector<std::string> prefixes{experts};
  if (const size_t at = experts.rfind(".mlp.experts."); at != std::string::npos) {
    prefixes.push_back(experts.substr(0, at) + ".block_sparse_moe.experts.");
  }
  using Names = std::vector<std::string_view>;
  const Names hf = gate_up ? Names{"gate_proj", "up_proj"} : Names{"down_proj"};
  const Names mixtral = gate_up ? Names{"w1", "w3"} : Names{"w2"};
  for (const std::string& prefix : prefixes) {
    for (const Names* names : {&hf, &mixtral}) {
      if (ckpt.contains(prefix + "0." + std::string(names->front()) + ".weight")) {
        return ExpertPieces{prefix, *names};
      }
    }
  }
  return std::nullopt;
}

// Expert `e`'s piece `own` ("up_proj").
std::string piece_name(const ExpertPieces& p, int64_t e, std::string_view own) {
  return fmt::format("{}{}.{}.weight", p.prefix, e, own);
}

// Each piece of a fused expert tensor of `shape` ([E, rows, cols]) must be there, a weight, of
// shape [rows / pieces per expert, cols].
std::vector<std::string> checked_pieces(const SafetensorsCheckpoint& ckpt, const std::string& name,
                                        const ExpertPieces& p, const std::vector<int64_t>& shape) {
  const auto per_expert = static_cast<int64_t>(p.own.size());
  if (shape.size() != 3 || shape[1] % per_expert != 0) {
    throw IoError(
        fmt::format("checkpoint '{}': '{}' is not an experts' tensor [experts, rows, "
                    "cols] to gather from '{}*'",
                    ckpt.path(), name, p.prefix));
  }
  const std::vector<int64_t> piece{shape[1] / per_expert, shape[2]};
  std::vector<std::string> names;
  for (int64_t e = 0; e < shape[0]; ++e) {
    for (std::string_view own : p.own) names.push_back(piece_name(p, e, own));
  }
  for (const std::string& n : names) {
    if (!ckpt.contains(n)) {
      throw IoError(
          fmt::format("checkpoint '{}' lacks tensor '{}': the model's config gives {} "
                      "experts (num_experts), and '{}' is gathered from each of them",
                      ckpt.path(), n, shape[0], name));
    }
    const TensorInfo& info = ckpt.info(n);
    check_weight_dtype(ckpt.path(), n, info);
    if (info.shape != piece) {
      throw IoError(
          fmt::format("checkpoint '{}': tensor '{}' has shape [{}] but an expert of the "
                      "model's config has [{}] (moe_intermediate_size, hidden_size)",
                      ckpt.path(), n, fmt::join(info.shape, ", "), fmt::join(piece, ", ")));
    }
  }
  // A checkpoint with more experts than the config says: the config does not describe it.
  const std::string extra = piece_name(p, shape[0], p.own.front());
  if (ckpt.contains(extra)) {
    throw IoError(
        fmt::format("checkpoint '{}' holds '{}', an expert beyond the {} of the model's "
                    "config: set num_experts to match the weights",
                    ckpt.path(), extra, shape[0]));
  }
  return names;
}

// gpt-oss as released (quantization_config quant_method "mxfp4"): each experts' tensor
// `P.experts.{gate_up,down}_proj` [E, in, out] is stored as `<name>_blocks` (uint8 [E, out,
// G, 16]: 32 FP4 E2M1 codes per group, the low nibble first) and `<name>_scales` (uint8 [E,
// out, G]: the group's E8M0 exponent, biased by 127), with in = 32 G — what transformers'
// Mxfp4Config(dequantize=True) turns into bf16 (convert_moe_packed_tensors). Values are
// code × 2^(scale - 127), exact in bf16 and fp32.
struct Mxfp4Parts {
  std::string blocks, scales;
};

std::optional<Mxfp4Parts> mxfp4_parts(const SafetensorsCheckpoint& ckpt, const std::string& name) {
  if (!ends_with(name, ".experts.gate_up_proj") && !ends_with(name, ".experts.down_proj")) {
    return std::nullopt;
  }
  Mxfp4Parts p{name + "_blocks", name + "_scales"};
  if (!ckpt.contains(p.blocks) && !ckpt.contains(p.scales)) return std::nullopt;
  return p;
}

// Both parts there, uint8, and of the shapes an experts' tensor of `shape` [E, in, out] needs.
void check_mxfp4(const SafetensorsCheckpoint& ckpt, const std::string& name, const Mxfp4Parts& p,
                 const std::vector<int64_t>& shape) {
  for (const std::string* part : {&p.blocks, &p.scales}) {
    if (!ckpt.contains(*part)) {
      throw IoError(
          fmt::format("checkpoint '{}' lacks tensor '{}', which MXFP4 '{}' needs beside "
                      "'{}'",
                      ckpt.path(), *part, name, part == &p.blocks ? p.scales : p.blocks));
    }
    if (ckpt.info(*part).dtype != at::kByte) {
      throw IoError(fmt::format("checkpoint '{}': tensor '{}' is {}, but MXFP4 parts are U8",
                                ckpt.path(), *part, ckpt.info(*part).dtype_name));
    }
  }
  if (shape.size() != 3 || shape[1] % 32 != 0) {
    throw IoError(
        fmt::format("checkpoint '{}': '{}' is MXFP4, which packs rows of 32 values, but "
                    "the model's tensor has shape [{}]",
                    ckpt.path(), name, fmt::join(shape, ", ")));
  }
  const std::vector<int64_t> blocks{shape[0], shape[2], shape[1] / 32, 16};
  const std::vector<int64_t> scales{shape[0], shape[2], shape[1] / 32};
  for (const auto& [part, want] : {std::pair{&p.blocks, &blocks}, std::pair{&p.scales, &scales}}) {
    if (ckpt.info(*part).shape != *want) {
      throw IoError(
          fmt::format("checkpoint '{}': tensor '{}' has shape [{}] but the model's "
                      "config needs [{}] for '{}' [{}]",
                      ckpt.path(), *part, fmt::join(ckpt.info(*part).shape, ", "),
                      fmt::join(*want, ", "), name, fmt::join(shape, ", ")));
    }
  }
}

}  // namespace

at::Tensor model::dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales) {
  static constexpr float kCodes[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                       -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const at::Tensor b = blocks.to(at::kByte).contiguous();
  const at::Tensor e = scales.to(at::kByte).contiguous();
  if (b.dim() < 2 || b.size(-1) != 16 || e.sizes() != b.sizes().slice(0, b.dim() - 1)) {
    throw InvalidArgument(
        fmt::format("MXFP4: blocks [{}] and scales [{}] are not [..., G, 16] and [..., G]",
                    fmt::join(b.sizes(), ", "), fmt::join(e.sizes(), ", ")));
  }
  std::vector<int64_t> out_shape(b.sizes().begin(), b.sizes().end() - 2);
  out_shape.push_back(b.size(-2) * 32);
  at::Tensor out = at::empty(out_shape, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* code = b.data_ptr<uint8_t>();
  const uint8_t* exponent = e.data_ptr<uint8_t>();
  float* value = out.data_ptr<float>();
  const int64_t groups = e.numel();
  at::parallel_for(0, groups, 4096, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int power = static_cast<int>(exponent[g]) - 127;
      for (int k = 0; k < 16; ++k) {
        const uint8_t byte = code[g * 16 + k];
        value[g * 32 + 2 * k] = std::ldexp(kCodes[byte & 0x0F], power);
        value[g * 32 + 2 * k + 1] = std::ldexp(kCodes[byte >> 4], power);
      }
    }
  });
  return out;
}

namespace {

class CheckpointSource final : public ParameterSource {
 public:
  explicit CheckpointSource(const std::string& path) : ckpt_(path) {}
  bool has(const std::string& name) const override {
    return ckpt_.contains(stored_name(ckpt_, name)) || expert_pieces(ckpt_, name).has_value() ||
           mxfp4_parts(ckpt_, name).has_value();
  }
  void read(const std::string& model_name, const std::vector<int64_t>& shape, int64_t offset,
            const at::Tensor& out) override {
    const std::string name = stored_name(ckpt_, model_name);
    if (!ckpt_.contains(name)) {
      if (std::optional<ExpertPieces> p = expert_pieces(ckpt_, name)) {
        read_pieces(checked_pieces(ckpt_, name, *p, shape), offset, out);
        return;
      }
      if (std::optional<Mxfp4Parts> p = mxfp4_parts(ckpt_, name)) {
        check_mxfp4(ckpt_, name, *p, shape);
        read_mxfp4(*p, shape, offset, out);
        return;
      }
      throw IoError(
          fmt::format("checkpoint '{}' lacks tensor '{}', which the model's config "
                      "requires (a different model_type, size or tie_word_embeddings?)",
                      ckpt_.path(), name));
    }
    const TensorInfo& info = ckpt_.info(name);
    check_weight_dtype(ckpt_.path(), name, info);
    if (info.shape != shape) {
      throw IoError(
          fmt::format("checkpoint '{}': tensor '{}' has shape [{}] but the model expects "
                      "[{}]",
                      ckpt_.path(), name, fmt::join(info.shape, ", "), fmt::join(shape, ", ")));
    }
    ckpt_.read_range(name, offset, out);
  }

 private:
  // Elements [offset, offset + out.numel()) of the pieces laid end to end (all of one size).
  void read_pieces(const std::vector<std::string>& pieces, int64_t offset, const at::Tensor& out) {
    const int64_t size = ckpt_.info(pieces.front()).numel;
    at::Tensor flat = out.view({-1});
    for (int64_t done = 0; done < flat.numel();) {
      const int64_t at = offset + done, piece = at / size, from = at % size;
      const int64_t n = std::min(size - from, flat.numel() - done);
      ckpt_.read_range(pieces[static_cast<size_t>(piece)], from, flat.narrow(0, done, n));
      done += n;
    }
  }

  // Elements [offset, offset + out.numel()) of the dequantized [E, in, out] tensor, one expert
  // at a time (an expert's [in, out] is contiguous there; its parts are [out, G, 16], [out, G]).
  void read_mxfp4(const Mxfp4Parts& p, const std::vector<int64_t>& shape, int64_t offset,
                  const at::Tensor& out) {
    const int64_t rows = shape[2], groups = shape[1] / 32, per_expert = shape[1] * shape[2];
    at::Tensor flat = out.view({-1});
    for (int64_t done = 0; done < flat.numel();) {
      const int64_t at = offset + done, expert = at / per_expert, from = at % per_expert;
      const int64_t n = std::min(per_expert - from, flat.numel() - done);
      at::Tensor blocks = at::empty({rows, groups, 16}, at::TensorOptions().dtype(at::kByte));
      at::Tensor scales = at::empty({rows, groups}, at::TensorOptions().dtype(at::kByte));
      ckpt_.read_range(p.blocks, expert * rows * groups * 16, blocks);
      ckpt_.read_range(p.scales, expert * rows * groups, scales);
      const at::Tensor values = model::dequantize_mxfp4(blocks, scales).t().contiguous().view({-1});
      // E8M0's 255 is NaN, and 254 times a code of 2 or more overflows: transformers would
      // give infinite weights; a clear error instead.
      if (scales.max().item<int>() == 255 || !values.isfinite().all().item<bool>()) {
        throw IoError(fmt::format(
            "checkpoint '{}': '{}' of expert {} holds scales out of range (largest {}; E8M0 "
            "255 is NaN, 254 overflows with codes of 2 or more): the values would not be finite",
            ckpt_.path(), p.scales, expert, scales.max().item<int>()));
      }
      flat.narrow(0, done, n).copy_(values.narrow(0, from, n));
      done += n;
    }
  }

  SafetensorsCheckpoint ckpt_;
};

// transformers' _init_weights for these models: normal(0, initializer_range) for linear and
// embedding weights, zero biases, unit RMSNorm weights.
//
// A weight's values come in chunks of kRandomChunk elements, chunk k drawn from its own
// generator seeded by (seed, name, k) (chunk 0 by (seed, name) alone): any rank can produce any
// slice of any parameter on its own, straight into the buffer it reads into, on all intra-op
// threads, and the values depend neither on the thread count nor on the order of reads.
constexpr int64_t kRandomChunk = int64_t{1} << 22;

void ranged_normal(const at::Tensor& out, int64_t numel, int64_t offset, double std,
                   uint64_t seed) {
  const int64_t len = out.numel();
  const int64_t first = offset / kRandomChunk, last = (offset + len - 1) / kRandomChunk;
  auto fill = [&](int64_t k0, int64_t k1) {
    at::Tensor scratch;  // for chunks the range covers only in part
    for (int64_t k = k0; k < k1; ++k) {
      at::Generator gen =
          at::detail::createCPUGenerator(seed ^ (static_cast<uint64_t>(k) * 0x9E3779B97F4A7C15ull));
      const int64_t lo = k * kRandomChunk, n = std::min(kRandomChunk, numel - lo);  // the chunk
      const int64_t a = std::max(lo, offset),
                    e = std::min(lo + n, offset + len);  // its part wanted
      if (a == lo && e == lo + n) {
        out.narrow(0, lo - offset, n).normal_(0.0, std, gen);
      } else {
        if (!scratch.defined()) scratch = at::empty({kRandomChunk}, out.options());
        at::Tensor whole = scratch.narrow(0, 0, n);
        whole.normal_(0.0, std, gen);
        out.narrow(0, a - offset, e - a).copy_(whole.narrow(0, a - lo, e - a));
      }
    }
  };
  parallel_ranges(last - first + 1, cpu_worker_threads(),
                  [&](int64_t a, int64_t b) { fill(first + a, first + b); });
}

class RandomSource final : public ParameterSource {
 public:
  RandomSource(double std, uint64_t seed, std::set<std::string> names)
      : std_(std), seed_(seed), names_(std::move(names)) {}
  /// The model's own parameters only: an adapter's (LoRA's B = 0, a prompt encoder's) keep the
  /// starts their method gives them (with_adapter_values reads them from the model).
  bool has(const std::string& name) const override { return names_.count(name) != 0; }
  void read(const std::string& name, const std::vector<int64_t>& shape, int64_t offset,
            const at::Tensor& out) override {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    const bool norm = name.size() > 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0;
    // Biases, and GLM-4.5's e_score_correction_bias, start at zero (transformers' init).
    const bool bias = name.size() > 4 && name.compare(name.size() - 4, 4, "bias") == 0;
    if (out.numel() == 0) return;
    if (norm) {
      out.fill_(1.0);
    } else if (bias) {
      out.zero_();
    } else if (out.is_contiguous() && out.scalar_type() == at::kFloat) {
      ranged_normal(out.view({-1}), numel, offset, std_, seed_ ^ std::hash<std::string>{}(name));
    } else {
      at::Tensor values = at::empty({out.numel()}, at::TensorOptions().dtype(at::kFloat));
      ranged_normal(values, numel, offset, std_, seed_ ^ std::hash<std::string>{}(name));
      out.view({-1}).copy_(values);
    }
  }

 private:
  double std_;
  uint64_t seed_;
  std::set<std::string> names_;
};

}  // namespace

std::shared_ptr<ParameterSource> checkpoint_source(const std::string& path) {
  return std::make_shared<CheckpointSource>(path);
}

std::shared_ptr<ParameterSource> random_source(const ModelConfig& config, uint64_t seed) {
  std::set<std::string> names;
  const CausalLM shape(config, at::TensorOptions(), /*allocate=*/false);
  for (const auto& item : shape.named_parameters(true)) names.insert(item.key());
  return std::make_shared<RandomSource>(config.initializer_range, seed, std::move(names));
}

void load_weights(torch::nn::Module& model, ParameterSource& given) {
  at::NoGradGuard no_grad;
  // A 4-bit model's projections take their storage from the source's full-precision values.
  auto quantized = model::quantized_weights(model);
  std::shared_ptr<ParameterSource> quantizing;
  if (!quantized.empty() && !model::gives_quantized_storage(given)) {
    quantizing = model::quantizing_source(given, std::move(quantized));
  }
  ParameterSource& source = quantizing ? *quantizing : given;
  for (auto& item : model.named_parameters(true)) {
    at::Tensor p = item.value();
    std::vector<int64_t> shape = p.sizes().vec();
    if (!p.is_contiguous()) p.set_data(at::empty(shape, p.options()));  // a placeholder
    at::Tensor staging =
        p.is_cpu() && p.is_contiguous() ? p : at::empty(shape, p.options().device(at::kCPU));
    source.read(item.key(), shape, 0, staging);
    if (!staging.is_same(p)) p.copy_(staging);
  }
}

void check_checkpoint(const CausalLM& model, const std::string& path) {
  SafetensorsCheckpoint ckpt(path);
  const ModelConfig& config = model.config();
  const auto quantized = model::quantized_weights(model);
  std::set<std::string> needed;
  std::string embedding;
  for (const auto& item : model.named_parameters(true)) {
    const std::string name = stored_name(ckpt, item.key());
    // A 4-bit projection is read from the file's [rows, cols] values.
    const auto q = quantized.find(item.key());
    std::vector<int64_t> expected =
        q == quantized.end() ? item.value().sizes().vec() : q->second->value_shape();
    // An expert-parallel model's experts are a share of the file's tensors.
    if (config.expert_shard.size > 1 && model::is_expert_tensor(item.key())) {
      expected[0] *= config.expert_shard.size;
    }
    needed.insert(name);
    if (embedding.empty() && name.find("embed") != std::string::npos) embedding = name;
    if (!ckpt.contains(name)) {
      if (std::optional<ExpertPieces> p = expert_pieces(ckpt, name)) {
        for (std::string& piece : checked_pieces(ckpt, name, *p, expected)) {
          needed.insert(std::move(piece));
        }
        continue;
      }
      if (std::optional<Mxfp4Parts> p = mxfp4_parts(ckpt, name)) {
        check_mxfp4(ckpt, name, *p, expected);
        needed.insert(p->blocks);
        needed.insert(p->scales);
        continue;
      }
      throw IoError(
          fmt::format("checkpoint '{}' lacks tensor '{}', which the model's config "
                      "requires",
                      path, name));
    }
    const TensorInfo& info = ckpt.info(name);
    // bitsandbytes' packed 4-bit weight: prequantized_source checks it with its parts.
    if (q != quantized.end() && q->second->groups == 1 &&
        model::holds_packed_codes(info, *q->second)) {
      continue;
    }
    check_weight_dtype(path, name, info);
    if (info.shape != expected) {
      throw IoError(fmt::format(
          "checkpoint '{}': tensor '{}' has shape [{}] but the model's config gives [{}]", path,
          name, fmt::join(info.shape, ", "), fmt::join(expected, ", ")));
    }
  }
  // What the file holds beyond the model: layers past num_hidden_layers are an error (the
  // config would silently drop them); a head beside tied embeddings is a warning (the tied
  // embedding wins, as transformers ties them); anything else is listed once, as transformers
  // lists unexpected keys.
  std::vector<std::string> unused;
  int64_t highest_layer = -1;
  // GLM-4.5's multi-token-prediction layers follow the decoder's; transformers skips them.
  const int64_t extra = model::moe::settings_of(config).extra_layers;
  int64_t kept = 0;
  const model::Multimodal* multimodal = model::family_of(config).multimodal;
  for (const std::string& name : ckpt.names()) {
    if (needed.count(name) != 0 || is_recomputed_buffer(name) ||
        model::is_quantization_part(name, quantized)) {
      continue;
    }
    if (model::is_kept_part(multimodal, name)) {
      ++kept;
      continue;
    }
    if (std::optional<int64_t> layer = layer_of(name);
        layer && *layer >= config.num_hidden_layers) {
      if (*layer < config.num_hidden_layers + extra) continue;
      highest_layer = std::max(highest_layer, *layer);
      continue;
    }
    unused.push_back(name);
  }
  if (highest_layer >= 0) {
    throw IoError(fmt::format(
        "checkpoint '{}' holds layers 0 to {} but its config gives num_hidden_layers {}: the "
        "config does not describe these weights; set num_hidden_layers {} (or give the folder "
        "whose config matches)",
        path, highest_layer, config.num_hidden_layers, highest_layer + 1));
  }
  if (kept > 0) {
    log::info(
        "checkpoint '{}': {} tensors of the parts beside the text decoder (vision tower, "
        "projector) are not trained, and are copied as they are into every whole model written "
        "from it",
        path, kept);
  }
  std::vector<std::string> listed;
  for (const std::string& name : unused) {
    const bool head = name == "lm_head.weight" || name == "transformer.output_layer.weight";
    if (head && config.tie_word_embeddings && !embedding.empty()) {
      // A copy of the embedding (some exports write both) changes nothing; say so otherwise.
      const TensorInfo& h = ckpt.info(name);
      const TensorInfo& e = ckpt.info(embedding);
      bool same = h.shape == e.shape && h.dtype == e.dtype;
      if (same && !h.shape.empty()) {
        const int64_t row = h.numel / std::max<int64_t>(1, h.shape[0]);
        at::Tensor a = at::empty({row}, at::TensorOptions().dtype(at::kFloat));
        at::Tensor b = at::empty({row}, at::TensorOptions().dtype(at::kFloat));
        ckpt.read_range(name, 0, a);
        ckpt.read_range(embedding, 0, b);
        same = a.equal(b);
      }
      if (!same) {
        log::warn(
            "checkpoint '{}' has its own '{}', but config.json says tie_word_embeddings true: "
            "the output layer is '{}' (tied, as transformers loads it) and the file's head is "
            "not used; set tie_word_embeddings false to train with the file's head",
            path, name, embedding);
      }
      continue;
    }
    listed.push_back(name);
  }
  if (!listed.empty()) {
    const size_t shown = std::min<size_t>(listed.size(), 8);
    log::warn("checkpoint '{}': {} tensor(s) have no place in this model and are not used: {}{}",
              path, listed.size(),
              fmt::join(listed.begin(), listed.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
              listed.size() > shown ? fmt::format(" and {} more", listed.size() - shown) : "");
  }
}

namespace model {

bool is_kept_part(const Multimodal* mm, const std::string& stored) {
  if (mm == nullptr) return false;
  const std::string name = in_other_layout(stored, /*to_original=*/false).value_or(stored);
  return std::any_of(mm->parts.begin(), mm->parts.end(), [&](std::string_view part) {
    return !part.empty() && name.compare(0, part.size(), part) == 0;
  });
}

void KeptParts::plan(std::vector<TensorEntry>& plan, at::ScalarType dtype) const {
  for (const Tensor& t : tensors) plan.push_back(TensorEntry{t.name, dtype, t.shape});
}

void KeptParts::write(SafetensorsStreamWriter& writer, at::ScalarType dtype) const {
  if (tensors.empty()) return;
  const SafetensorsCheckpoint from(dir);
  for (const Tensor& t : tensors) writer.write(t.name, from.load(t.stored, dtype));
}

KeptParts kept_parts_of(const ModelConfig& c, const std::vector<std::string>& dirs) {
  const Multimodal* mm = family_of(c).multimodal;
  if (mm == nullptr) return {};
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const std::string& dir : dirs) {
    if (dir.empty() || (!fs::exists(fs::path(dir) / "model.safetensors", ec) &&
                        !fs::exists(fs::path(dir) / "model.safetensors.index.json", ec))) {
      continue;
    }
    KeptParts kept{dir, {}};
    const SafetensorsCheckpoint ckpt(dir);
    for (const std::string& stored : ckpt.names()) {
      if (!is_kept_part(mm, stored)) continue;
      kept.tensors.push_back(
          KeptParts::Tensor{in_other_layout(stored, /*to_original=*/false).value_or(stored), stored,
                            ckpt.info(stored).shape});
    }
    if (!kept.tensors.empty()) return kept;
  }
  log::warn(
      "model_type {}: no folder among [{}] holds the parts beside the text decoder ({}); the "
      "model written has the text decoder alone",
      c.model_type, fmt::join(dirs, ", "), fmt::join(mm->parts, ", "));
  return {};
}

}  // namespace model

int copy_model_companion_files(const std::string& from, const std::string& to) {
  namespace fs = std::filesystem;
  static const char* const kFiles[] = {
      "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
      "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json",
      // a multimodal folder's processor (Gemma 3's), so what is written still reads images
      "preprocessor_config.json", "processor_config.json", "chat_template.json",
      // ChatGLM2/3's remote code, which its config's auto_map
      // names (trust_remote_code loads the folder with it)
      "configuration_chatglm.py", "modeling_chatglm.py", "tokenization_chatglm.py",
      "quantization.py"};
  int copied = 0;
  for (const char* name : kFiles) {
    const std::string source = (fs::path(from) / name).string();
    std::error_code ec;
    if (!fs::exists(source, ec)) continue;
    // Read through links (a hub cache's files link into its blobs), but only a regular file of a
    // tokenizer's size, and a JSON companion only when it is JSON; written with write_atomic, so
    // a link already at the destination is replaced, never written through.
    std::string content;
    try {
      content = files::read_text(source, "model companion file", files::kMaxTokenizerBytes);
      const std::string n(name);
      if (n.size() > 5 && n.compare(n.size() - 5, 5, ".json") == 0) {
        rapidjson::Document doc = json::parse(content, source);
        if (!doc.IsObject()) throw ConfigError(fmt::format("'{}' is not a JSON object", source));
      }
    } catch (const Error& e) {
      // Not what its name says (a link to a FIFO, a device, another file): not copied anywhere.
      log::warn("not copying '{}' into '{}': {}", source, to, e.what());
      continue;
    }
    files::write_atomic((fs::path(to) / name).string(), content);
    ++copied;
  }
  return copied;
}

}  // namespace zt
