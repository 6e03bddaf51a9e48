// Reading and writing Hugging Face safetensors files: memory-mapped, validated, single files or
// sharded folders with model.safetensors.index.json.
//
// Thread-safety: a SafetensorsFile / Checkpoint may be read from several threads at once (reads
// do not mutate it). Nothing here is collective.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zt {

struct TensorInfo {
  at::ScalarType dtype = at::kFloat;
  std::string dtype_name;  ///< as written ("BF16", "F32", ...)
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t begin = 0;  ///< byte offset of the data from the start of the file
  int64_t nbytes = 0;
};

/// One .safetensors file, memory-mapped read-only. The header is validated completely on open
/// (size bounds, JSON, known dtypes, shapes, offsets inside the file and non-overlapping,
/// shape × dtype = byte length): a corrupt or truncated file is an IoError naming the file and,
/// where one is at fault, the tensor. Files zerotrain wrote with save_safetensors carry a CRC-32C
/// per 16 MiB of every tensor in __metadata__ ("crc32c:<tensor>"); load and read_range verify
/// the chunks they touch (once each), so a damaged byte is an IoError naming the file and the
/// tensor, never a value. Its const methods may be called from several threads at once.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  ///< in file order
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  /// Throws IoError naming the file and the tensor when absent.
  const TensorInfo& info(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  /// A copy of the tensor (CPU, its stored dtype, or `dtype` when given).
  at::Tensor load(const std::string& name,
                  std::optional<at::ScalarType> dtype = std::nullopt) const;
  /// Copies elements [offset, offset + out.numel()) of the flattened tensor into `out` (any
  /// dtype and device; converted), touching only those bytes of the file.
  void read_range(const std::string& name, int64_t offset, const at::Tensor& out) const;

 private:
  at::Tensor mapped(const TensorInfo& info, int64_t offset, int64_t count) const;

  std::string path_;
  int fd_ = -1;
  void* map_ = nullptr;
  size_t size_ = 0;
  /// Throws IoError when a chunk of `name` overlapping bytes [begin, end) of its data fails its
  /// recorded checksum; nothing when the file records none.
  void verify(const std::string& name, const TensorInfo& info, int64_t begin, int64_t end) const;

  std::map<std::string, TensorInfo> tensors_;
  std::vector<std::string> order_;
  std::map<std::string, std::string> metadata_;
  mutable std::mutex verified_mutex_;
  mutable std::map<std::string, std::vector<bool>> verified_;  ///< per tensor, per chunk
};

/// A model folder's weights: model.safetensors, or shards listed by model.safetensors.index.json
/// (or a single .safetensors file path). Shards are opened lazily.
class SafetensorsCheckpoint {
 public:
  explicit SafetensorsCheckpoint(const std::string& path);
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  const SafetensorsFile& file_of(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const { return file_of(name).info(name); }
  at::Tensor load(const std::string& name,
                  std::optional<at::ScalarType> dtype = std::nullopt) const {
    return file_of(name).load(name, dtype);
  }
  void read_range(const std::string& name, int64_t offset, const at::Tensor& out) const {
    file_of(name).read_range(name, offset, out);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::map<std::string, std::string> shard_of_;  ///< tensor → shard file
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> open_;
  mutable std::mutex mutex_;
};

/// Writes tensors (in the given order) to one safetensors file, atomically: a temporary file in
/// the same folder renamed over `path` only when complete. `metadata` lands in __metadata__,
/// with the tensors' CRC-32C checksums (see SafetensorsFile).
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

/// Writes `tensors` into `dir` as HF does: one `<prefix>.safetensors` when it fits in
/// `max_shard_bytes`, else `<prefix>-0000k-of-0000n.safetensors` +
/// `<prefix>.safetensors.index.json`. Returns the files written.
std::vector<std::string> save_sharded_safetensors(
    const std::string& dir, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
    int64_t max_shard_bytes = 5000000000, const std::string& prefix = "model");

/// A tensor a writer will receive: its name, dtype and shape.
struct TensorEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t nbytes() const;
};

/// Writes a model folder's safetensors one tensor at a time, so nothing needs the whole model
/// in memory: the plan (every tensor's name, dtype and shape, in order) fixes the shards — one
/// `<prefix>.safetensors`, or `<prefix>-0000k-of-0000n.safetensors` of at most `max_shard_bytes`
/// each plus `<prefix>.safetensors.index.json` — and their headers up front. write() takes the
/// tensors in plan order (converting to the planned dtype); each file is written under a
/// temporary name and renamed when complete, the index last, by finish(). A writer destroyed
/// before finish() leaves no partial file behind. Not thread-safe.
class SafetensorsStreamWriter {
 public:
  SafetensorsStreamWriter(const std::string& dir, std::vector<TensorEntry> plan,
                          int64_t max_shard_bytes = 5000000000,
                          const std::string& prefix = "model");
  ~SafetensorsStreamWriter();
  void write(const std::string& name, const at::Tensor& value);
  /// Returns the files written (shards, then the index when sharded).
  std::vector<std::string> finish();

  class File;  ///< one file being written (internal)

 private:
  std::string shard_name(size_t k) const;

  std::string dir_, prefix_;
  std::vector<std::vector<TensorEntry>> shards_;
  int64_t total_bytes_ = 0;
  size_t shard_ = 0;  ///< the next shard to open
  std::unique_ptr<File> file_;
  std::vector<std::string> written_;
};

/// The safetensors name of a dtype ("BF16", ...), and back (nullopt when unknown).
std::string safetensors_dtype_name(at::ScalarType dtype);
std::optional<at::ScalarType> safetensors_dtype(const std::string& name);

}  // namespace zt
