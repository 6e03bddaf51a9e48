// safetensors: 8-byte little-endian header length, a JSON header, then the raw data. Reading
// (files and folders of shards); writing is in safetensors_write.cpp.
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
#include "util/safetensors_format.hpp"
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
  info.dtype_name = json::text(dt->value);
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
          metadata_[json::text(m->name)] = json::text(m->value);
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
            fmt::format("'{}': weight_map.{} is not a file name", index, json::text(it->name)));
      }
      // A shard is a plain name in this folder: never a path that leaves it.
      const std::string file =
          files::child(path, json::text(it->value),
                       fmt::format("'{}': weight_map.{}", index, json::text(it->name)));
      if (!fs::exists(file, ec)) {
        throw IoError(fmt::format("'{}' lists '{}' for tensor '{}', but that file is missing",
                                  index, json::text(it->value), json::text(it->name)));
      }
      shard_of_[json::text(it->name)] = file;
    }
  } else if (fs::exists(single, ec)) {
    open_[single] = std::make_unique<SafetensorsFile>(single);
    for (const std::string& n : open_[single]->names()) shard_of_[n] = single;
  } else if (fs::exists(fs::path(path) / "pytorch_model.bin", ec) ||
             fs::exists(fs::path(path) / "pytorch_model.bin.index.json", ec)) {
    // Pickle files can run code when loaded: zerotrain never unpickles them.
    throw IoError(fmt::format(
        "'{}' holds pytorch_model*.bin weights (Python pickle), which zerotrain does not load; "
        "convert them once to safetensors, e.g. python3 -c \"import glob, torch, "
        "safetensors.torch as st; [st.save_file({{k: v.contiguous() for k, v in torch.load(f, "
        "map_location='cpu', weights_only=True).items()}}, f.replace('pytorch_model', "
        "'model').replace('.bin', '.safetensors')) for f in glob.glob('{}/pytorch_model*.bin')]\" "
        "(a sharded folder also needs its index renamed to model.safetensors.index.json with "
        "the same file renames)",
        path, path));
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

}  // namespace zt
