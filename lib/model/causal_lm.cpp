// CausalLM: the decoder stack, its sharding units, losses, logits and generation.
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "model/decoding.hpp"
#include "model/family.hpp"
#include "model/layers.hpp"
#include "model/moe.hpp"
#include "model/sampling.hpp"
#include "model/sequence_parallel.hpp"
#include "model/step_graph.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/units.hpp"

namespace zt {

// A module that only holds others under a name (ChatGLM's `embedding` and `encoder`).
struct Holder : torch::nn::Module {};

// Registers `child` at a dotted `path` under `parent` (a family's ModuleNames), each part
// before the last a holder, made on first use.
template <typename M>
std::shared_ptr<M> register_path(torch::nn::Module& parent, std::string_view path,
                                 std::shared_ptr<M> child) {
  torch::nn::Module* at = &parent;
  size_t start = 0;
  for (size_t dot = path.find('.'); dot != std::string_view::npos;
       start = dot + 1, dot = path.find('.', start)) {
    const std::string part(path.substr(start, dot - start));
    auto children = at->named_children();  // a copy: find's pointer lives as long as it does
    if (std::shared_ptr<torch::nn::Module>* held = children.find(part)) {
      at = held->get();
    } else {
      at = at->register_module(part, std::make_shared<Holder>()).get();
    }
  }
  return at->register_module(std::string(path.substr(start)), std::move(child));
}

// The decoder without its LM head, in its family's module tree (ModuleNames): HF's `model`
// submodule of *ForCausalLM (embed_tokens, layers, norm), or ChatGLM's `transformer`
// (embedding.word_embeddings, encoder.layers, encoder.final_layernorm, and output_layer — the
// head, which HF keeps outside as lm_head).
struct DecoderBody : torch::nn::Module {
  std::shared_ptr<model::Embedding> embed_tokens;
  torch::nn::ModuleList layer_list{nullptr};
  std::vector<std::shared_ptr<model::DecoderLayer>> layers;
  std::shared_ptr<model::RMSNorm> norm;
  /// What the body was built from: its layers and their rotary embeddings.
  model::DecoderSpec spec;

  using Tables = std::vector<std::pair<at::Tensor, at::Tensor>>;
  /// cos / sin of each rotary embedding, for positions [start, start + length) ...
  Tables tables(int64_t start, int64_t length, at::ScalarType dtype,
                const at::Device& device) const {
    Tables t;
    for (const model::RotarySpec& r : spec.rotaries)
      t.push_back(model::rotary_tables(r, start, length, dtype, device));
    return t;
  }
  /// ... or for explicit positions [B, T] (packed documents).
  Tables tables(const at::Tensor& positions, at::ScalarType dtype) const {
    Tables t;
    for (const model::RotarySpec& r : spec.rotaries)
      t.push_back(model::rotary_tables(r, positions, dtype));
    return t;
  }
  /// The token embeddings `e` as the embedding module gives them: × √hidden rounded to their
  /// dtype where the spec scales (Gemma).
  at::Tensor scaled_tokens(const at::Tensor& e) const {
    return spec.scale_embeddings ? times_root_hidden(e) : e;
  }
  static at::Tensor times_root_hidden(const at::Tensor& e) {
    return e * at::scalar_tensor(std::sqrt(static_cast<double>(e.size(-1))), e.options());
  }
  /// The final logit soft-cap (0: none).
  double logit_softcap() const { return spec.logit_softcap.value_or(0.0); }
  /// Logits `z` in fp32, soft-capped where the spec says so.
  at::Tensor capped(const at::Tensor& z) const {
    const at::Tensor f = z.to(at::kFloat);
    const double cap = logit_softcap();
    return cap > 0 ? at::tanh(f / cap) * cap : f;
  }
  /// Layer i's cos / sin among `t`.
  const std::pair<at::Tensor, at::Tensor>& of_layer(const Tables& t, size_t i) const {
    return t[spec.layers[i].attention.rotary];
  }
  DecoderBody(const ModelConfig& c, model::DecoderSpec decoder, const model::ParamFactory& o)
      : spec(std::move(decoder)) {
    const model::ModuleNames& names = model::family_of(c).names;
    auto embeddings = std::make_shared<model::Embedding>(c.vocab_size, c.hidden_size, o);
    auto list = torch::nn::ModuleList();
    for (const model::LayerSpec& layer : spec.layers) {
      const model::RotarySpec& rotary = spec.rotaries.at(layer.attention.rotary);
      layers.push_back(
          std::make_shared<model::DecoderLayer>(layer, rotary, c.hidden_size, names, o));
      list->push_back(layers.back());
    }
    auto final_norm = std::make_shared<model::RMSNorm>(c.hidden_size, spec.final_norm, o);
    embed_tokens = register_path(*this, names.embedding, embeddings);
    layer_list = torch::nn::ModuleList(register_path(*this, names.layers, list.ptr()));
    norm = register_path(*this, names.final_norm, final_norm);
  }
};

// The head unit's parameters: the final norm and the LM head (the embeddings when tied).
struct HeadUnit : torch::nn::Module {
  HeadUnit(std::shared_ptr<model::RMSNorm> norm, std::shared_ptr<torch::nn::Module> head) {
    register_module("norm", std::move(norm));
    if (head) register_module("lm_head", std::move(head));
  }
};

struct CausalLM::Impl {
  std::shared_ptr<DecoderBody> body;
  std::shared_ptr<model::Linear> lm_head;  // null when tied to the embeddings
  std::shared_ptr<PromptAdapter> installed_prompt;
  PromptAdapter* prompt = nullptr;  // installed_prompt while the adapters are on, else null
  bool adapters_enabled = true;
  /// The load-balancing loss's gathering, shared by the sparse layers; null unless the config
  /// asks for the loss.
  std::shared_ptr<model::RouterBalance> balance;
  /// Set by set_sequence_parallel (size > 1): the losses run over this rank's positions.
  std::shared_ptr<const model::SequenceShard> sequence;

