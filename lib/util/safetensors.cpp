// safetensors: 8-byte little-endian header length, a JSON header, then the raw data.
#include "zerotrain/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
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
#include "zerotrain/error.hpp"

namespace zt {
namespace {

// Headers of real checkpoints are a few hundred KiB; anything near this is not a header.
constexpr uint64_t kMaxHeader = 100u << 20;

struct DtypeEntry {
  const char* name;
  at::ScalarType type;
};
const DtypeEntry kDtypes[] = {
    {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16}, {"F64", at::kDouble},
    {"I64", at::kLong},  {"I32", at::kInt},   {"I16", at::kShort},     {"I8", at::kChar},
    {"U8", at::kByte},   {"BOOL", at::kBool},
};

}  // namespace

std::string safetensors_dtype_name(at::ScalarType dtype) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.type == dtype) return e.name;
  }
  throw InvalidArgument(
      fmt::format("safetensors: dtype {} cannot be stored", c10::toString(dtype)));
}

std::optional<at::ScalarType> safetensors_dtype(const std::string& name) {
  for (const DtypeEntry& e : kDtypes) {
    if (name == e.name) return e.type;
  }
  return std::nullopt;
}

namespace {

constexpr int64_t kChecksumChunk = int64_t{16} << 20;  // bytes of a tensor's data per CRC

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

// The checksums of a tensor's chunks as recorded ("hhhhhhhh,hhhhhhhh,..."), nullopt when the
// text is not that.
std::optional<std::vector<uint32_t>> parse_checksums(const std::string& list, int64_t chunks) {
  if (static_cast<int64_t>(list.size()) != chunks * 9 - 1) return std::nullopt;
  std::vector<uint32_t> out;
  for (int64_t k = 0; k < chunks; ++k) {
    uint32_t v = 0;
    const char* first = list.data() + k * 9;
    const auto [p, ec] = std::from_chars(first, first + 8, v, 16);
    if (ec != std::errc() || p != first + 8 || (k + 1 < chunks && first[8] != ','))
      return std::nullopt;
    out.push_back(v);
  }
  return out;
}

int64_t checksum_chunks(const TensorInfo& info) {
  return std::max<int64_t>(1, (info.nbytes + kChecksumChunk - 1) / kChecksumChunk);
}

// One tensor's header entry, checked against the file's `data_size` bytes of data (which start
// at byte `data_start`). `bad` makes the error that names the tensor.
template <typename Bad>
TensorInfo parse_tensor_entry(const rapidjson::Value& v, int64_t data_start, int64_t data_size,
                              const Bad& bad) {
  if (!v.IsObject()) throw bad("entry is not an object");
  auto dt = v.FindMember("dtype");
  auto sh = v.FindMember("shape");
  auto off = v.FindMember("data_offsets");
  if (dt == v.MemberEnd() || !dt->value.IsString()) throw bad("missing dtype");
  if (sh == v.MemberEnd() || !sh->value.IsArray()) throw bad("missing shape");
  if (off == v.MemberEnd() || !off->value.IsArray() || off->value.Size() != 2) {
    throw bad("missing data_offsets");
  }
  TensorInfo info;
  info.dtype_name = dt->value.GetString();
  std::optional<at::ScalarType> type = safetensors_dtype(info.dtype_name);
  if (!type) {
    throw bad(
        fmt::format("dtype '{}' is not supported (supported: F32, F16, BF16, F64, I64, "
                    "I32, I16, I8, U8, BOOL)",
                    info.dtype_name));
  }
  info.dtype = *type;
  int64_t numel = 1;
  for (const rapidjson::Value& d : sh->value.GetArray()) {
    std::optional<int64_t> dim = d.IsNumber() ? json::as_integer(d) : std::nullopt;
    if (!dim || *dim < 0 || *dim > (int64_t{1} << 40)) throw bad("invalid shape");
    info.shape.push_back(*dim);
    if (*dim != 0 && numel > (int64_t{1} << 50) / *dim) throw bad("shape is too large");
    numel *= *dim;
  }
  info.numel = numel;
  auto offset = [](const rapidjson::Value& x) -> int64_t {  // -1 when not a count
    const std::optional<int64_t> n = x.IsNumber() ? json::as_integer(x) : std::nullopt;
    return n && *n >= 0 ? *n : -1;
  };
  const int64_t b = offset(off->value[0]), e = offset(off->value[1]);
  if (b < 0 || e < b) throw bad("invalid data_offsets");
  if (e > data_size) {
    throw bad(fmt::format("data ends at byte {} but the file holds only {} data bytes (truncated?)",
                          e, data_size));
  }
  const int64_t expected = numel * static_cast<int64_t>(c10::elementSize(info.dtype));
  if (e - b != expected) {
    throw bad(fmt::format("{} bytes of data for shape × dtype = {} bytes", e - b, expected));
  }
  info.begin = data_start + b;
  info.nbytes = expected;
  return info;
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  fd_ = files::open_regular(path, "safetensors file");  // a FIFO or device is refused, not read
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    ::close(fd_);
    throw IoError(fmt::format("cannot stat '{}': {}", path, std::strerror(errno)));
  }
  size_ = static_cast<size_t>(st.st_size);
  auto fail = [&](const std::string& what) -> IoError {
    return IoError(fmt::format("corrupt safetensors file '{}': {}", path, what));
  };
  if (size_ < 8) {
    ::close(fd_);
    throw fail(fmt::format("{} bytes, shorter than the 8-byte header length", size_));
  }
  if (size_ > 0) {
    map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
    if (map_ == MAP_FAILED) {
      map_ = nullptr;
      ::close(fd_);
      throw IoError(fmt::format("cannot map '{}': {}", path, std::strerror(errno)));
    }
  }
  try {
    const auto* bytes = static_cast<const unsigned char*>(map_);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
    if (n > kMaxHeader || n > size_ - 8) {
      throw fail(
          fmt::format("header length {} does not fit in the {} bytes of the file "
                      "(truncated download?)",
                      n, size_));
    }
    const char* header = reinterpret_cast<const char*>(bytes + 8);
    if (n == 0 || header[0] != '{') throw fail("the header is not a JSON object");
    rapidjson::Document doc;
    try {
      doc = json::parse(std::string_view(header, static_cast<size_t>(n)), "its header");
    } catch (const ConfigError& e) {
      throw fail(e.what());
    }
    if (!doc.IsObject()) throw fail("the header is not a JSON object");
    const int64_t data_start = 8 + static_cast<int64_t>(n);
    const int64_t data_size = static_cast<int64_t>(size_) - data_start;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    std::vector<std::string> range_names;
    for (auto it = doc.MemberBegin(); it != doc.MemberEnd(); ++it) {
      std::string name(it->name.GetString(), it->name.GetStringLength());
      const rapidjson::Value& v = it->value;
      if (name == "__metadata__") {
        if (!v.IsObject()) throw fail("__metadata__ is not an object");
        for (auto m = v.MemberBegin(); m != v.MemberEnd(); ++m) {
          if (!m->value.IsString()) throw fail("__metadata__ values must be strings");
          metadata_[m->name.GetString()] = m->value.GetString();
        }
        continue;
      }
      auto bad = [&](const std::string& what) {
        return fail(fmt::format("tensor '{}': {}", name, what));
      };
      if (tensors_.count(name)) throw bad("appears twice in the header");
      TensorInfo info = parse_tensor_entry(v, data_start, data_size, bad);
      const int64_t begin = info.begin - data_start;
      ranges.emplace_back(begin, begin + info.nbytes);
      range_names.push_back(name);
      tensors_.emplace(name, std::move(info));
      order_.push_back(name);
    }
    std::vector<size_t> idx(ranges.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return ranges[a] < ranges[b]; });
    for (size_t k = 1; k < idx.size(); ++k) {
      if (ranges[idx[k]].first < ranges[idx[k - 1]].second) {
        throw fail(fmt::format("tensors '{}' and '{}' overlap", range_names[idx[k - 1]],
                               range_names[idx[k]]));
      }
    }
    // Every tensor with checksums gets its flags now: reads then allocate nothing that stays.
    for (const auto& [key, list] : metadata_) {
      if (key.rfind("crc32c:", 0) != 0) continue;
      auto t = tensors_.find(key.substr(7));
      if (t == tensors_.end()) continue;
      if (!parse_checksums(list, checksum_chunks(t->second))) {
        throw fail(fmt::format("the checksums of tensor '{}' are unreadable", t->first));
      }
      verified_[t->first].assign(static_cast<size_t>(checksum_chunks(t->second)), false);
    }
  } catch (...) {
    if (map_ != nullptr) ::munmap(map_, size_);
    ::close(fd_);
    map_ = nullptr;
    fd_ = -1;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, size_);
  if (fd_ >= 0) ::close(fd_);
}

