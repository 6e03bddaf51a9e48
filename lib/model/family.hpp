// A model family: what one decoder family of transformers (or a remote-code model) does
// differently from the shared blocks. One file per family under lib/model/families/, each
// defining a `Family` and nothing else of the library's, all of them listed in
// families/registry.cpp. docs/model.md shows how to add one.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <rapidjson/document.h>

#include "util/json.hpp"
#include "zerotrain/model.hpp"

namespace zt::model {

struct Family {
  /// config.json's model_type.
  std::string_view model_type;
  /// Reads the family's config.json members into `c`, whose model_type is set: the sizes and
  /// every switch of the family, refusing (through `r`) what the blocks cannot compute.
  void (*read_config)(json::ObjectReader& r, ModelConfig& c);
  /// Writes a whole config.json for `c` as the family's own code would save it (a model built
  /// from an inline config has no file to copy). The caller adds dtype and RoPE spellings.
  void (*write_config)(rapidjson::Document& doc, const ModelConfig& c);
  /// Read by remote code (trust_remote_code): its config.json carries torch_dtype only, none of
  /// transformers' RoPE spellings.
  bool remote_code = false;
};

/// The family of `model_type`, or null.
const Family* find_family(std::string_view model_type);
/// Every family: the library's (families/registry.cpp), then those registered.
std::vector<const Family*> families();
/// "llama, qwen2, ...": every model_type, in that order.
std::string family_names();
/// Adds a family defined outside the library (a test's, a host program's own); `family` must
/// outlive every use. Throws InvalidArgument for a model_type already there. Not thread-safe:
/// register before any config is read.
void register_family(const Family& family);

}  // namespace zt::model
