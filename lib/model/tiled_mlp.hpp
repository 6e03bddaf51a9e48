// ALST's TiledMLP (CausalLM::set_tiled_mlp): a dense MLP over its input rows in tiles, forward
// without keeping any tile's activations, backward recomputing and back-propagating one tile at
// a time, so a long sequence's [rows, intermediate] activations never exist whole.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "model/layers.hpp"

namespace zt::model {

/// The tiles of `rows` rows: `shards` of them, or with shards 0 ALST's ceil(rows / hidden).
int64_t mlp_tiles(int64_t rows, int64_t hidden, int64_t shards);

/// mlp(x) (Mlp::compute) over `tiles` tiles of x's rows (x [..., hidden]), with the backward
/// described above: x's gradient and the gradients of mlp's trainable parameters, summed over
/// the tiles, each parameter's accumulated once. Dropout's draws are replayed from the state
/// the forward began with. `output_unread`: only back-propagated through (a recomputed unit):
/// forward computes nothing, the result's values are uninitialized.
at::Tensor tiled_mlp(Mlp& mlp, const at::Tensor& x, int64_t tiles, bool output_unread = false);

}  // namespace zt::model
