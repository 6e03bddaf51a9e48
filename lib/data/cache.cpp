// The tokenized-data cache: a safetensors file per (data file, tokenizer, options), named by a
// hash of everything the tokens depend on, checked completely when read back.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <vector>

#include <fmt/format.h>

#include "data/stats.hpp"
#include "util/crc32c.hpp"
#include "util/files.hpp"
#include "util/log.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt {
namespace {

// Bump when the tokenization rules or the file layout change: old cache files then no longer
// match any key (and are rejected by load_dataset).
constexpr int kCacheVersion = 2;  // 2: templated_examples
constexpr const char* kCacheFormat = "zerotrain-dataset";

// The data file's content as 96 bits (CRC-32C and a 64-bit multiply-rotate hash of every byte)
// plus its size: an edit of any size at any time gives another key. Not a cryptographic hash:
// it tells a user's edits apart, not an adversary's collisions. The file is read in 1 MiB
// pieces (hashing runs at several GB/s, far faster than tokenizing).
std::string content_hash(const std::string& jsonl_path, uint64_t* size) {
  const int fd = files::open_regular(jsonl_path, "data file");
  std::vector<unsigned char> buf(1 << 20);
  uint32_t crc = 0;
  uint64_t h = 0x9E3779B97F4A7C15ULL;
  *size = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw IoError(fmt::format("cannot read data file '{}': {}", jsonl_path, std::strerror(err)));
    }
    if (n == 0) break;
    const size_t len = static_cast<size_t>(n);
    crc = crc32c::extend(crc, buf.data(), len);
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
      uint64_t w = 0;
      std::memcpy(&w, buf.data() + i, 8);
      h ^= w * 0x87C37B91114253D5ULL;
      h = ((h << 31) | (h >> 33)) * 0x4CF5AD432745937FULL;
    }
    for (; i < len; ++i) h = (h ^ buf[i]) * 0x100000001B3ULL;
    *size += len;
  }
  ::close(fd);
  return fmt::format("{:016x}{:08x}", h, crc);
}