  const at::Tensor& head_weight() const {
    return lm_head ? lm_head->weight : body->embed_tokens->weight;
  }
};

namespace {

// What the layers see of a batch once a prompt adapter had its say.
struct Prepared {
  at::Tensor x;       // [B, T', H] embeddings (virtual tokens first with P-Tuning)
  at::Tensor mask;    // [B, S] over all keys (prefix included), or empty
  int64_t start = 0;  // position of the first input token (after a prefix)
  std::vector<std::pair<at::Tensor, at::Tensor>> prefixes;  // per layer [B, kvH, P, D]
  int64_t virtual_tokens = 0;                               // P-Tuning tokens in front of x
};

at::Tensor mask_or_empty(const at::Tensor& attention_mask, const at::Tensor& like) {
  if (!attention_mask.defined()) return at::empty({0}, like.options().dtype(at::kLong));
  return attention_mask.to(like.device());
}

// Adds the adapter's virtual tokens or prefixes to embedded inputs `x` [B, T, H]. After a prefix,
// the inputs' positions start at its length (transformers' models count cached keys), except
// in ChatGLM's layout, whose positions always start at 0.
Prepared apply_prompt(const ModelConfig& c, PromptAdapter* prompt, at::Tensor x, at::Tensor mask) {
  Prepared p;
  p.x = std::move(x);
  p.mask = std::move(mask);
  if (prompt == nullptr) return p;
  const int64_t b = p.x.size(0), n = prompt->num_virtual_tokens();
  const bool padded = p.mask.numel() > 0;
  at::Tensor ones = at::ones({b, n}, p.mask.options().dtype(at::kLong));
  if (prompt->prepends_tokens()) {
    at::Tensor virt = prompt->virtual_embeddings();
    p.x = at::cat({virt.to(p.x.scalar_type()).unsqueeze(0).expand({b, n, virt.size(-1)}), p.x}, 1);
    p.virtual_tokens = n;
  } else {
    for (auto& [k, v] : prompt->layer_prefixes()) {
      p.prefixes.emplace_back(
          k.to(p.x.scalar_type()).unsqueeze(0).expand({b, k.size(0), k.size(1), k.size(2)}),
          v.to(p.x.scalar_type()).unsqueeze(0).expand({b, v.size(0), v.size(1), v.size(2)}));
    }
    p.start = model::family_of(c).prefix.positions_from_zero ? 0 : n;
  }
  if (padded) p.mask = at::cat({ones.to(p.mask.device()), p.mask}, 1);
  return p;
}

// `t` [B, T] with `pad` columns of `value` appended.
at::Tensor pad_columns(const at::Tensor& t, int64_t pad, int64_t value) {
  if (pad == 0) return t;
  return at::cat({t, at::full({t.size(0), pad}, value, t.options())}, 1);
}

// What a sequence-parallel rank computes of a batch: its slice [first, first + length) of the
// sequence padded to `padded` positions (padding: id 0, label -100, document 0).
struct SequenceSlice {
  int64_t first = 0, length = 0, padded = 0, real = 0;
  at::Tensor cut(const at::Tensor& t, int64_t dim = 1) const {
    return t.narrow(dim, first, length);
  }
};

// The rotary tables of this rank's slice: for a rotary whose frequencies depend on how far the
// positions reach (dynamic, LongRoPE), the whole sequence's tables cut; for the others, the
// slice's own (the same values).
DecoderBody::Tables slice_tables(const DecoderBody& body, const SequenceSlice& slice,
                                 const at::Tensor& positions, at::ScalarType dtype,
                                 const at::Device& device) {
  DecoderBody::Tables t;
  for (const model::RotarySpec& r : body.spec.rotaries) {
    if (positions.defined()) {  // padded to the whole sequence; the padding's 0s reach nothing
      if (model::reach_matters(r)) {
        auto [cos, sin] = model::rotary_tables(r, positions, dtype);
        t.emplace_back(slice.cut(cos, 2), slice.cut(sin, 2));
      } else {
        t.push_back(model::rotary_tables(r, slice.cut(positions), dtype));
      }
    } else if (model::reach_matters(r)) {
      auto [cos, sin] = model::rotary_tables(r, 0, slice.real, dtype, device);
      const int64_t pad = slice.padded - slice.real;
      const auto padded = [&](const at::Tensor& x) {
        return pad == 0 ? x : at::cat({x, at::zeros({pad, x.size(1)}, x.options())}, 0);
      };
      t.emplace_back(slice.cut(padded(cos), 0), slice.cut(padded(sin), 0));
    } else {
      t.push_back(model::rotary_tables(r, slice.first, slice.length, dtype, device));
    }
  }
  return t;
}

}  // namespace

CausalLM::CausalLM(const ModelConfig& config, at::TensorOptions options, bool allocate)
    : config_(config), impl_(std::make_unique<Impl>()) {
  at::NoGradGuard no_grad;
  model::ParamFactory factory{options, allocate};
  // A 4-bit model quantizes the decoder's projections; the output layer keeps its dtype.
  model::ParamFactory body_factory = factory;
  if (config_.quantization) body_factory.quantization = &*config_.quantization;
  const model::ModuleNames& names = model::family_of(config_).names;
  impl_->body = register_path(
      *this, names.body,
      std::make_shared<DecoderBody>(config_, model::decoder_spec(config_), body_factory));
  if (!config_.tie_word_embeddings) {
    auto head =
        std::make_shared<model::Linear>(config_.hidden_size, config_.vocab_size, false, factory);
    torch::nn::Module& owner =
        names.head_in_body ? static_cast<torch::nn::Module&>(*impl_->body) : *this;
    impl_->lm_head = register_path(owner, names.lm_head, head);
  }
  if (impl_->body->spec.router_aux_coef) {
    impl_->balance = std::make_shared<model::RouterBalance>();
    for (const auto& layer : impl_->body->layers) {
      if (layer->moe) layer->moe->balance = impl_->balance;
    }
  }
}

CausalLM::~CausalLM() = default;

std::vector<UnitSpec> CausalLM::units() {
  // The embeddings and the head are units for ZeRO-3 but not worth recomputing otherwise: the
  // lookup is cheap and the chunked loss keeps only its input.
  std::vector<UnitSpec> u{{"embed_tokens", impl_->body->embed_tokens, /*recompute=*/false}};
  for (size_t i = 0; i < impl_->body->layers.size(); ++i) {
    u.push_back({fmt::format("layers.{}", i), impl_->body->layers[i]});
  }
  std::shared_ptr<torch::nn::Module> head = impl_->lm_head;
  if (!head) head = impl_->body->embed_tokens;  // tied: shared with unit 0, so kept whole
  u.push_back({"head", std::make_shared<HeadUnit>(impl_->body->norm, head), /*recompute=*/false});
  return u;
}

void CausalLM::initialize_random(uint64_t seed) {
  load_weights(*this, *random_source(config_, seed));
}

void CausalLM::set_prompt_adapter(std::shared_ptr<PromptAdapter> adapter) {
  Impl& I = *impl_;
  if (adapter && I.sequence) {
    throw InvalidArgument(
        "set_prompt_adapter: P-Tuning and prefix tuning cannot train with sequence "
        "parallelism (sequence_parallel_size > 1); use LoRA, freeze or full, or size 1");
  }
  if (I.installed_prompt) unregister_module("prompt_encoder");
  I.installed_prompt = std::move(adapter);
  if (I.installed_prompt) register_module("prompt_encoder", I.installed_prompt);
  I.prompt = I.adapters_enabled ? I.installed_prompt.get() : nullptr;
}

void CausalLM::set_expert_communicator(std::shared_ptr<Communicator> comm) {
  const ModelConfig::ExpertShard& shard = config().expert_shard;
  if (comm && (comm->world_size() % shard.size != 0 || comm->rank() % shard.size != shard.rank)) {
    throw InvalidArgument(fmt::format(
        "set_expert_communicator: rank {} of {} cannot hold the experts of shard {} of {} "
        "(expert_parallel_size must divide the world; rank r holds shard r mod size)",
        comm->rank(), comm->world_size(), shard.rank, shard.size));
  }
  for (const auto& item : named_modules("", /*include_self=*/false)) {
    if (auto moe = std::dynamic_pointer_cast<model::SparseMoe>(item.value())) moe->comm = comm;
  }
}

void CausalLM::set_sequence_parallel(std::shared_ptr<Communicator> comm, int64_t size) {
  Impl& I = *impl_;
  std::shared_ptr<const model::SequenceShard> shard;
  if (comm && size > 1) {
    const auto refuse = [&](const std::string& why) {
      throw InvalidArgument(fmt::format("sequence_parallel_size {}: {}", size, why));
    };
    if (comm->world_size() % size != 0) {
      refuse(fmt::format("it does not divide the {} ranks of this job; give a divisor of {}",
                         comm->world_size(), comm->world_size()));
    }
    for (const model::LayerSpec& layer : I.body->spec.layers) {
      const int64_t heads = layer.attention.heads, kv = layer.attention.kv_heads;
      if (heads % size != 0) {
        refuse(
            fmt::format("it does not divide the model's {} attention heads, which the ranks "
                        "of a group share; give a divisor of {}",
                        heads, heads));
      }
      if (kv % size != 0 && size % kv != 0) {
        refuse(
            fmt::format("the model's {} key/value heads and the degree must divide one "
                        "another (each rank takes kv/size of them, or one replicated)",
                        kv));
      }
      if (layer.moe && layer.moe->shard_size > 1) {
        refuse(
            "expert parallelism (expert_parallel_size > 1) and sequence parallelism do not "
            "combine yet; give one of them");
      }
    }
    if (I.body->spec.router_aux_coef) {
      refuse(
          "a mixture of experts' load-balancing loss (output_router_logits, "
          "moe_aux_loss_coef) is one over the whole batch's tokens, which no rank holds; "
          "train without it, or with sequence_parallel_size 1");
    }
    if (I.installed_prompt) {
      refuse(
          "P-Tuning and prefix tuning cannot train with sequence parallelism; use LoRA, "
          "freeze or full");
    }
    shard = std::make_shared<const model::SequenceShard>(std::move(comm), size);
  }
  I.sequence = shard;
}

void CausalLM::set_tiled_mlp(bool on, int64_t shards) {
  if (shards < 0) {
    throw InvalidArgument(
        fmt::format("set_tiled_mlp: {} shards; give 0 (ALST's rule) or more", shards));
  }
  for (const auto& layer : impl_->body->layers) {
    layer->mlp_shards = on ? std::optional<int64_t>(shards) : std::nullopt;
  }
}

int64_t CausalLM::sequence_parallel_size() const {
  return impl_->sequence ? impl_->sequence->size : 1;
}

PromptAdapter* CausalLM::prompt_adapter() const {
  return impl_->installed_prompt.get();
}

void CausalLM::set_adapters_enabled(bool enabled) {
  Impl& I = *impl_;
  std::vector<std::shared_ptr<model::Linear>> linears;
  for (const auto& item : named_modules("", /*include_self=*/false)) {
    auto lin = std::dynamic_pointer_cast<model::Linear>(item.value());
    if (!lin || !lin->adapter) continue;
    if (lin->adapter_merged) {
      throw InvalidArgument(fmt::format(
          "set_adapters_enabled: the adapter of '{}' is merged into its weight; unmerge it first",
          item.key()));
    }
    linears.push_back(std::move(lin));
  }
  std::vector<model::MoeExperts::Adapted*> experts;
  for (const auto& item : named_modules("", /*include_self=*/false)) {
    auto e = std::dynamic_pointer_cast<model::MoeExperts>(item.value());
    if (!e) continue;
    for (size_t i = 0; i < model::MoeExperts::kTensors; ++i) {
      model::MoeExperts::Adapted& a = e->adapted[i];
      if (!a.adapter) continue;
      if (a.merged) {
        throw InvalidArgument(
            fmt::format("set_adapters_enabled: the adapter of '{}.{}' is merged "
                        "into its tensor; unmerge it first",
                        item.key(), model::MoeExperts::kNames[i]));
      }
      experts.push_back(&a);
    }
  }
  for (auto& lin : linears) lin->adapter_disabled = !enabled;
  for (model::MoeExperts::Adapted* a : experts) a->disabled = !enabled;
  I.adapters_enabled = enabled;
  I.prompt = enabled ? I.installed_prompt.get() : nullptr;
}

bool CausalLM::adapters_enabled() const {
  return impl_->adapters_enabled;
}

// The forward both losses share: the embeddings, the layers and, in the head's unit, the
// cross-entropy of every position — summed (loss) or per position (label_log_probs) — and,
// with `mean_logits`, each position's mean logit.
CausalLM::HeadOutputs CausalLM::head_losses(const at::Tensor& input_ids, const at::Tensor& labels,
                                            const at::Tensor& attention_mask, int64_t chunk_tokens,
                                            const at::Tensor& position_ids,
                                            const HeadRequest& request) {
  Impl& I = *impl_;
  if (!(request.temperature > 0) || !std::isfinite(request.temperature)) {
    throw InvalidArgument(fmt::format(
        "CausalLM::label_log_probs: temperature {}: a finite number > 0", request.temperature));
  }
  if (request.temperature != 1.0 && I.body->logit_softcap() > 0) {
    throw InvalidArgument(
        "CausalLM::label_log_probs: a temperature other than 1 with a final logit soft-cap "
        "(final_logit_softcapping) is not supported");
  }
  if (position_ids.defined() && I.prompt) {
    throw InvalidArgument(
        "CausalLM::loss: packed sequences (position_ids) cannot be combined with "
        "P-Tuning or prefix tuning; train those methods without packing");
  }
  const at::Device device = I.body->embed_tokens->weight.device();
  at::Tensor ids = input_ids.to(device);
  at::Tensor mask = mask_or_empty(attention_mask, ids);
  // HF's causal loss: position t predicts label t+1; the last position predicts nothing.
  // Virtual tokens (P-Tuning) are labelled -100 in front, so the last of them predicts the first
  // input token, as PEFT arranges it. Counted where the labels are (usually the host), so a GPU
  // step needs no sync for it.
  at::Tensor y = labels;
  if (I.prompt && I.prompt->prepends_tokens()) {
    y = at::cat({at::full({labels.size(0), I.prompt->num_virtual_tokens()}, -100, labels.options()),
                 labels},
                1);
  }
  at::Tensor shifted =
      at::cat({y.narrow(1, 1, y.size(1) - 1), at::full({y.size(0), 1}, -100, y.options())}, 1);
  // Sequence parallelism: this rank's slice of the positions, the labels shifted before the
  // cut and the mask and positions kept whole (attention covers every position).
  const model::SequenceShard* shard = I.sequence.get();
  SequenceSlice slice;
  at::Tensor whole_mask = attention_mask;  // the mask the document spans are read from
  at::Tensor positions = position_ids;
  if (shard != nullptr) {
    slice.real = ids.size(1);
    slice.length = shard->slice_length(slice.real);
    slice.padded = slice.length * shard->size;
    slice.first = shard->place * slice.length;
    const int64_t pad = slice.padded - slice.real;
    ids = slice.cut(pad_columns(ids, pad, 0));
    shifted = slice.cut(pad_columns(shifted, pad, -100));
    if (mask.numel() > 0) mask = pad_columns(mask, pad, 0);
    if (whole_mask.defined()) whole_mask = pad_columns(whole_mask, pad, 0);
    if (positions.defined()) positions = pad_columns(positions, pad, 0);
  }
  shifted = shifted.reshape({-1});
  const int64_t tokens = shifted.ne(-100).sum().item<int64_t>();
  shifted = shifted.to(device);

  auto body = I.body;
  at::Tensor embedded = gate_(0, {ids}, [body](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{body->scaled_tokens(body->embed_tokens->forward(in[0]))};
  })[0];
  Prepared p = apply_prompt(config_, I.prompt, embedded, mask);
  at::Tensor x = p.x;
  // The load-balancing loss of a forward that trains: rows are real where the mask is
  // non-zero (its last columns cover the layers' rows; a prefix adds none).
  const bool balanced = I.balance && at::GradMode::is_enabled();
  if (balanced) {
    at::Tensor rows;
    if (p.mask.numel() > 0)
      rows = p.mask.narrow(1, p.mask.size(1) - x.size(1), x.size(1)).ne(0).reshape({-1});
    I.balance->begin(rows);
  }
  const DecoderBody::Tables tables =
      shard != nullptr
          ? slice_tables(*body, slice, positions.defined() ? positions.to(device) : positions,
                         x.scalar_type(), device)
      : position_ids.defined() ? body->tables(position_ids.to(device), x.scalar_type())
                               : body->tables(p.start, x.size(1), x.scalar_type(), device);
  // Documents and padding as spans for variable-length attention where it runs (GPU), read
  // from the mask before it went to the device; the layers then get no mask.
  std::shared_ptr<const model::DocumentSpans> spans;
  if (p.mask.numel() > 0 && !I.prompt &&
      model::varlen_attention_applies(body->spec, x.scalar_type(), device)) {
    if (auto s = model::document_spans(whole_mask, device))
      spans = std::make_shared<const model::DocumentSpans>(std::move(*s));
  }
  const at::Tensor none = at::empty({0}, x.options());
  const at::Tensor& layer_mask = spans ? none : p.mask;
  for (size_t i = 0; i < body->layers.size(); ++i) {
    const at::Tensor& pk = p.prefixes.empty() ? none : p.prefixes[i].first;
    const at::Tensor& pv = p.prefixes.empty() ? none : p.prefixes[i].second;
    const auto& [cos, sin] = body->of_layer(tables, i);
    x = gate_(
        1 + i, {x, cos, sin, layer_mask, pk, pv},
        [layer = body->layers[i], spans, sequence = I.sequence](const std::vector<at::Tensor>& in) {
          model::KvCache prefix{in[4], in[5], {}, {}};
          // A unit is one layer: when the engine recomputes it, its output only roots
          // back-propagation.
          return std::vector<at::Tensor>{
              layer->forward(in[0], in[1], in[2], in[3], in[4].numel() > 0 ? &prefix : nullptr,
                             recomputing_for_backward(), spans.get(), sequence.get())};
        })[0];
  }
  auto lm_head = I.lm_head;
  const int64_t chunk = chunk_tokens;
  std::vector<at::Tensor> out = gate_(
      1 + body->layers.size(), {x, shifted},
      [body, lm_head, chunk, request](const std::vector<at::Tensor>& in) {
        at::Tensor h = body->norm->forward(in[0]);
        const at::Tensor& w = lm_head ? lm_head->weight : body->embed_tokens->weight;
        h = h.reshape({-1, h.size(-1)});
        // (h / T)·wᵀ = (h·wᵀ) / T: the temperature divides the rows (no soft-cap here).
        if (request.temperature != 1.0) h = h / request.temperature;
        const double cap = body->logit_softcap();
        std::vector<at::Tensor> results{
            request.per_position ? model::linear_token_cross_entropy(h, w, in[1], chunk, true, cap)
                                 : model::linear_cross_entropy(h, w, in[1], chunk, true, cap)};
        // Metrics, read in the first pass only (a recomputation's outputs are never read).
        if (!recomputing_for_backward()) {
          if (request.mean_logits) results.push_back(model::row_mean_logits(h, w, cap));
          if (request.entropies) results.push_back(model::row_entropies(h, w, cap));
        }
        return results;
      });
  // After the head: the loss's node is the graph's newest, so its backward runs first.
  const at::Tensor aux = balanced ? I.balance->finish() : at::Tensor();
  HeadOutputs result{out[0], tokens, {}, aux, {}};
  size_t next = 1;
  if (request.mean_logits && next < out.size()) result.mean_logits = out[next++].detach();
  if (request.entropies && next < out.size()) result.entropies = out[next++].detach();
  if (shard != nullptr && request.per_position) {
    // Per position over the whole sequence, 0 off this rank's slice.
    const int64_t b = input_ids.size(0);
    const auto whole = [&](const at::Tensor& mine) {
      if (!mine.defined()) return mine;
      const at::Tensor rows = mine.view({b, slice.length});
      return at::cat({at::zeros({b, slice.first}, rows.options()), rows,
                      at::zeros({b, slice.padded - slice.first - slice.length}, rows.options())},
                     1)
          .narrow(1, 0, slice.real)
          .reshape({-1});
    };
    result.losses = whole(result.losses);
    result.mean_logits = whole(result.mean_logits);
    result.entropies = whole(result.entropies);
  }
  return result;
}

LossSum CausalLM::loss(const at::Tensor& input_ids, const at::Tensor& labels,
                       const at::Tensor& attention_mask, int64_t chunk_tokens,
                       const at::Tensor& position_ids) {
  HeadOutputs out =
      head_losses(input_ids, labels, attention_mask, chunk_tokens, position_ids, HeadRequest{});
  LossSum l{out.losses, out.tokens};
  if (out.aux.defined()) {
    l.aux = out.aux;
    l.aux_coef = *impl_->body->spec.router_aux_coef;
  }
  return l;
}

at::Tensor CausalLM::label_log_probs(const at::Tensor& input_ids, const at::Tensor& labels,
                                     const at::Tensor& attention_mask, int64_t chunk_tokens,
                                     const at::Tensor& position_ids, at::Tensor* mean_logits,
                                     double temperature, at::Tensor* entropies) {
  const int64_t virtual_tokens =
      impl_->prompt && impl_->prompt->prepends_tokens() ? impl_->prompt->num_virtual_tokens() : 0;
  HeadRequest request;
  request.per_position = true;
  request.mean_logits = mean_logits != nullptr;
  request.entropies = entropies != nullptr;
  request.temperature = temperature;
  HeadOutputs out =
      head_losses(input_ids, labels, attention_mask, chunk_tokens, position_ids, request);
  // Position t scores label t + 1: entry t of the result is position t - 1's; the virtual
  // tokens' columns (P-Tuning) are dropped.
  const int64_t b = input_ids.size(0), t = input_ids.size(1) + virtual_tokens;
  const auto align = [&](const at::Tensor& per_position) {
    at::Tensor rows = per_position.view({b, t});
    return at::cat({at::zeros({b, 1}, rows.options()), rows.narrow(1, 0, t - 1)}, 1)
        .narrow(1, virtual_tokens, input_ids.size(1));
  };
  if (mean_logits) *mean_logits = align(out.mean_logits.to(at::kFloat));
  if (entropies) *entropies = align(out.entropies.to(at::kFloat));
  return align(out.losses.neg());
}

std::vector<at::Tensor> CausalLM::hidden_states(const at::Tensor& input_ids,
                                                const at::Tensor& attention_mask) {
  Impl& I = *impl_;
  const at::Device device = I.body->embed_tokens->weight.device();
  at::Tensor ids = input_ids.to(device);
  Prepared p =
      apply_prompt(config_, I.prompt, I.body->scaled_tokens(I.body->embed_tokens->forward(ids)),
                   mask_or_empty(attention_mask, ids));
  std::vector<at::Tensor> out{p.x};
  const DecoderBody::Tables tables =
      I.body->tables(p.start, p.x.size(1), p.x.scalar_type(), device);
  for (size_t i = 0; i < I.body->layers.size(); ++i) {
    model::KvCache prefix;
    if (!p.prefixes.empty()) prefix = {p.prefixes[i].first, p.prefixes[i].second, {}, {}};
    const auto& [cos, sin] = I.body->of_layer(tables, i);
    out.push_back(I.body->layers[i]->forward(out.back(), cos, sin, p.mask,
                                             p.prefixes.empty() ? nullptr : &prefix));
  }
  return out;
}

at::Tensor CausalLM::logits(const at::Tensor& input_ids, const at::Tensor& attention_mask) {
  std::vector<at::Tensor> states = hidden_states(input_ids, attention_mask);
  at::Tensor h = impl_->body->norm->forward(states.back());
  return impl_->body->capped(at::matmul(h, impl_->head_weight().t()));
}

at::Tensor CausalLM::generate(const at::Tensor& input_ids, const GenerationOptions& o) {
  const at::Tensor ids = input_ids.to(at::kCPU).to(at::kLong).contiguous();
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t r = 0; r < ids.size(0); ++r) {
    const int64_t* row = ids[r].data_ptr<int64_t>();
    prompts.emplace_back(row, row + ids.size(1));
  }
  const std::vector<Generated> done = generate_batch(prompts, o);
  size_t width = 0;
  for (const Generated& g : done) width = std::max(width, g.tokens.size());
  at::Tensor out = at::empty({ids.size(0), static_cast<int64_t>(width)}, at::kLong);
  for (size_t r = 0; r < done.size(); ++r) {
    const std::vector<int64_t>& t = done[r].tokens;
    const int64_t fill = config_.pad_token_id ? *config_.pad_token_id : t.empty() ? 0 : t.back();
    for (size_t c = 0; c < width; ++c)
      out[static_cast<int64_t>(r)][static_cast<int64_t>(c)] = c < t.size() ? t[c] : fill;
  }
  return out.to(impl_->body->embed_tokens->weight.device());
}

