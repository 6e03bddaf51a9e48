// Preference training's exactness on CUDA: the PEFT fixtures (TRL's and LLaMA-Factory's formulas
// over transformers + PEFT, tests/tools/make_preference_fixtures.py) that CI checks on the CPU,
// checked on the GPU — log-probs, losses, metrics, KTO's KL estimate and the adapters' gradients.
#include "support/catch.hpp"

#include <fmt/format.h>

#include <cmath>

#include "support/jobs.hpp"
#include "support/preference_fixtures.hpp"
#include "support/ranks.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/trainer.hpp"

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

TEST_CASE("on the GPU too, the reference of every adapter method is the model the run starts from",
          "[gpu][preference][reference]") {
  // The CPU test's methods whose start is not the base (test_preference.cpp), on CUDA: at the
  // first step every reward is 0 and DPO's loss log 2, with the reference online and
  // precomputed; under ZeRO-3 the starting values are swapped in as this rank's shards.
  const std::string dir = zt::test::temp_dir("gpu-reference-starts");
  zt::test::write_pairs(dir, "train.jsonl", 16, 7);
  auto comm = std::shared_ptr<zt::Communicator>(zt::test::join(zt::Backend::kAuto, at::kCUDA));
  const std::vector<std::vector<std::string>> methods = {
      {"--finetuning_type", "lora", "--pissa_init", "true", "--pissa_iter", "2",
       "--quantization_bit", "4"},
      {"--finetuning_type", "lora", "--lora_modules_to_save", "lm_head"},
      {"--finetuning_type", "prefix", "--num_virtual_tokens", "4"},
  };
  int run = 0;
  for (const auto& method : methods) {
    for (const char* precompute : {"false", "true"}) {
      const std::string out = fmt::format("{}/out-{}", dir, run++);
      std::vector<std::string> flags = zt::test::tiny_run_flags(dir,
                                                                {"--stage",
                                                                 "dpo",
                                                                 "--device",
                                                                 "cuda",
                                                                 "--max_steps",
                                                                 "2",
                                                                 "--logging_steps",
                                                                 "1",
                                                                 "--per_device_train_batch_size",
                                                                 "4",
                                                                 "--learning_rate",
                                                                 "1e-2",
                                                                 "--save_steps",
                                                                 "100",
                                                                 "--precompute_ref_log_probs",
                                                                 precompute,
                                                                 "--output_dir",
                                                                 out,
                                                                 "--deepspeed",
                                                                 zt::test::stage_json(3)},
                                                                method);
      INFO(zt::test::join_flags(flags));
      zt::TrainingArguments args;
      zt::apply_training_flags(args, flags);
      zt::Trainer(args, comm).train();
      CHECK(zt::test::logged(out, "rewards/chosen").at(1) == Approx(0.0).margin(1e-6));
      CHECK(zt::test::logged(out, "loss").at(1) == Approx(std::log(2.0)).epsilon(1e-6));
    }
  }
}
