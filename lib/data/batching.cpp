// From a Dataset to micro-batches: collation (padded or packed), packing, and the sampler that
// fixes which examples each optimizer step, micro-step and rank uses.
#include <ATen/ATen.h>

#include <algorithm>

#include <fmt/format.h>

#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"

namespace zt {

Batch collate(const Dataset& dataset, const std::vector<int64_t>& indices, int32_t pad_id) {
  if (pad_id < 0) {
    throw InvalidArgument(
        fmt::format("collate: pad_id {} is negative; pass the tokenizer's "
                    "pad_id, or its eos_id when it has none",
                    pad_id));
  }
  const int64_t rows = static_cast<int64_t>(indices.size());
  int64_t width = 0;
  for (int64_t i : indices) width = std::max(width, dataset.length(i));

  const at::TensorOptions options = at::TensorOptions().dtype(at::kLong);
  Batch b;
  b.input_ids = at::full({rows, width}, pad_id, options);
  b.labels = at::full({rows, width}, kIgnoreLabel, options);
  b.attention_mask = at::zeros({rows, width}, options);
  const bool packed = dataset.packed();
  if (packed) {
    b.position_ids = at::zeros({rows, width}, options);
    b.document_ids = at::full({rows, width}, -1, options);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = indices[r];
    const TokenView ids = dataset.ids(i);
    const TokenView labels = dataset.labels(i);
    int64_t* row_ids = b.input_ids.data_ptr<int64_t>() + r * width;
    int64_t* row_labels = b.labels.data_ptr<int64_t>() + r * width;
    int64_t* row_mask = b.attention_mask.data_ptr<int64_t>() + r * width;
    for (int64_t t = 0; t < ids.size; ++t) {
      row_ids[t] = ids[t];
      row_labels[t] = labels[t];
      row_mask[t] = 1;
      if (labels[t] != kIgnoreLabel) ++b.target_tokens;
    }
    if (!packed) continue;
    int64_t* row_positions = b.position_ids.data_ptr<int64_t>() + r * width;
    int64_t* row_documents = b.document_ids.data_ptr<int64_t>() + r * width;
    int64_t t = 0;
    int64_t document = 0;
    for (int64_t length : dataset.document_lengths(i)) {
      for (int64_t p = 0; p < length; ++p, ++t) {
        row_positions[t] = p;
        row_documents[t] = document;
      }
      ++document;
    }
  }
  return b;
}

Dataset pack(const Dataset& examples, int64_t max_length, const std::vector<int64_t>& order) {
  if (examples.packed()) throw InvalidArgument("pack: the dataset is packed already");
  if (max_length < 1) {
    throw InvalidArgument(fmt::format("pack: max_length must be >= 1, got {}", max_length));
  }
  std::vector<int32_t> ids;
  std::vector<int32_t> labels;
  std::vector<int64_t> offsets{0};
  std::vector<int64_t> documents{0};
  int64_t open = 0;  // tokens in the sequence being filled
  for (int64_t i : order) {
    const int64_t n = examples.length(i);
    if (n > max_length) {
      throw InvalidArgument(fmt::format(
          "pack: example {} has {} tokens, more than max_length {}; tokenize with the same "
          "max_length as packing uses",
          i, n, max_length));
    }
    if (open + n > max_length) {
      offsets.push_back(static_cast<int64_t>(ids.size()));
      open = 0;
    }
    const TokenView x = examples.ids(i);
    const TokenView y = examples.labels(i);
    ids.insert(ids.end(), x.begin(), x.end());
    labels.insert(labels.end(), y.begin(), y.end());
    // The first token would be predicted from the previous document's last one.
    labels[labels.size() - n] = kIgnoreLabel;
    documents.push_back(static_cast<int64_t>(ids.size()));
    open += n;
  }
  if (open > 0) offsets.push_back(static_cast<int64_t>(ids.size()));
  return Dataset::from_flat(std::move(ids), std::move(labels), std::move(offsets),
                            std::move(documents));
}

// ---- sampling ------------------------------------------------------------------------------

namespace {

// splitmix64 (Steele, Lea, Flood 2014): tiny, well mixed, and ours, so orders never change with
// the LibTorch or standard library version.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Uniform in [0, bound): draws at or above the largest multiple of bound are redrawn, so there is
// no modulo bias.
uint64_t uniform_below(uint64_t& state, uint64_t bound) {
  const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
  uint64_t x = splitmix64(state);
  while (x >= limit) x = splitmix64(state);
  return x % bound;
}

void require(bool ok, const std::string& message) {
  if (!ok) throw InvalidArgument(message);
}

}  // namespace

std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch, bool shuffle,
                                 const std::vector<int64_t>* lengths, int64_t megabatch) {
  require(n >= 0 && epoch >= 0,
          fmt::format("epoch_order: n ({}) and epoch ({}) must be >= 0", n, epoch));
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  if (shuffle) {
    uint64_t state = seed + static_cast<uint64_t>(epoch);
    for (int64_t i = n - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(uniform_below(state, static_cast<uint64_t>(i) + 1));
      std::swap(order[i], order[j]);
    }
  }
  if (lengths == nullptr || n == 0) return order;

  const std::vector<int64_t>& len = *lengths;
  require(static_cast<int64_t>(len.size()) == n,
          fmt::format("epoch_order: {} lengths for {} examples", len.size(), n));
  require(megabatch >= 1, fmt::format("epoch_order: megabatch must be >= 1, got {}", megabatch));
  int64_t longest = 0;  // start of the megabatch holding the longest example
  for (int64_t begin = 0; begin < n; begin += megabatch) {
    const int64_t end = std::min(n, begin + megabatch);
    std::stable_sort(order.begin() + begin, order.begin() + end,
                     [&](int64_t a, int64_t b) { return len[a] > len[b]; });
    if (len[order[begin]] > len[order[longest]]) longest = begin;
  }
  std::swap(order[0], order[longest]);
  return order;
}

