// TensorBoard event files by hand: an Event message is a few protobuf fields (wall_time 1,
// step 2, file_version 3, summary 5 → value 1 → tag 1 / simple_value 2), each record framed as
// TFRecord (length, masked CRC-32C of the length, data, masked CRC-32C of the data).
#include "train/tensorboard.hpp"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>

#include <fmt/format.h>

#include "util/crc32c.hpp"
#include "zerotrain/error.hpp"

namespace zt::train {
namespace {

std::string host_name() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

template <typename T>
void put_fixed(std::string& out, T v) {  // little-endian, as protobuf's fixed32/fixed64
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}

void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | 2);  // length-delimited
  put_varint(out, bytes.size());
  out += bytes;
}

std::string event(double wall_time, int64_t step) {
  std::string e;
  put_varint(e, 1 << 3 | 1);  // wall_time: double
  put_fixed(e, wall_time);
  put_varint(e, 2 << 3 | 0);  // step: int64
  put_varint(e, static_cast<uint64_t>(step));
  return e;
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const double now = wall_seconds();
  path_ = fmt::format("{}/events.out.tfevents.{}.{}.{}.0", dir, static_cast<int64_t>(now),
                      host_name(), ::getpid());
  out_.open(path_, std::ios::binary | std::ios::app);
  if (!out_)
    throw IoError(
        fmt::format("cannot create TensorBoard event file '{}': {}", path_, std::strerror(errno)));
  std::string e = event(now, 0);
  put_bytes(e, 3, "brain.Event:2");
  record(e);
}

void TensorBoardWriter::scalar(const std::string& tag, double value, int64_t step) {
  std::string v;
  put_bytes(v, 1, tag);
  put_varint(v, 2 << 3 | 5);  // simple_value: float
  put_fixed(v, static_cast<float>(value));
  std::string summary;
  put_bytes(summary, 1, v);
  std::string e = event(wall_seconds(), step);
  put_bytes(e, 5, summary);
  record(e);
}

void TensorBoardWriter::record(const std::string& data) {
  std::string framed;
  const uint64_t length = data.size();
  put_fixed(framed, length);
  put_fixed(framed, crc32c::masked(crc32c::of(framed.data(), 8)));
  framed += data;
  put_fixed(framed, crc32c::masked(crc32c::of(data.data(), data.size())));
  out_.write(framed.data(), static_cast<std::streamsize>(framed.size()));
  out_.flush();
  if (!out_) throw IoError(fmt::format("cannot write TensorBoard event file '{}'", path_));
}

std::string default_logging_dir(const std::string& output_dir) {
  const std::time_t t = std::time(nullptr);
  std::tm local{};
  ::localtime_r(&t, &local);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%b%d_%H-%M-%S", &local);
  return fmt::format("{}/runs/{}_{}", output_dir, stamp, host_name());
}

}  // namespace zt::train
