// A multimodal folder's parts beside the text decoder (family.hpp, Multimodal: the vision tower,
// the projector): not modelled, skipped on load, and copied as they are into every folder of
// whole weights written from such a model (zerotrain merge, a full fine-tune's output).
#pragma once

#include <string>
#include <vector>

#include "model/family.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt::model {

/// Whether `stored`, a tensor name in a folder of `mm`'s family, belongs to a part that is not
/// modelled, in either layout transformers saves; false for a null `mm`.
bool is_kept_part(const Multimodal* mm, const std::string& stored);

/// The kept parts of one folder, to write beside the model's own tensors.
struct KeptParts {
  struct Tensor {
    std::string name;    ///< in transformers' module tree: what is written
    std::string stored;  ///< in the folder's files
    std::vector<int64_t> shape;
  };
  std::string dir;  ///< the folder holding them ("" for none)
  std::vector<Tensor> tensors;

  /// Appends their entries, in `dtype`, to a SafetensorsStreamWriter's plan.
  void plan(std::vector<TensorEntry>& plan, at::ScalarType dtype) const;
  /// Writes them, read from `dir` and cast to `dtype`, in the order plan() listed them.
  void write(SafetensorsStreamWriter& writer, at::ScalarType dtype) const;
};

/// The kept parts of the first of `dirs` that holds any (empty entries and folders without model
/// weights skipped); none for a family that is not multimodal. Logs a warning when `c`'s family
/// is multimodal and no folder holds its parts (what is written then lacks them). Throws IoError
/// for unreadable files.
KeptParts kept_parts_of(const ModelConfig& c, const std::vector<std::string>& dirs);

}  // namespace zt::model
