// A model family: what one decoder family of transformers (or a remote-code model) does
// differently from the shared blocks. One file per family under lib/model/families/, each
// defining a `Family` and nothing else of the library's, all of them listed in
// families/registry.cpp. docs/model.md shows how to add one.
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <vector>

#include <rapidjson/document.h>

#include "model/blocks.hpp"
#include "util/json.hpp"
#include "zerotrain/model.hpp"

namespace zt::model {

/// Prefix tuning (P-Tuning v2) as the family's own code does it. The default is PEFT's
/// PrefixEncoder. ChatGLM2/3 bring their own: each prefix is embedded at the output's width, the
/// projection is named `trans`, the prefixes pass through dropout in training, and the input's
/// positions start at 0 after them. ChatGLM's encoder is saved in its own format as well
/// (peft/adapter_io.cpp).
struct PrefixTuning {
  /// The model's own encoder, saved in its own format beside PEFT's.
  bool model_own = false;
  /// The embedding is [n, layers·2·kv_dim] (the output's width), not [n, kv_dim].
  bool embed_at_output_width = false;
  std::string_view transform = "transform";  ///< the projection's module name
  double train_dropout = 0.0;                ///< on the prefixes, in training
  /// The input's positions start at 0, not after the virtual tokens.
  bool positions_from_zero = false;
};

/// Writing a family's folder as another family states the same model (zerotrain merge --as):
/// the other family's config, and for each of this family's parameters the other's tensors
/// taken from its rows.
struct Conversion {
  std::string_view to;  ///< the other family's model_type
  ModelConfig (*config)(const ModelConfig& c);
  std::vector<GlmTensorFrom> (*tensors)(const ModelConfig& c, const std::string& name);
};

/// A multimodal folder whose text decoder zerotrain trains, text alone (Gemma 3 4B / 12B / 27B,
/// published only as Gemma3ForConditionalGeneration). Its config.json holds the decoder's config
/// under `text_config`, which transformers 4.x writes as a diff against the text config class:
/// `text_defaults` (that class's defaults, a JSON object) fills every key left out before the
/// family reads it. The module tree is transformers' (ModuleNames::body
/// "model.language_model"), so parameter and PEFT names are the ones transformers and PEFT use.
/// The folder's other parts (`parts`, model-name prefixes: the vision tower, the projector) are
/// not modelled: loading skips them, and every folder of whole weights zerotrain writes from
/// such a model copies them from the base (kept_parts.hpp).
struct Multimodal {
  std::string_view text_config = "text_config";
  /// The family its text decoder is (text_config's model_type, which must be this where given).
  std::string_view text_model_type;
  std::string_view text_defaults;
  std::array<std::string_view, 2> parts;
};

/// A family's own reading of its config.json beyond ModelConfig's members
/// (ModelConfig::family_settings): each family that needs one derives its own.
struct FamilySettings {
  virtual ~FamilySettings() = default;
};

struct Family {
  using ReadConfig = void (*)(json::ObjectReader& r, ModelConfig& c);
  using WriteConfig = void (*)(rapidjson::Document& doc, const ModelConfig& c);
  using Compose = DecoderSpec (*)(const ModelConfig& c);
  using RopeParameters = rapidjson::Value (*)(const ModelConfig& c,
                                              rapidjson::Document::AllocatorType& alloc);

  constexpr Family(std::string_view model_type, ReadConfig read_config, WriteConfig write_config,
                   Compose compose = nullptr, bool remote_code = false, ModuleNames names = {},
                   PrefixTuning prefix = {}, const Conversion* conversion = nullptr,
                   RopeParameters rope_parameters = nullptr, const Multimodal* multimodal = nullptr,
                   std::string_view read_dequantized = {})
      : model_type(model_type),
        read_config(read_config),
        write_config(write_config),
        compose(compose),
        remote_code(remote_code),
        names(names),
        prefix(prefix),
        conversion(conversion),
        rope_parameters(rope_parameters),
        multimodal(multimodal),
        read_dequantized(read_dequantized) {}

  /// config.json's model_type.
  std::string_view model_type;
  /// Reads the family's config.json members into `c`, whose model_type is set: the sizes and
  /// every switch of the family, refusing (through `r`) what the blocks cannot compute. A
  /// multimodal family's `r` reads its text_config, completed with its defaults.
  ReadConfig read_config;
  /// Writes a whole config.json for `c` as the family's own code would save it (a model built
  /// from an inline config has no file to copy). The caller adds dtype and RoPE spellings.
  WriteConfig write_config;
  /// The blocks its decoder is made of, for `c` (blocks.hpp); null: shared_decoder(c), the
  /// shared switches alone.
  Compose compose;
  /// Read by remote code (trust_remote_code): its config.json carries torch_dtype only, none of
  /// transformers' RoPE spellings.
  bool remote_code;
  /// Its module tree's names (transformers' unless it says otherwise).
  ModuleNames names;
  /// How prefix tuning works for it (PEFT's unless it says otherwise).
  PrefixTuning prefix;
  /// Its folders written as another family's, or null (ChatGLM's as transformers' glm).
  const Conversion* conversion;
  /// 5.x's rope_parameters for `c`, where they are not one block of ModelConfig's RoPE (Gemma 3:
  /// one per layer type); null: that one block. Written beside 4.x's spelling whenever a
  /// config.json is saved.
  RopeParameters rope_parameters;
  /// A multimodal folder's text decoder (above), or null.
  const Multimodal* multimodal;
  /// The quant_method of a quantization_config that this family's folders are read dequantized
  /// from, as released (gpt-oss's "mxfp4": the checkpoint reader dequantizes its experts'
  /// `_blocks` / `_scales`, weights.cpp); "" for none. Any other quant_method goes to the 4-bit
  /// path (quantized_weights.hpp), which reads bitsandbytes' only.
  std::string_view read_dequantized;
};

/// The family of `model_type`, or null.
const Family* find_family(std::string_view model_type);
/// The family of `c` (llama for a config built in code without a model_type). Throws
/// InvalidArgument for a model_type no family has.
const Family& family_of(const ModelConfig& c);
/// Every family: the library's (families/registry.cpp), then those registered.
std::vector<const Family*> families();
/// "llama, qwen2, ...": every model_type, in that order.
std::string family_names();
/// Adds a family defined outside the library (a test's, a host program's own); `family` must
/// outlive every use. Throws InvalidArgument for a model_type already there. Not thread-safe:
/// register before any config is read.
void register_family(const Family& family);

}  // namespace zt::model
