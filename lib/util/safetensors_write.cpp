// Writing safetensors files: whole files, and shards streamed tensor by tensor with their
// index, each file under a temporary name until complete.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include "util/crc32c.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "util/safetensors_format.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/safetensors.hpp"

namespace zt {
namespace {

std::string chunk_checksums(const void* data, int64_t nbytes) {
  std::string out;
  const auto* p = static_cast<const unsigned char*>(data);
  for (int64_t at = 0; at < nbytes || (at == 0 && nbytes == 0); at += kChecksumChunk) {
    const int64_t n = std::min(kChecksumChunk, nbytes - at);
    out +=
        fmt::format("{}{:08x}", out.empty() ? "" : ",", crc32c::of(p + at, static_cast<size_t>(n)));
    if (nbytes == 0) break;
  }
  return out;
}

}  // namespace

namespace {

std::string header_json(const std::vector<TensorEntry>& entries,
                        const std::map<std::string, std::string>& metadata) {
  rapidjson::StringBuffer buffer;
  rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
  w.StartObject();
  if (!metadata.empty()) {
    w.Key("__metadata__");
    w.StartObject();
    for (const auto& kv : metadata) {
      w.Key(kv.first.c_str());
      w.String(kv.second.c_str());
    }
    w.EndObject();
  }
  int64_t offset = 0;
  for (const TensorEntry& e : entries) {
    w.Key(e.name.c_str());
    w.StartObject();
    w.Key("dtype");
    w.String(safetensors_dtype_name(e.dtype).c_str());
    w.Key("shape");
    w.StartArray();
    for (int64_t d : e.shape) w.Int64(d);
    w.EndArray();
    w.Key("data_offsets");
    w.StartArray();
    w.Int64(offset);
    w.Int64(offset + e.nbytes());
    w.EndArray();
    w.EndObject();
    offset += e.nbytes();
  }
  w.EndObject();
  std::string h = buffer.GetString();
  h.append((8 - h.size() % 8) % 8, ' ');  // data starts 8-byte aligned, as HF writes it
  return h;
}

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = ::write(fd, p, n);
    if (k < 0) {
      if (errno == EINTR) continue;
      throw IoError(fmt::format("cannot write '{}': {}", path, std::strerror(errno)));
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
}

std::vector<TensorEntry> entries_of(
    const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<TensorEntry> out;
  for (const auto& [name, t] : tensors)
    out.push_back(TensorEntry{name, t.scalar_type(), t.sizes().vec()});
  return out;
}

}  // namespace

int64_t TensorEntry::nbytes() const {
  int64_t n = static_cast<int64_t>(c10::elementSize(dtype));
  for (int64_t d : shape) n *= d;
  return n;
}

// One file being written under a temporary name: header first, then each tensor's bytes.
class SafetensorsStreamWriter::File {
 public:
  File(std::string path, std::vector<TensorEntry> entries,
       const std::map<std::string, std::string>& metadata)
      : path_(std::move(path)),
        tmp_(fmt::format("{}.tmp.{}", path_, static_cast<long>(::getpid()))),
        entries_(std::move(entries)) {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw IoError(fmt::format("cannot create '{}': {}", tmp_, std::strerror(errno)));
    const std::string header = header_json(entries_, metadata);
    unsigned char len[8];
    const uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
    write_all(fd_, len, 8, tmp_);
    write_all(fd_, header.data(), header.size(), tmp_);
  }
  ~File() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(tmp_.c_str());
    }
  }
  bool full() const { return next_ == entries_.size(); }
  const TensorEntry& next() const { return entries_[next_]; }
  const std::string& path() const { return path_; }
  const std::vector<TensorEntry>& entries() const { return entries_; }

  void write(const at::Tensor& value) {
    const TensorEntry& e = entries_[next_];
    if (value.sizes().vec() != e.shape) {
      throw InvalidArgument(fmt::format("writing '{}' into '{}': shape [{}] but [{}] was planned",
                                        e.name, path_, fmt::join(value.sizes(), ", "),
                                        fmt::join(e.shape, ", ")));
    }
    at::Tensor c = value.detach().to(at::kCPU, e.dtype).contiguous();
    write_all(fd_, c.data_ptr(), static_cast<size_t>(e.nbytes()), tmp_);
    ++next_;
  }

  void commit() {
    if (::fsync(fd_) != 0)
      throw IoError(fmt::format("cannot flush '{}': {}", tmp_, std::strerror(errno)));
    ::close(fd_);
    fd_ = -1;
    if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
      const int err = errno;
      ::unlink(tmp_.c_str());
      throw IoError(fmt::format("cannot rename '{}' to '{}': {}", tmp_, path_, std::strerror(err)));
    }
  }

 private:
  std::string path_, tmp_;
  std::vector<TensorEntry> entries_;
  size_t next_ = 0;
  int fd_ = -1;
};

