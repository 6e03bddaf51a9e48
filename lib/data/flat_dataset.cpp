// The Dataset itself: tokenized examples stored flat (all ids, all labels, where each example
// and, once packed, each document starts), filled by add or taken whole by from_flat.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"

namespace zt {

void Dataset::check_index(int64_t i) const {
  if (i < 0 || i >= size()) {
    throw InvalidArgument(
        fmt::format("example index {} is out of range: the dataset has {} examples", i, size()));
  }
}

namespace {

bool strictly_increasing(const std::vector<int64_t>& v) {
  return std::adjacent_find(v.begin(), v.end(), std::greater_equal<int64_t>()) == v.end();
}

}  // namespace

Dataset Dataset::from_flat(std::vector<int32_t> ids, std::vector<int32_t> labels,
                           std::vector<int64_t> offsets, std::vector<int64_t> document_offsets) {
  const int64_t tokens = static_cast<int64_t>(ids.size());
  if (labels.size() != ids.size()) {
    throw InvalidArgument(fmt::format("{} labels for {} token ids", labels.size(), tokens));
  }
  if (offsets.empty() || offsets.front() != 0 || offsets.back() != tokens ||
      !strictly_increasing(offsets)) {
    throw InvalidArgument(fmt::format(
        "the {} offsets do not cut the {} tokens into nonempty examples", offsets.size(), tokens));
  }
  if (std::any_of(ids.begin(), ids.end(), [](int32_t id) { return id < 0; })) {
    throw InvalidArgument("negative token ids");
  }
  if (std::any_of(labels.begin(), labels.end(),
                  [](int32_t l) { return l < 0 && l != kIgnoreLabel; })) {
    throw InvalidArgument(fmt::format("negative labels other than {}", kIgnoreLabel));
  }
  const bool documents_ok =
      document_offsets.empty() ||
      (strictly_increasing(document_offsets) && document_offsets.back() == tokens &&
       std::includes(document_offsets.begin(), document_offsets.end(), offsets.begin(),
                     offsets.end()));
  if (!documents_ok) {
    throw InvalidArgument("the document offsets do not cut the examples into nonempty documents");
  }
  Dataset d;
  d.ids_ = std::move(ids);
  d.labels_ = std::move(labels);
  d.offsets_ = std::move(offsets);
  d.doc_offsets_ = std::move(document_offsets);
  return d;
}

void Dataset::add(const std::vector<int32_t>& ids, const std::vector<int32_t>& labels) {
  if (packed()) throw InvalidArgument("Dataset::add: the dataset is packed; add before packing");
  if (!desirable_.empty()) {
    throw InvalidArgument(
        "Dataset::add: the dataset's KTO labels are set; add before setting them");
  }
  if (ids.empty() || ids.size() != labels.size()) {
    throw InvalidArgument(fmt::format(
        "Dataset::add: ids ({} tokens) and labels ({}) must have the same nonzero length",
        ids.size(), labels.size()));
  }
  ids_.insert(ids_.end(), ids.begin(), ids.end());
  labels_.insert(labels_.end(), labels.begin(), labels.end());
  offsets_.push_back(static_cast<int64_t>(ids_.size()));
}

void Dataset::set_desirable(std::vector<uint8_t> flags) {
  if (!flags.empty() && static_cast<int64_t>(flags.size()) != size()) {
    throw InvalidArgument(
        fmt::format("{} KTO labels for {} examples: one per example", flags.size(), size()));
  }
  if (std::any_of(flags.begin(), flags.end(), [](uint8_t f) { return f > 1; })) {
    throw InvalidArgument("KTO labels other than 0 (undesirable) and 1 (desirable)");
  }
  desirable_ = std::move(flags);
}

int64_t Dataset::length(int64_t i) const {
  check_index(i);
  return offsets_[i + 1] - offsets_[i];
}

TokenView Dataset::ids(int64_t i) const {
  const int64_t n = length(i);  // checks i
  return {ids_.data() + offsets_[i], n};
}

TokenView Dataset::labels(int64_t i) const {
  const int64_t n = length(i);
  return {labels_.data() + offsets_[i], n};
}

std::vector<int64_t> Dataset::lengths() const {
  std::vector<int64_t> out(size());
  for (int64_t i = 0; i < size(); ++i) out[i] = offsets_[i + 1] - offsets_[i];
  return out;
}

std::vector<int64_t> Dataset::document_lengths(int64_t i) const {
  if (!packed()) return {length(i)};
  check_index(i);
  auto it = std::lower_bound(doc_offsets_.begin(), doc_offsets_.end(), offsets_[i]);
  std::vector<int64_t> out;
  for (; *it < offsets_[i + 1]; ++it) out.push_back(*(it + 1) - *it);
  return out;
}

}  // namespace zt
