// Engine equivalence cases: train N steps through zt::Engine on real ranks and compare with a
// plain single-process LibTorch run on the same global batches (shared by CPU and GPU tests).
#pragma once

#include <string>

namespace zt::test {

struct Case {
  int stage = 0;
  int world = 1;
  int accum = 1;
  std::string dtype = "fp32";
  bool offload = false;
  std::string model = "mlp";
  std::string opt = "adamw";
  bool ckpt = false;
  bool token_norm = true;
  int64_t bucket = 400;
  int64_t steps = 4;
  int64_t micro = 2;
  std::string device = "cpu";  ///< "cpu", or "cuda" (rank r uses cuda:LOCAL_RANK)
  double clip = 1.0;           ///< max_grad_norm (0: none)
  bool in_backward = false;    ///< EngineOptions::update_in_backward, required to take effect
  double offload_ratio = 1.0;  ///< offload_optimizer.ratio (with `offload`)
  int mics = -1;               ///< mics_shard_size (-1: none)
  int hpz = 1;                 ///< zero_hpz_partition_size (1: none)

  std::string encode() const;
  static Case decode(const std::string& s);
  std::string describe() const;
};

Case make_case(int stage, int world, int accum, const char* dtype, bool offload, const char* model,
               const char* opt = "adamw", bool ckpt = false);

/// Runs `c` as c.world processes of this test binary (its hidden "rank: engine equivalence"
/// case, which must be linked in: tests/support/equivalence.cpp defines it) and REQUIREs that
/// every rank matched the reference.
void run_case(const Case& c);

}  // namespace zt::test
