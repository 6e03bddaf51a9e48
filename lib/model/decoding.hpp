// Whether this thread is decoding (CausalLM::generate_batch holds a DecodingScope): steps bound
// by how many kernels they launch, which may take shortcuts that no scored log-prob or gradient
// may. The one taken: a LoRA projection's scaling folded into its last product (peft/lora.cpp),
// one kernel fewer a projection, its [tokens, r] activations rounded once where PEFT's
// expression rounds them twice.
#pragma once

namespace zt::model {

inline thread_local bool decoding_now = false;

inline bool decoding() {
  return decoding_now;
}

/// Marks this thread as decoding for its lifetime (nests).
class DecodingScope {
 public:
  DecodingScope() : outer_(decoding_now) { decoding_now = true; }
  ~DecodingScope() { decoding_now = outer_; }
  DecodingScope(const DecodingScope&) = delete;
  DecodingScope& operator=(const DecodingScope&) = delete;

 private:
  bool outer_;
};

}  // namespace zt::model