SafetensorsStreamWriter::SafetensorsStreamWriter(const std::string& dir,
                                                 std::vector<TensorEntry> plan,
                                                 int64_t max_shard_bytes, const std::string& prefix)
    : dir_(dir), prefix_(prefix) {
  int64_t filled = 0;
  for (TensorEntry& e : plan) {
    if (shards_.empty() || (!shards_.back().empty() && filled + e.nbytes() > max_shard_bytes)) {
      shards_.emplace_back();
      filled = 0;
    }
    filled += e.nbytes();
    total_bytes_ += e.nbytes();
    shards_.back().push_back(std::move(e));
  }
  if (shards_.empty()) shards_.emplace_back();
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() = default;

std::string SafetensorsStreamWriter::shard_name(size_t k) const {
  return shards_.size() == 1
             ? prefix_ + ".safetensors"
             : fmt::format("{}-{:05d}-of-{:05d}.safetensors", prefix_, k + 1, shards_.size());
}

void SafetensorsStreamWriter::write(const std::string& name, const at::Tensor& value) {
  while (!file_ || file_->full()) {
    if (file_) {
      file_->commit();
      written_.push_back(file_->path());
    }
    if (shard_ == shards_.size()) {
      throw InvalidArgument(
          fmt::format("writing '{}' into '{}': every planned tensor was written", name, dir_));
    }
    file_ = std::make_unique<File>((std::filesystem::path(dir_) / shard_name(shard_)).string(),
                                   shards_[shard_],
                                   std::map<std::string, std::string>{{"format", "pt"}});
    ++shard_;
  }
  if (file_->next().name != name) {
    throw InvalidArgument(fmt::format("writing '{}' into '{}': '{}' comes next in the plan", name,
                                      dir_, file_->next().name));
  }
  file_->write(value);
}

std::vector<std::string> SafetensorsStreamWriter::finish() {
  // Shards with nothing left to write (an empty plan) are created here too.
  while (shard_ < shards_.size() || file_) {
    if (file_) {
      if (!file_->full()) {
        throw InvalidArgument(
            fmt::format("'{}': '{}' was never written", dir_, file_->next().name));
      }
      file_->commit();
      written_.push_back(file_->path());
      file_.reset();
    }
    if (shard_ < shards_.size()) {
      file_ = std::make_unique<File>((std::filesystem::path(dir_) / shard_name(shard_)).string(),
                                     shards_[shard_],
                                     std::map<std::string, std::string>{{"format", "pt"}});
      ++shard_;
    }
  }
  if (shards_.size() > 1) {
    rapidjson::StringBuffer buffer;
    rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
    w.StartObject();
    w.Key("metadata");
    w.StartObject();
    w.Key("total_size");
    w.Int64(total_bytes_);
    w.EndObject();
    w.Key("weight_map");
    w.StartObject();
    for (size_t k = 0; k < shards_.size(); ++k) {
      for (const TensorEntry& e : shards_[k]) {
        w.Key(e.name.c_str());
        w.String(shard_name(k).c_str());
      }
    }
    w.EndObject();
    w.EndObject();
    const std::string index =
        (std::filesystem::path(dir_) / (prefix_ + ".safetensors.index.json")).string();
    files::write_atomic(index, buffer.GetString());
    written_.push_back(index);
  }
  return written_;
}

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // The bytes as they will be written, checksummed first: the header (with the checksums)
  // precedes the data.
  std::vector<at::Tensor> bytes;
  std::map<std::string, std::string> with_checksums = metadata;
  for (const auto& [name, t] : tensors) {
    bytes.push_back(t.detach().to(at::kCPU).contiguous());
    with_checksums["crc32c:" + name] =
        chunk_checksums(bytes.back().data_ptr(), static_cast<int64_t>(bytes.back().nbytes()));
  }
  SafetensorsStreamWriter::File file(path, entries_of(tensors), with_checksums);
  for (const at::Tensor& t : bytes) file.write(t);
  file.commit();
}

std::vector<std::string> save_sharded_safetensors(
    const std::string& dir, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
    int64_t max_shard_bytes, const std::string& prefix) {
  SafetensorsStreamWriter writer(dir, entries_of(tensors), max_shard_bytes, prefix);
  for (const auto& [name, t] : tensors) writer.write(name, t);
  return writer.finish();
}

}  // namespace zt