int64_t length_megabatch(int64_t n, int64_t global_batch) {
  require(n >= 0 && global_batch >= 1,
          fmt::format("length_megabatch: n ({}) must be >= 0 and global_batch ({}) >= 1", n,
                      global_batch));
  return std::max<int64_t>(1, std::min<int64_t>(n / (4 * global_batch), 50)) * global_batch;
}

int64_t steps_per_epoch(int64_t n, int64_t global_batch, bool drop_last) {
  require(n >= 0 && global_batch >= 1,
          fmt::format("steps_per_epoch: n ({}) must be >= 0 and global_batch ({}) >= 1", n,
                      global_batch));
  return drop_last ? n / global_batch : (n + global_batch - 1) / global_batch;
}

std::vector<int64_t> micro_batch_indices(const std::vector<int64_t>& order, const GlobalBatch& g,
                                         int64_t step, int64_t micro_step, int64_t rank) {
  require(g.micro_batch >= 1 && g.accumulation >= 1 && g.world >= 1,
          fmt::format("micro_batch_indices: micro_batch ({}), accumulation ({}) and world ({}) "
                      "must be >= 1",
                      g.micro_batch, g.accumulation, g.world));
  const auto n = static_cast<int64_t>(order.size());
  require(step >= 0 && step * g.size() < n,
          fmt::format("micro_batch_indices: step {} is outside the epoch ({} examples, {} per "
                      "step)",
                      step, n, g.size()));
  require(micro_step >= 0 && micro_step < g.accumulation,
          fmt::format("micro_batch_indices: micro_step {} is outside [0, {})", micro_step,
                      g.accumulation));
  require(rank >= 0 && rank < g.world,
          fmt::format("micro_batch_indices: rank {} is outside [0, {})", rank, g.world));
  const int64_t begin = step * g.size() + (micro_step * g.world + rank) * g.micro_batch;
  std::vector<int64_t> out(g.micro_batch);
  for (int64_t k = 0; k < g.micro_batch; ++k) out[k] = order[(begin + k) % n];
  return out;
}

std::vector<std::vector<int64_t>> eval_batches(int64_t n, int64_t world, int64_t rank,
                                               int64_t batch_size) {
  require(n >= 0 && world >= 1 && batch_size >= 1 && rank >= 0 && rank < world,
          fmt::format("eval_batches: n {}, world {}, rank {}, batch_size {}: need n >= 0, "
                      "world >= 1, 0 <= rank < world, batch_size >= 1",
                      n, world, rank, batch_size));
  const int64_t per_step = world * batch_size;
  std::vector<std::vector<int64_t>> batches((n + per_step - 1) / per_step);
  for (int64_t j = 0; j < static_cast<int64_t>(batches.size()); ++j) {
    const int64_t begin = j * per_step + rank * batch_size;
    for (int64_t i = begin; i < std::min(begin + batch_size, n); ++i) batches[j].push_back(i);
  }
  return batches;
}

}  // namespace zt
