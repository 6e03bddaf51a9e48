// A model family's own layout of instruction records: where a family's fine-tuning repository
// lays a record out itself rather than through a chat template (ChatGLM-Finetuning's glm2 and
// glm3, option `mode`). Each layout lives in its family's file (record_layouts.cpp holds
// ChatGLM's); dataset.cpp and the trainer only ask for the one the options name.
//
// Thread-safety: a layout is immutable; encode may run from several threads at once.
#pragma once

#include <memory>
#include <string>

#include "data/encoding.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/tokenizer.hpp"

namespace zt::data {

class RecordLayout {
 public:
  virtual ~RecordLayout() = default;
  /// One instruction record (instruction + input, and output), as the family's script encodes
  /// it; `truncated` says whether the layout cut it.
  virtual Example encode(const std::string& instruction, const std::string& output,
                         bool* truncated) const = 0;
};

/// The layout `o.glm_prompt_layout` names for `tok`, checked against the tokenizer and the
/// lengths (a ConfigError naming the option otherwise); nullptr when the options name none.
/// `tok` must outlive the layout.
std::unique_ptr<RecordLayout> record_layout(const DataOptions& o, const Tokenizer& tok);

/// The chat template whose prompt is the named layout's (what `zerotrain verify` asks with and
/// chat records are formatted by when no template is given), or "" for no layout.
std::string record_layout_template(const std::string& layout);

}  // namespace zt::data