// Everything the tokens depend on, as text; stored in the file to rule out hash collisions.
std::string cache_key(const std::string& jsonl_path, const Tokenizer& tok, const DataOptions& o) {
  uint64_t size = 0;
  const std::string content = content_hash(jsonl_path, &size);
  return fmt::format(
             "version={}\ncontent={}\nsize={}\ntokenizer={}\ntemplate={}\nmax_length={}\n"
             "train_on_prompt={}\nskip_bad_lines={}\ntoken_id_limit={}\nglm_prompt_layout={}\n"
             "max_source_length={}\nskip_truncated={}",
             kCacheVersion, content, size, tok.fingerprint(), o.template_name, o.max_length,
             o.train_on_prompt, o.skip_bad_lines, o.token_id_limit, o.glm_prompt_layout,
             o.max_source_length, o.skip_truncated) +
         (o.preference ? fmt::format("\npreference=1\ntruncation_mode={}\nmax_prompt_length={}",
                                     o.truncation_mode, o.max_prompt_length)
                       : std::string()) +
         (o.kto ? "\nkto=1" : "") +
         // TRL's prompt-completion records were malformed lines before (skipped with
         // skip_bad_lines): a file tokenized then gets a new key. TRL's SFT options are written
         // only when not their defaults.
         (o.preference ? "" : "\nlayouts=prompt_completion") +
         // tokenize_jsonl refuses keep_end: no cache file may answer for it.
         (o.preference || o.truncation_mode == "keep_start"
              ? std::string()
              : "\ntruncation_mode=" + o.truncation_mode) +
         (o.completion_only_loss ? "" : "\ncompletion_only_loss=0") +
         (o.assistant_only_loss ? "" : "\nassistant_only_loss=0") +
         (o.text_field == "text" ? std::string() : "\ntext_field=" + o.text_field);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 14695981039346656037ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

std::string cache_file(const std::string& cache_dir, const std::string& jsonl_path,
                       const std::string& key) {
  namespace fs = std::filesystem;
  const std::string name =
      fmt::format("{}-{:016x}.safetensors", fs::path(jsonl_path).stem().string(), fnv1a(key));
  return (fs::path(cache_dir) / name).string();
}

// The stats a cache file keeps in its metadata. A drop cause is absent from files written
// before it was counted: read as 0 there (read_cache says whether any was missing).
struct StatField {
  const char* name;
  int64_t DatasetStats::*field;
  bool cause = false;
};
const StatField kStatFields[] = {
    {"lines", &DatasetStats::lines},
    {"examples", &DatasetStats::examples},
    {"skipped_lines", &DatasetStats::skipped_lines},
    {"dropped_examples", &DatasetStats::dropped_examples},
    {"tokens", &DatasetStats::tokens},
    {"templated_examples", &DatasetStats::templated_examples},
    {"untrained_examples", &DatasetStats::untrained_examples, true},
    {"truncated_examples", &DatasetStats::truncated_examples, true},
    {"skipped_truncated", &DatasetStats::skipped_truncated, true},
    {"identical_pairs", &DatasetStats::identical_pairs, true},
    {"empty_answers", &DatasetStats::empty_answers, true},
    {"long_prompts", &DatasetStats::long_prompts, true},
    {"cut_answers", &DatasetStats::cut_answers, true},
    {"cut_identical_pairs", &DatasetStats::cut_identical_pairs, true},
};

template <typename T>
at::Tensor view_of(const std::vector<T>& v, at::ScalarType dtype) {
  // save_safetensors only reads the tensor, so viewing the const vector is safe.
  return at::from_blob(const_cast<T*>(v.data()), {static_cast<int64_t>(v.size())},
                       at::TensorOptions().dtype(dtype));
}

IoError corrupt_cache(const std::string& path, const std::string& what) {
  return IoError(
      fmt::format("dataset cache '{}' is corrupt: {}; delete it to tokenize again", path, what));
}

template <typename T>
std::vector<T> read_vector(const SafetensorsFile& f, const char* name, at::ScalarType dtype) {
  if (!f.contains(name)) {
    throw corrupt_cache(f.path(), fmt::format("the tensor '{}' is missing", name));
  }
  const TensorInfo& info = f.info(name);
  if (info.dtype != dtype || info.shape.size() != 1) {
    throw corrupt_cache(f.path(), fmt::format("the tensor '{}' is {} of {} dimension(s), expected "
                                              "1-D {}",
                                              name, info.dtype_name, info.shape.size(),
                                              safetensors_dtype_name(dtype)));
  }
  at::Tensor t = f.load(name);
  const T* p = t.data_ptr<T>();
  return std::vector<T>(p, p + t.numel());
}

void write_cache(const Dataset& d, const std::string& path, const DatasetStats& stats,
                 const std::string& key) {
  std::map<std::string, std::string> metadata{
      {"format", kCacheFormat}, {"version", std::to_string(kCacheVersion)}, {"key", key}};
  for (const StatField& f : kStatFields) metadata[f.name] = std::to_string(stats.*f.field);
  std::vector<std::pair<std::string, at::Tensor>> tensors{
      {"input_ids", view_of(d.flat_ids(), at::kInt)},
      {"labels", view_of(d.flat_labels(), at::kInt)},
      {"offsets", view_of(d.offsets(), at::kLong)}};
  if (d.packed()) {
    tensors.emplace_back("document_offsets", view_of(d.document_offsets(), at::kLong));
  }
  if (!d.desirable().empty()) tensors.emplace_back("desirable", view_of(d.desirable(), at::kByte));
  save_safetensors(path, tensors, metadata);
}

// Every id indexes the embedding: inputs in [0, limit), labels too or -100 (ignored).
void check_ids(const std::string& path, const std::vector<int32_t>& ids,
               const std::vector<int32_t>& labels, int64_t limit) {
  if (limit <= 0) return;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= limit) {
      throw corrupt_cache(path, fmt::format("input id {} at position {} is outside the "
                                            "vocabulary [0, {})",
                                            ids[i], i, limit));
    }
  }
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] != -100 && (labels[i] < 0 || labels[i] >= limit)) {
      throw corrupt_cache(path, fmt::format("label {} at position {} is neither -100 nor in the "
                                            "vocabulary [0, {})",
                                            labels[i], i, limit));
    }
  }
}