std::vector<std::string> SafetensorsFile::names() const {
  return order_;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    throw IoError(fmt::format("tensor '{}' is not in '{}'", name, path_));
  }
  return it->second;
}

at::Tensor SafetensorsFile::mapped(const TensorInfo& info, int64_t offset, int64_t count) const {
  // A read-only view of the mapping; it is only ever copied from.
  auto* base = static_cast<char*>(map_) + info.begin +
               offset * static_cast<int64_t>(c10::elementSize(info.dtype));
  return at::from_blob(base, {count}, at::TensorOptions().dtype(info.dtype));
}

void SafetensorsFile::verify(const std::string& name, const TensorInfo& info, int64_t begin,
                             int64_t end) const {
  std::lock_guard<std::mutex> lock(verified_mutex_);
  auto done = verified_.find(name);  // made at open for every tensor with checksums
  if (done == verified_.end()) return;
  const int64_t chunks = checksum_chunks(info);
  const int64_t first = begin / kChecksumChunk, last = std::max(first, (end - 1) / kChecksumChunk);
  for (int64_t k = first; k <= last && k < chunks; ++k) {
    if (done->second[static_cast<size_t>(k)]) continue;
    // Parsed again per chunk: nothing a read allocates outlives it (a small allocation kept
    // between a reader's large temporaries would pin them in the heap).
    const std::optional<std::vector<uint32_t>> crc =
        parse_checksums(metadata_.at("crc32c:" + name), chunks);
    const int64_t at = k * kChecksumChunk,
                  n = std::max<int64_t>(0, std::min(kChecksumChunk, info.nbytes - at));
    const auto* data = static_cast<const unsigned char*>(map_) + info.begin + at;
    if (!crc || crc32c::of(data, static_cast<size_t>(n)) != (*crc)[static_cast<size_t>(k)]) {
      throw IoError(fmt::format(
          "'{}' is damaged: tensor '{}' fails its checksum in bytes [{}, {}) of its data; "
          "restore the file from a copy (or resume from an earlier checkpoint)",
          path_, name, at, at + n));
    }
    done->second[static_cast<size_t>(k)] = true;
  }
}

