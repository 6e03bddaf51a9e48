// See tiled_mlp.hpp.
#include "model/tiled_mlp.hpp"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <vector>

#include "util/rng.hpp"

namespace zt::model {

namespace {

// Rows [first, first + count) of tile `i` of `n` over `rows` rows (the first rows % n tiles one
// row longer).
std::pair<int64_t, int64_t> tile_rows(int64_t rows, int64_t n, int64_t i) {
  const int64_t base = rows / n, extra = rows % n;
  return {i * base + std::min(i, extra), base + (i < extra ? 1 : 0)};
}

class TiledMlpFunction : public torch::autograd::Function<TiledMlpFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList params, int64_t mlp, int64_t tiles, bool unread) {
    Mlp& m = *reinterpret_cast<Mlp*>(static_cast<intptr_t>(mlp));
    ctx->save_for_backward({x});
    ctx->saved_data["mlp"] = mlp;
    ctx->saved_data["tiles"] = tiles;
    ctx->saved_data["params"] = static_cast<int64_t>(params.size());
    // The draws the tiles make (LoRA's dropout), replayed in backward.
    ctx->saved_data["cpu_rng"] = rng::state(at::kCPU);
    if (x.is_cuda()) ctx->saved_data["device_rng"] = rng::state(x.device());
    const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = m.down_proj->out_features;
    if (unread) return at::empty(shape, x.options());
    const at::Tensor flat = x.reshape({rows, hidden});
    at::Tensor out = at::empty({rows, shape.back()}, x.options());
    for (int64_t i = 0; i < tiles; ++i) {
      const auto [first, count] = tile_rows(rows, tiles, i);
      if (count > 0) out.narrow(0, first, count).copy_(m.compute(flat.narrow(0, first, count)));
    }
    return out.view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The model owns the MLP past every backward of its forwards.
    Mlp& m = *reinterpret_cast<Mlp*>(static_cast<intptr_t>(ctx->saved_data["mlp"].toInt()));
    const int64_t tiles = ctx->saved_data["tiles"].toInt();
    const at::Tensor x = ctx->get_saved_variables()[0];
    const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
    const at::Tensor flat = x.reshape({rows, hidden}).detach();
    const at::Tensor g = grads[0].reshape({rows, -1});
    // The trainable parameters, in the order apply() was given them.
    std::vector<at::Tensor> params;
    for (const at::Tensor& p : m.parameters()) params.push_back(p);
    std::vector<size_t> trained;
    for (size_t k = 0; k < params.size(); ++k) {
      if (params[k].requires_grad()) trained.push_back(k);
    }
    std::vector<at::Tensor> param_grads(params.size());
    at::Tensor dx = at::empty_like(flat);
    const bool cuda = x.is_cuda();
    const at::Tensor cpu_now = rng::state(at::kCPU);
    const at::Tensor device_now = cuda ? rng::state(x.device()) : at::Tensor();
    rng::set_state(at::kCPU, ctx->saved_data["cpu_rng"].toTensor());
    if (cuda) rng::set_state(x.device(), ctx->saved_data["device_rng"].toTensor());
    {
      at::AutoGradMode enable(true);
      for (int64_t i = 0; i < tiles; ++i) {
        const auto [first, count] = tile_rows(rows, tiles, i);
        if (count == 0) continue;
        const at::Tensor xt = flat.narrow(0, first, count).detach().requires_grad_(true);
        const at::Tensor yt = m.compute(xt);
        std::vector<at::Tensor> inputs{xt};
        for (size_t k : trained) inputs.push_back(params[k]);
        const std::vector<at::Tensor> got =
            torch::autograd::grad({yt}, inputs, {g.narrow(0, first, count)}, /*retain_graph=*/false,
                                  /*create_graph=*/false, /*allow_unused=*/true);
        dx.narrow(0, first, count).copy_(got[0].defined() ? got[0] : at::zeros_like(xt));
        for (size_t j = 0; j < trained.size(); ++j) {
          const at::Tensor& d = got[j + 1];
          if (!d.defined()) continue;
          at::Tensor& sum = param_grads[trained[j]];
          sum = sum.defined() ? sum.add_(d) : d.clone();
        }
      }
    }
    rng::set_state(at::kCPU, cpu_now);
    if (cuda) rng::set_state(x.device(), device_now);
    torch::autograd::variable_list result{dx.view(x.sizes())};
    for (at::Tensor& d : param_grads) result.push_back(d);
    result.emplace_back();  // mlp
    result.emplace_back();  // tiles
    result.emplace_back();  // unread
    return result;
  }
};

}  // namespace

int64_t mlp_tiles(int64_t rows, int64_t hidden, int64_t shards) {
  const int64_t n = shards > 0 ? shards : (rows + hidden - 1) / std::max<int64_t>(1, hidden);
  return std::max<int64_t>(1, std::min(n, rows));
}

at::Tensor tiled_mlp(Mlp& mlp, const at::Tensor& x, int64_t tiles, bool output_unread) {
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : mlp.parameters()) params.push_back(p);
  return TiledMlpFunction::apply(x, at::TensorList(params),
                                 static_cast<int64_t>(reinterpret_cast<intptr_t>(&mlp)), tiles,
                                 output_unread);
}

}  // namespace zt::model
