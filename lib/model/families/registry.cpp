// Every model family zerotrain builds, one row each: a family is its file in this folder and
// its row here (docs/model.md, "Adding a family").
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "model/family.hpp"
#include "zerotrain/error.hpp"

namespace zt::model {

extern const Family kLlama, kQwen2, kQwen3, kQwen3Moe, kMistral, kMistral3, kMixtral, kPhi3,
    kGemma2, kGemma3, kGemma3Multimodal, kGlm, kGlm4, kGlm4Moe, kGptOss, kChatGlm;

namespace {

// The library's families first, then those registered by the program.
std::vector<const Family*>& table() {
  static std::vector<const Family*> families{
      &kLlama,   &kQwen2,   &kQwen3,  &kQwen3Moe, &kMistral,          &kMistral3,
      &kMixtral, &kPhi3,    &kGemma2, &kGemma3,   &kGemma3Multimodal, &kGlm,
      &kGlm4,    &kGlm4Moe, &kGptOss, &kChatGlm};
  return families;
}

}  // namespace

const Family* find_family(std::string_view model_type) {
  for (const Family* f : table()) {
    if (f->model_type == model_type) return f;
  }
  return nullptr;
}

const Family& family_of(const ModelConfig& c) {
  const Family* f = find_family(c.model_type.empty() ? "llama" : c.model_type);
  if (f == nullptr) {
    throw InvalidArgument(fmt::format("model_type \"{}\" is not one of the model families ({})",
                                      c.model_type, family_names()));
  }
  return *f;
}

std::vector<const Family*> families() {
  return table();
}

std::string family_names() {
  std::vector<std::string_view> names;
  for (const Family* f : table()) names.push_back(f->model_type);
  return fmt::format("{}", fmt::join(names, ", "));
}

DecoderSpec decoder_spec(const ModelConfig& c) {
  const Family& f = family_of(c);
  DecoderSpec spec = f.compose != nullptr ? f.compose(c) : shared_decoder(c);
  const ModelConfig::ExpertShard& shard = c.expert_shard;
  if (shard.size == 1 && shard.rank == 0) return spec;
  bool mixtures = false;
  for (LayerSpec& l : spec.layers) {
    if (!l.moe) continue;
    mixtures = true;
    if (shard.size < 1 || shard.rank < 0 || shard.rank >= shard.size ||
        l.moe->experts % shard.size != 0) {
      throw ConfigError(fmt::format(
          "expert_parallel_size {} (rank {} of it): it must divide the {} experts of {}'s "
          "mixtures; give a divisor of {}",
          shard.size, shard.rank, l.moe->experts, c.source, l.moe->experts));
    }
    l.moe->shard_size = shard.size;
    l.moe->shard_rank = shard.rank;
  }
  if (!mixtures) {
    throw ConfigError(fmt::format(
        "expert_parallel_size {}: {} ({}) has no mixture of experts to share among ranks; leave "
        "it at 1",
        shard.size, c.source, c.model_type));
  }
  return spec;
}

void register_family(const Family& family) {
  if (family.model_type.empty() || family.read_config == nullptr ||
      family.write_config == nullptr) {
    throw InvalidArgument(
        "register_family: a family needs a model_type, read_config and "
        "write_config");
  }
  if (find_family(family.model_type) != nullptr) {
    throw InvalidArgument(
        fmt::format("register_family: model_type \"{}\" is registered already", family.model_type));
  }
  table().push_back(&family);
}

}  // namespace zt::model