// The dataset in a cache file and the key it was written for. `causes_missing`, when given,
// is set when the file drops records without saying why (written before their causes were
// counted).
std::pair<Dataset, std::string> read_cache(const std::string& path, DatasetStats* stats,
                                           int64_t id_limit, bool* causes_missing = nullptr) {
  SafetensorsFile f(path);  // IoError when missing or not safetensors
  auto entry = [&](const char* name) {
    auto it = f.metadata().find(name);
    return it == f.metadata().end() ? std::string() : it->second;
  };
  if (entry("format") != kCacheFormat) {
    throw corrupt_cache(path, fmt::format("metadata format is \"{}\", expected \"{}\"",
                                          entry("format"), kCacheFormat));
  }
  if (entry("version") != std::to_string(kCacheVersion)) {
    throw corrupt_cache(path, fmt::format("cache format version \"{}\", this build reads {}",
                                          entry("version"), kCacheVersion));
  }
  std::vector<int64_t> doc_offsets;
  if (f.contains("document_offsets")) {
    doc_offsets = read_vector<int64_t>(f, "document_offsets", at::kLong);
  }
  Dataset d;
  try {
    std::vector<int32_t> ids = read_vector<int32_t>(f, "input_ids", at::kInt);
    std::vector<int32_t> labels = read_vector<int32_t>(f, "labels", at::kInt);
    check_ids(path, ids, labels, id_limit);
    d = Dataset::from_flat(std::move(ids), std::move(labels),
                           read_vector<int64_t>(f, "offsets", at::kLong), std::move(doc_offsets));
    if (f.contains("desirable")) d.set_desirable(read_vector<uint8_t>(f, "desirable", at::kByte));
  } catch (const InvalidArgument& e) {
    throw corrupt_cache(path, e.what());
  }
  if (stats == nullptr && causes_missing == nullptr) return {std::move(d), entry("key")};
  DatasetStats read;
  bool missing = false;
  for (const StatField& f : kStatFields) {
    if (f.cause && entry(f.name).empty()) {
      missing = true;
      continue;
    }
    try {
      read.*f.field = std::stoll(entry(f.name));
    } catch (const std::exception&) {
      throw corrupt_cache(
          path, fmt::format("metadata \"{}\" is \"{}\", not a number", f.name, entry(f.name)));
    }
  }
  if (causes_missing != nullptr) *causes_missing = missing && read.dropped_examples > 0;
  if (stats != nullptr) *stats = read;
  return {std::move(d), entry("key")};
}

}  // namespace

std::string dataset_cache_path(const std::string& cache_dir, const std::string& jsonl_path,
                               const Tokenizer& tok, const DataOptions& o) {
  return cache_file(cache_dir, jsonl_path, cache_key(jsonl_path, tok, o));
}

void save_dataset(const Dataset& dataset, const std::string& path, const DatasetStats& stats) {
  write_cache(dataset, path, stats, "");
}

Dataset load_dataset(const std::string& path, DatasetStats* stats, int64_t id_limit) {
  return read_cache(path, stats, id_limit).first;
}

Dataset load_or_tokenize(const std::string& jsonl_path, const Tokenizer& tok, const DataOptions& o,
                         const std::string& cache_dir, DatasetStats* stats) {
  namespace fs = std::filesystem;
  if (cache_dir.empty()) return tokenize_jsonl(jsonl_path, tok, o, stats);
  const std::string key = cache_key(jsonl_path, tok, o);
  const std::string path = cache_file(cache_dir, jsonl_path, key);
  std::error_code ec;
  if (fs::exists(path, ec)) {
    try {
      DatasetStats cached;
      bool causes_missing = false;
      std::pair<Dataset, std::string> read =
          read_cache(path, &cached, o.token_id_limit > 0 ? o.token_id_limit : tok.vocab_size(),
                     &causes_missing);
      if (read.second == key && !causes_missing) {
        log::info("{}: {} from the cache '{}'", jsonl_path, data::kept_summary(cached, o), path);
        if (stats != nullptr) *stats = cached;
        return std::move(read.first);
      }
      if (read.second != key) {
        log::warn("dataset cache '{}' was written for other data or options; tokenizing again",
                  path);
      } else {
        log::warn(
            "dataset cache '{}' was written before dropped records were counted by cause; "
            "tokenizing again",
            path);
      }
    } catch (const IoError& e) {
      log::warn("tokenizing again: {}", e.what());
    }
  }
  DatasetStats s;
  Dataset d = tokenize_jsonl(jsonl_path, tok, o, &s);
  fs::create_directories(cache_dir, ec);
  if (ec) {
    throw IoError(fmt::format("cannot create the cache folder '{}': {}", cache_dir, ec.message()));
  }
  write_cache(d, path, s, key);
  if (stats != nullptr) *stats = s;
  return d;
}

}  // namespace zt