at::Tensor SafetensorsFile::load(const std::string& name,
                                 std::optional<at::ScalarType> dtype) const {
  const TensorInfo& i = info(name);
  verify(name, i, 0, i.nbytes);
  at::Tensor flat = mapped(i, 0, i.numel);
  at::Tensor out = dtype && *dtype != i.dtype ? flat.to(*dtype) : flat.clone();
  return out.view(i.shape);
}

void SafetensorsFile::read_range(const std::string& name, int64_t offset,
                                 const at::Tensor& out) const {
  const TensorInfo& i = info(name);
  const int64_t count = out.numel();
  if (offset < 0 || offset + count > i.numel) {
    throw InvalidArgument(
        fmt::format("read_range: elements [{}, {}) are outside tensor '{}' of {} "
                    "elements in '{}'",
                    offset, offset + count, name, i.numel, path_));
  }
  const int64_t element = static_cast<int64_t>(c10::elementSize(i.dtype));
  verify(name, i, offset * element, (offset + count) * element);
  out.view({-1}).copy_(mapped(i, offset, count));
}

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& path) : path_(path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    open_[path] = std::make_unique<SafetensorsFile>(path);
    for (const std::string& n : open_[path]->names()) shard_of_[n] = path;
    return;
  }
  if (!fs::is_directory(path, ec)) {
    throw IoError(fmt::format("model weights '{}': no such file or folder", path));
  }
  const std::string index = (fs::path(path) / "model.safetensors.index.json").string();
  const std::string single = (fs::path(path) / "model.safetensors").string();
  if (fs::exists(index, ec)) {
    rapidjson::Document doc = json::parse(files::read_text(index, "safetensors index"), index);
    json::ObjectReader top(doc, "", index);
    std::optional<json::ObjectReader> map = top.object("weight_map");
    if (!map) throw IoError(fmt::format("'{}' has no weight_map", index));
    const rapidjson::Value* wm = top.find("weight_map");
    for (auto it = wm->MemberBegin(); it != wm->MemberEnd(); ++it) {
      if (!it->value.IsString()) {
        throw IoError(
            fmt::format("'{}': weight_map.{} is not a file name", index, it->name.GetString()));
      }
      // A shard is a plain name in this folder: never a path that leaves it.
      const std::string file =
          files::child(path, it->value.GetString(),
                       fmt::format("'{}': weight_map.{}", index, it->name.GetString()));
      if (!fs::exists(file, ec)) {
        throw IoError(fmt::format("'{}' lists '{}' for tensor '{}', but that file is missing",
                                  index, it->value.GetString(), it->name.GetString()));
      }
      shard_of_[it->name.GetString()] = file;
    }
  } else if (fs::exists(single, ec)) {
    open_[single] = std::make_unique<SafetensorsFile>(single);
    for (const std::string& n : open_[single]->names()) shard_of_[n] = single;
  } else {
    throw IoError(
        fmt::format("'{}' holds neither model.safetensors nor "
                    "model.safetensors.index.json (only safetensors weights are read; "
                    "convert .bin checkpoints first)",
                    path));
  }
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  for (const auto& kv : shard_of_) out.push_back(kv.first);
  return out;
}

bool SafetensorsCheckpoint::contains(const std::string& name) const {
  return shard_of_.count(name) != 0;
}

const SafetensorsFile& SafetensorsCheckpoint::file_of(const std::string& name) const {
  auto it = shard_of_.find(name);
  if (it == shard_of_.end()) {
    throw IoError(fmt::format("checkpoint '{}' has no tensor '{}'", path_, name));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  auto& slot = open_[it->second];
  if (!slot) slot = std::make_unique<SafetensorsFile>(it->second);
  if (!slot->contains(name)) {
    throw IoError(
        fmt::format("'{}' should hold tensor '{}' (per the index) but does not", it->second, name));
  }
  return *slot;
}

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
