// Preference training's exactness on CUDA: the PEFT fixtures (TRL's and LLaMA-Factory's formulas
// over transformers + PEFT, tests/tools/make_preference_fixtures.py) that CI checks on the CPU,
// checked on the GPU — log-probs, losses, metrics, KTO's KL estimate and the adapters' gradients.
#include "support/catch.hpp"
#include "support/preference_fixtures.hpp"

TEST_CASE("preference losses, KTO's too, on the GPU are the PEFT fixture's",
          "[gpu][preference][peft]") {
  const at::Device gpu(at::kCUDA, 0);
  for (const char* family : {"llama", "qwen2", "glm"}) {
    INFO(family);
    // fp32 on both; the GPU's GEMMs sum in another order (TF32 stays off by default).
    CHECK(zt::test::check_pair_fixture(family, gpu, 10) >= 8);
    CHECK(zt::test::check_kto_fixture(family, gpu, 10) == 3);
  }
}
