// A user's own LibTorch module trained with ZeRO-3 through zerotrain's public C++ API.
//
// The module routes each layer through a zt::UnitGate and lists the layers as sharding units;
// zt::Engine then keeps only 1/N of every layer's parameters on each rank, gathers a layer
// just before it runs and releases it right after. Run it on N ranks:
//
//     zerotrain launch --nproc_per_node 2 -- zt_example_custom_stage3
//     torchrun --no-python --nproc_per_node 2 zt_example_custom_stage3
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include <ATen/Context.h>

#include <cstdio>
#include <exception>

#include "zerotrain/comm.hpp"
#include "zerotrain/config.hpp"
#include "zerotrain/engine.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/units.hpp"

namespace {

// y = W_k · tanh(... tanh(W_1 x)): a deep MLP regressor.
struct DeepMlp : torch::nn::Module {
  zt::UnitGate gate;
  std::vector<std::shared_ptr<torch::nn::LinearImpl>> layers;
  torch::nn::ModuleList list{nullptr};

  explicit DeepMlp(int depth) {
    list = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < depth; ++i) {
      layers.push_back(std::make_shared<torch::nn::LinearImpl>(64, i + 1 == depth ? 1 : 64));
      list->push_back(layers.back());
    }
  }

  at::Tensor forward(at::Tensor x) {
    for (size_t i = 0; i < layers.size(); ++i) {
      const bool last = i + 1 == layers.size();
      // Capture by value: under ZeRO-3 the function runs again during backward.
      x = gate(i, {x}, [layer = layers[i], last](const std::vector<at::Tensor>& in) {
        at::Tensor y = layer->forward(in[0]);
        return std::vector<at::Tensor>{last ? y : at::tanh(y)};
      })[0];
    }
    return x;
  }

  std::vector<zt::UnitSpec> units() {
    std::vector<zt::UnitSpec> out;
    for (size_t i = 0; i < layers.size(); ++i)
      out.push_back({"layer" + std::to_string(i), layers[i]});
    return out;
  }
};

}  // namespace

int main() {
  try {
    zt::LaunchEnv env = zt::launch_env_from_environment();
    // One GPU per rank when there are enough, else CPU ranks.
    zt::CommOptions comm_options;
    if (static_cast<int>(at::getNumGPUs()) >= env.local_world_size) {
      comm_options.device = at::Device(at::kCUDA, static_cast<int16_t>(env.local_rank));
    }
    std::shared_ptr<zt::Communicator> comm = zt::create_communicator(env, comm_options);
    const at::Device device = comm_options.device;

    zt::DeepSpeedConfig ds = zt::parse_deepspeed_config(R"({
      "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2,
      "gradient_clipping": 1.0,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}
    })",
                                                        "example config");
    zt::TrainingArguments args;
    args.lr_scheduler_type = "constant";
    zt::resolve_config(ds, args, zt::ResolveContext{comm->world_size(), 64, 60});

    at::manual_seed(0);
    auto model = std::make_shared<DeepMlp>(6);
    zt::EngineOptions options;
    options.units = model->units();
    options.gate = &model->gate;
    options.total_train_steps = 60;
    options.device = device;
    zt::Engine engine(model, ds, comm, options);

    // A fixed random target function; each rank draws its own micro-batches.
    at::manual_seed(7);
    at::Tensor teacher = (at::randn({64, 1}) / 8.0).to(device);
    at::manual_seed(100 + static_cast<uint64_t>(comm->rank()));
    double first = 0, last = 0;
    for (int step = 0; step < 60; ++step) {
      for (int micro = 0; micro < engine.gradient_accumulation_steps(); ++micro) {
        at::Tensor x = at::randn({16, 64}).to(device);
        at::Tensor y = at::tanh(at::mm(x, teacher));
        at::Tensor loss = at::mse_loss(model->forward(x), y);
        engine.backward(loss);
        engine.step();
        at::Tensor mean = loss.detach().reshape({1}).clone();
        engine.communicator().all_reduce(mean, zt::ReduceOp::kAvg)->wait();
        last = mean.item<double>();
        if (step == 0 && micro == 0) first = last;
      }
      if (comm->rank() == 0 && step % 10 == 0) {
        std::printf("step %2d  loss %.5f  grad_norm %.4f  gathered now %lld elements\n", step, last,
                    engine.last_grad_norm(), static_cast<long long>(engine.memory().gathered_now));
      }
    }
    zt::EngineMemory m = engine.memory();
    if (comm->rank() == 0) {
      std::printf(
          "loss %.5f -> %.5f; per rank: %lld bytes of parameters, %lld of optimizer state, "
          "peak gathered %lld elements\n",
          first, last, static_cast<long long>(m.compute_params),
          static_cast<long long>(m.optimizer_state), static_cast<long long>(m.gathered_peak));
    }
    if (!(last < 0.5 * first)) {
      std::fprintf(stderr, "error: the loss did not fall (%.5f -> %.5f)\n", first, last);
      return 1;
    }
    if (comm->rank() == 0) std::printf("custom module trained with ZeRO-3: OK\n");
    return 0;
  } catch (const zt::ConfigError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
