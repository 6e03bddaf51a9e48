// Ulysses sequence parallelism inside the decoder (CausalLM::set_sequence_parallel): a group of
// `size` ranks shares each sequence, rank j of the group holding positions [j·t, (j + 1)·t).
// Around attention, one all-to-all turns every member's (all heads, its positions) into (its
// share of the heads, all positions), and one turns the attention's output back.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <tuple>

#include "zerotrain/comm.hpp"

namespace zt::model {

/// This rank's place in its sequence-parallel group. Immutable once made; shared by the
/// model's attentions. Its exchanges are collectives of the whole communicator (ranks of other
/// groups exchange nothing with this one), forward and backward.
struct SequenceShard {
  std::shared_ptr<Communicator> comm;
  int64_t size = 1;   ///< ranks in the group
  int64_t place = 0;  ///< this rank's place in it: its slice of every sequence
  int64_t first = 0;  ///< the group's first world rank

  /// The shard of rank `rank` of `comm` in groups of `size` consecutive ranks.
  SequenceShard(std::shared_ptr<Communicator> c, int64_t group_size);

  /// Positions per rank of a sequence of `length` (padded up to a multiple of size).
  int64_t slice_length(int64_t length) const { return (length + size - 1) / size; }

  /// q [B, H, t, D], k and v [B, KV, t, D] over this rank's t positions → q [B, H/size, size·t,
  /// D] over every position, k and v [B, KV/size, size·t, D] — with KV < size, each key/value
  /// head replicated size/KV times first (every member gets the one its query heads read).
  /// One exchange for the three.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> to_heads(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v) const;
  /// The attention's output [B, H/size, size·t, D] → [B, t, H, D] over this rank's positions
  /// (every member's heads in order).
  at::Tensor to_positions(const at::Tensor& out) const;

 private:
  /// `chunks` [size, ...] (chunk j for member j) exchanged: chunk j of the result came from
  /// member j.
  at::Tensor swap(const at::Tensor& chunks) const;
};

}  // namespace zt::model
