// The engine on the GPU machine: every stage with NCCL, bf16 and fp16 (and fp32) against the
// single-process reference at world size 1, offload included; all visible GPUs when there
// are several.
#include "support/catch.hpp"

#include <ATen/Context.h>

#include "support/equivalence.hpp"

using zt::test::make_case;
using zt::test::run_case;

namespace {

void run_on_gpu(zt::test::Case c) {
  c.device = "cuda";
  run_case(c);
}

}  // namespace

TEST_CASE("engine on GPU: stages 0-3 in bf16, fp16 and fp32 match the reference", "[gpu][engine]") {
  REQUIRE(at::getNumGPUs() > 0);
  run_on_gpu(make_case(0, 1, 1, "bf16", false, "transformer"));
  run_on_gpu(make_case(1, 1, 3, "fp16", false, "transformer"));
  run_on_gpu(make_case(2, 1, 3, "bf16", false, "transformer", "adamw", true));
  run_on_gpu(make_case(3, 1, 1, "fp16", false, "transformer"));
  run_on_gpu(make_case(2, 1, 1, "fp32", false, "mlp"));
  run_on_gpu(make_case(3, 1, 3, "bf16", false, "mlp", "sgd"));
}

TEST_CASE("engine on GPU: updates inside backward match the reference", "[gpu][engine]") {
  for (const char* dtype : {"bf16_pure", "fp32"}) {
    zt::test::Case c = make_case(2, 1, 1, dtype, false, "transformer");
    c.clip = 0.0;
    c.in_backward = true;
    run_on_gpu(c);
  }
}

TEST_CASE("engine on GPU: optimizer and parameter offload match the reference", "[gpu][engine]") {
  run_on_gpu(make_case(2, 1, 1, "bf16", true, "transformer"));
  run_on_gpu(make_case(3, 1, 3, "bf16", true, "transformer"));
  run_on_gpu(make_case(1, 1, 1, "fp32", true, "mlp"));
  for (double ratio : {0.5, 0.0}) {  // partial offload: the rest on the GPU
    zt::test::Case c = make_case(2, 1, 3, "fp16", true, "transformer");
    c.offload_ratio = ratio;
    run_on_gpu(c);
  }
}

TEST_CASE("engine on GPU: all visible GPUs as ranks", "[gpu][engine][multi]") {
  int gpus = static_cast<int>(at::getNumGPUs());
  if (gpus < 2) {
    WARN("only " << gpus << " GPU visible: the multi-rank engine run needs 2 or more");
    return;
  }
  for (int stage = 0; stage <= 3; ++stage) {
    run_on_gpu(make_case(stage, gpus, 2, stage % 2 ? "fp16" : "bf16", stage == 2, "transformer"));
  }
}