std::vector<Generated> CausalLM::generate_batch(const std::vector<std::vector<int64_t>>& prompts,
                                                const GenerationOptions& o,
                                                const std::vector<uint64_t>& streams_in) {
  model::check_generation_options(o);
  Impl& I = *impl_;
  at::NoGradGuard no_grad;
  const model::DecodingScope decoding;  // what generation alone may shorten (model/decoding.hpp)
  // Generation never drops out: eval mode for its duration, the caller's mode back after.
  struct ModeBack {
    CausalLM& model;
    bool training;
    ~ModeBack() { model.train(training); }
  } mode_back{*this, is_training()};
  eval();
  const int64_t n = static_cast<int64_t>(prompts.size());
  std::vector<Generated> out(static_cast<size_t>(n));
  std::vector<uint64_t> streams = streams_in;
  if (streams.empty()) {
    for (int64_t i = 0; i < n; ++i) streams.push_back(static_cast<uint64_t>(i));
  } else if (static_cast<int64_t>(streams.size()) != n) {
    throw InvalidArgument(
        fmt::format("generate_batch: {} streams for {} prompts", streams.size(), n));
  }
  int64_t width = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto& p = prompts[static_cast<size_t>(i)];
    if (p.empty()) throw InvalidArgument(fmt::format("generate_batch: prompt {} is empty", i));
    for (int64_t t : p) {
      if (t < 0 || t >= config_.vocab_size) {
        throw InvalidArgument(fmt::format(
            "generate_batch: prompt {} holds token id {}, outside the vocabulary [0, {})", i, t,
            config_.vocab_size));
      }
    }
    width = std::max<int64_t>(width, static_cast<int64_t>(p.size()));
  }
  if (n == 0 || o.max_new_tokens == 0) return out;

  // The batch left-padded. The attention mask numbers the padding as a document of its own
  // (2) beside the real tokens (1): a real query sees only real keys, and a padding query
  // always sees at least itself (no row of the attention is empty).
  const at::Device device = I.body->embed_tokens->weight.device();
  at::Tensor ids = at::zeros({n, width}, at::kLong);
  at::Tensor doc = at::ones({n, width}, at::kLong);
  at::Tensor pos = at::zeros({n, width}, at::kLong);
  bool padded = false;
  for (int64_t i = 0; i < n; ++i) {
    const auto& p = prompts[static_cast<size_t>(i)];
    const int64_t pad = width - static_cast<int64_t>(p.size());
    padded = padded || pad > 0;
    if (pad > 0) doc[i].narrow(0, 0, pad).fill_(2);
    ids[i].narrow(0, pad, width - pad).copy_(at::tensor(p, at::kLong));
    pos[i].narrow(0, pad, width - pad).copy_(at::arange(width - pad, at::kLong));
  }
  ids = ids.to(device);
  at::Tensor seen;
  if (o.repetition_penalty != 1.0) {
    seen = at::zeros({n, config_.vocab_size}, at::TensorOptions().dtype(at::kBool).device(device));
    seen.scatter_(1, ids, true);
    if (padded) {  // padding is not a token of the row
      for (int64_t i = 0; i < n; ++i) {
        const auto& p = prompts[static_cast<size_t>(i)];
        seen[i].zero_();
        seen[i].index_fill_(0, at::tensor(p, at::kLong).to(device), true);
      }
    }
  }
  Prepared prep =
      apply_prompt(config_, I.prompt, I.body->scaled_tokens(I.body->embed_tokens->forward(ids)),
                   padded || I.prompt ? doc.to(device) : at::empty({0}, ids.options()));
  // Positions: P-Tuning's virtual tokens take 0 .. v - 1 and the prompt follows; a prefix
  // moves the prompt to p.start.
  const int64_t v = prep.virtual_tokens;
  pos = pos + (v > 0 ? v : prep.start);
  if (v > 0) pos = at::cat({at::arange(v, at::kLong).unsqueeze(0).expand({n, v}), pos}, 1);
  pos = pos.to(device);
  const at::ScalarType dtype = prep.x.scalar_type();
  const size_t layers = I.body->layers.size();
  std::vector<model::KvCache> cache(layers);
  for (size_t i = 0; i < prep.prefixes.size(); ++i)
    cache[i] = {prep.prefixes[i].first, prep.prefixes[i].second, {}, {}};
  at::Tensor seen_tokens = seen;
  // The next token's scores from the last position's hidden state h [B, H].
  const auto scores_of = [&](const at::Tensor& h) {
    return model::process_logits(
        I.body->capped(at::matmul(I.body->norm->forward(h), I.head_weight().t())), seen_tokens, o);
  };
  const auto choose = [&](const at::Tensor& scores, const at::Tensor& draws) {
    return o.do_sample ? model::sample_tokens(scores, draws) : scores.argmax(-1);
  };
  // rows[r]: the prompt of buffer row r; live[r]: whether it is still generating.
  std::vector<int64_t> rows(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rows[static_cast<size_t>(i)] = i;
  std::vector<char> live(static_cast<size_t>(n), 1);
  int64_t running = n;
  const auto draws_for = [&](int64_t step) {
    std::vector<uint64_t> active;
    for (int64_t r : rows) active.push_back(streams[static_cast<size_t>(r)]);
    return model::uniform_draws(o.seed, active, step);
  };
  const auto take = [&](const at::Tensor& next) {
    const at::Tensor host = next.to(at::kCPU).contiguous();
    const int64_t* chosen = host.data_ptr<int64_t>();
    for (size_t r = 0; r < rows.size(); ++r) {
      if (!live[r]) continue;
      Generated& g = out[static_cast<size_t>(rows[r])];
      g.tokens.push_back(chosen[r]);
      g.stopped = std::find(o.eos_token_ids.begin(), o.eos_token_ids.end(), chosen[r]) !=
                      o.eos_token_ids.end() ||
                  (o.stop_strings &&
                   o.stop_strings->completes(prompts[static_cast<size_t>(rows[r])], g.tokens));
      if (g.stopped) {
        live[r] = 0;
        --running;
      }
    }
  };

  // The prompts' pass: every layer's keys and values, and the first token.
  at::Tensor first;
  {
    const DecoderBody::Tables tables = I.body->tables(pos, dtype);
    at::Tensor x = prep.x;
    for (size_t i = 0; i < layers; ++i) {
      const auto& [cos, sin] = I.body->of_layer(tables, i);
      x = I.body->layers[i]->forward(x, cos, sin, prep.mask, &cache[i]);
    }
    first =
        choose(scores_of(x.select(1, x.size(1) - 1)), o.do_sample ? draws_for(0) : at::Tensor());
  }
  take(first);
  if (running == 0 || o.max_new_tokens == 1) return out;

  // Decoding, one token a row a step, into fixed buffers: each layer's keys and values for
  // every position the generation reaches, the positions each row may attend to, the step's
  // input tokens, positions, draws and output. A step reads nothing from the host, so on CUDA
  // it is recorded once and replayed (StepGraph).
  const int64_t held = cache[0].k.size(2);  // prefix, virtual tokens and prompt
  const int64_t capacity = held + o.max_new_tokens - 1;
  for (model::KvCache& c : cache) {
    for (at::Tensor* t : {&c.k, &c.v}) {
      at::Tensor buffer = at::zeros({n, t->size(1), capacity, t->size(3)}, t->options());
      buffer.narrow(2, 0, held).copy_(*t);
      *t = buffer;
    }
  }
  at::Tensor keys = at::zeros({n, 1, 1, capacity}, at::TensorOptions(at::kBool).device(device));
  if (prep.mask.numel() > 0) {
    TORCH_CHECK(prep.mask.size(1) == held, "generate_batch: a mask of ", prep.mask.size(1),
                " keys for ", held, " cached");
    keys.narrow(3, 0, held).copy_(prep.mask.eq(1).view({n, 1, 1, held}));
  } else {
    keys.narrow(3, 0, held).fill_(true);
  }
  const at::TensorOptions longs = at::TensorOptions(at::kLong).device(device);
  at::Tensor slot = at::full({1}, held, longs);
  at::Tensor tokens = first.view({n, 1}).clone();
  const at::Tensor last = pos.narrow(1, pos.size(1) - 1, 1);
  at::Tensor positions = last + 1;
  at::Tensor draws = at::zeros({n}, at::TensorOptions(at::kDouble).device(device));
  at::Tensor chosen = at::zeros({n}, longs);
  if (seen_tokens.defined()) seen_tokens.scatter_(1, tokens, true);
  const auto attach = [&] {
    for (model::KvCache& c : cache) {
      c.slot = slot;
      c.keys = keys;
    }
  };
  attach();
  // cos / sin of every position the decoding reaches, gathered by position each step — or, for
  // the scalings whose frequencies depend on how far the positions reach (dynamic, longrope),
  // computed from the positions each step, as the prompts' pass does.
  bool reach = false;
  for (const model::RotarySpec& r : I.body->spec.rotaries) reach = reach || model::reach_matters(r);
  DecoderBody::Tables all;
  if (!reach) {
    const int64_t top = last.max().item<int64_t>() + o.max_new_tokens + 1;
    for (const auto& [c, si] : I.body->tables(at::arange(top, longs).view({1, top}), dtype))
      all.emplace_back(c.view({top, -1}), si.view({top, -1}));
  }
  const auto step = [&] {
    keys.index_fill_(3, slot, true);
    DecoderBody::Tables tables;
    if (reach) {
      tables = I.body->tables(positions, dtype);
    } else {
      const at::Tensor at_positions = positions.view({-1});
      const int64_t b = positions.size(0);
      for (const auto& [c, si] : all) {
        tables.emplace_back(c.index_select(0, at_positions).view({b, 1, 1, -1}),
                            si.index_select(0, at_positions).view({b, 1, 1, -1}));
      }
    }
    at::Tensor x = I.body->scaled_tokens(I.body->embed_tokens->forward(tokens));
    for (size_t i = 0; i < layers; ++i) {
      const auto& [cos, sin] = I.body->of_layer(tables, i);
      x = I.body->layers[i]->forward(x, cos, sin, at::Tensor(), &cache[i]);
    }
    const at::Tensor next = choose(scores_of(x.select(1, 0)), draws);
    chosen.copy_(next);
    if (seen_tokens.defined()) seen_tokens.scatter_(1, next.unsqueeze(1), true);
    tokens.copy_(next.unsqueeze(1));
    positions.add_(1);
    slot.add_(1);
  };
  // Recorded where nothing in a step reads the host: not with mixtures of experts (their
  // routing counts tokens on the host) or frequencies that depend on the reach.
  bool recordable = !reach;
  for (const model::LayerSpec& l : I.body->spec.layers) recordable = recordable && !l.moe;
  recordable = recordable && model::StepGraph::records(device);
  std::unique_ptr<model::StepGraph> graph;
  // A step attends over the buffer positions decoding has reached, rounded up to kReachStep,
  // not the whole buffer: a long generation reads half the keys and values on average. Each
  // reach is recorded anew (about a step's cost, every kReachStep steps).
  constexpr int64_t kReachStep = 1024;
  int64_t reached = 0;
  for (int64_t s = 1; s < o.max_new_tokens && running > 0; ++s) {
    // Finished rows leave the batch: at once where steps run one by one, once half of them
    // finished where a step is a recording (each new batch size is recorded anew, about a
    // step's cost).
    const int64_t buffered = static_cast<int64_t>(rows.size());
    if (running < buffered && (!recordable || 2 * running <= buffered)) {
      std::vector<int64_t> keep, still;
      for (size_t r = 0; r < rows.size(); ++r) {
        if (!live[r]) continue;
        keep.push_back(static_cast<int64_t>(r));
        still.push_back(rows[r]);
      }
      const at::Tensor k = at::tensor(keep, at::kLong).to(device);
      for (model::KvCache& c : cache) {
        c.k = c.k.index_select(0, k);
        c.v = c.v.index_select(0, k);
      }
      keys = keys.index_select(0, k);
      tokens = tokens.index_select(0, k);
      positions = positions.index_select(0, k);
      draws = draws.index_select(0, k);
      chosen = chosen.index_select(0, k);
      if (seen_tokens.defined()) seen_tokens = seen_tokens.index_select(0, k);
      attach();
      rows = std::move(still);
      live.assign(rows.size(), 1);
      graph.reset();
    }
    // Step s writes its key and value at buffer position held + s − 1.
    const int64_t needed =
        std::min(capacity, (held + s + kReachStep - 1) / kReachStep * kReachStep);
    if (needed != reached) {
      reached = needed;
      for (model::KvCache& c : cache) c.reach = reached;
      graph.reset();
    }
    if (o.do_sample) draws.copy_(draws_for(s));
    if (recordable) {
      if (!graph) graph = std::make_unique<model::StepGraph>(device, step);
      graph->run();
    } else {
      step();
    }
    take(chosen);
  }
  return out;
}

}  // namespace zt
