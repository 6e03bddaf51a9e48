// TensorBoard event files: CRC-32C against its published check value, and the records read back
// as TensorBoard reads them (TFRecord framing with masked CRCs, Event protobufs). The GPU
// session also reads them with the tensorboard package (tests/tools/check_tensorboard.py).
#include "support/catch.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "support/ranks.hpp"
#include "train/tensorboard.hpp"
#include "util/crc32c.hpp"

using namespace zt;

namespace {

struct Scalar {
  std::string tag;
  float value = 0;
  int64_t step = 0;
};

uint64_t varint(const std::string& s, size_t& at) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    const auto b = static_cast<unsigned char>(s.at(at++));
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return v;
  }
}

// Field number → (wire type, payload) of one protobuf message, in order.
std::vector<std::tuple<int, int, std::string>> fields(const std::string& m) {
  std::vector<std::tuple<int, int, std::string>> out;
  size_t at = 0;
  while (at < m.size()) {
    const uint64_t key = varint(m, at);
    const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
    std::string payload;
    if (wire == 0) {
      payload = std::to_string(varint(m, at));
    } else if (wire == 1) {
      payload = m.substr(at, 8), at += 8;
    } else if (wire == 5) {
      payload = m.substr(at, 4), at += 4;
    } else {
      REQUIRE(wire == 2);
      const uint64_t n = varint(m, at);
      payload = m.substr(at, n), at += n;
    }
    out.emplace_back(field, wire, payload);
  }
  return out;
}

// Every record of an event file, each checked against its masked CRCs.
std::vector<std::string> records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> out;
  size_t at = 0;
  while (at < data.size()) {
    REQUIRE(at + 12 <= data.size());
    uint64_t length = 0;
    uint32_t length_crc = 0, data_crc = 0;
    std::memcpy(&length, data.data() + at, 8);
    std::memcpy(&length_crc, data.data() + at + 8, 4);
    CHECK(length_crc == crc32c::masked(crc32c::of(data.data() + at, 8)));
    REQUIRE(at + 12 + length + 4 <= data.size());
    const std::string record = data.substr(at + 12, length);
    std::memcpy(&data_crc, data.data() + at + 12 + length, 4);
    CHECK(data_crc == crc32c::masked(crc32c::of(record.data(), record.size())));
    out.push_back(record);
    at += 12 + length + 4;
  }
  return out;
}

}  // namespace

TEST_CASE("CRC-32C gives its check value and extends across calls", "[tensorboard]") {
  const char* text = "123456789";
  CHECK(crc32c::of(text, 9) == 0xE3069283u);  // the Castagnoli CRC's catalogued check value
  CHECK(crc32c::extend(crc32c::of(text, 4), text + 4, 5) == 0xE3069283u);
  std::string zeros(32, '\0');
  CHECK(crc32c::of(zeros.data(), zeros.size()) == 0x8A9136AAu);  // RFC 3720, 32 zero bytes
}

TEST_CASE("event files hold a version record, then one scalar event per call", "[tensorboard]") {
  const std::string dir = test::temp_dir("tb") + "/runs/x";
  std::string path;
  {
    train::TensorBoardWriter w(dir);
    path = w.path();
    w.scalar("train/loss", 2.5, 10);
    w.scalar("eval/loss", 1.25, 20);
  }
  CHECK(std::filesystem::path(path).filename().string().rfind("events.out.tfevents.", 0) == 0);
  const auto rs = records(path);
  REQUIRE(rs.size() == 3);
  auto version = fields(rs[0]);
  REQUIRE(version.size() == 3);
  CHECK(std::get<0>(version[2]) == 3);
  CHECK(std::get<2>(version[2]) == "brain.Event:2");
  std::vector<Scalar> scalars;
  for (size_t r = 1; r < rs.size(); ++r) {
    Scalar s;
    for (const auto& [field, wire, payload] : fields(rs[r])) {
      if (field == 2) s.step = std::stoll(payload);
      if (field != 5) continue;
      for (const auto& [vf, vw, value] : fields(payload)) {  // Summary.value
        REQUIRE(vf == 1);
        for (const auto& [f2, w2, p2] : fields(value)) {
          if (f2 == 1) s.tag = p2;
          if (f2 == 2) std::memcpy(&s.value, p2.data(), 4);
        }
      }
    }
    scalars.push_back(s);
  }
  CHECK(scalars[0].tag == "train/loss");
  CHECK(scalars[0].value == 2.5f);
  CHECK(scalars[0].step == 10);
  CHECK(scalars[1].tag == "eval/loss");
  CHECK(scalars[1].value == 1.25f);
  CHECK(scalars[1].step == 20);
  CHECK_THAT(train::default_logging_dir("/o"), Catch::Contains("/o/runs/"));
}
