// safetensors reading and writing: fixtures written by transformers, round trips, sharding, and
// a fuzz-style pass over truncated and mutated files (errors, never crashes).
#include "support/catch.hpp"

#include <filesystem>
#include <fstream>
#include <random>

#include "support/ranks.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/safetensors.hpp"

using namespace zt;
using Catch::Contains;

namespace {

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace

TEST_CASE("safetensors written by transformers are read, single and sharded", "[safetensors]") {
  SafetensorsCheckpoint single(fixture("models/qwen2"));
  SafetensorsCheckpoint sharded(fixture("models/qwen2_sharded"));
  CHECK(single.names() == sharded.names());
  CHECK(single.names().size() > 10);
  for (const std::string& name : single.names()) {
    INFO(name);
    CHECK(at::equal(single.load(name), sharded.load(name)));
    CHECK(single.info(name).dtype == at::kFloat);
  }
  const TensorInfo& q = single.info("model.layers.0.self_attn.q_proj.weight");
  CHECK(q.shape == std::vector<int64_t>({64, 64}));
  CHECK(single.info("model.layers.0.self_attn.q_proj.bias").shape == std::vector<int64_t>({64}));
}

TEST_CASE("bf16 safetensors convert exactly", "[safetensors]") {
  SafetensorsFile f32(fixture("models/llama/model.safetensors"));
  SafetensorsFile b16(fixture("models/llama/model_bf16.safetensors"));
  for (const std::string& name : f32.names()) {
    INFO(name);
    CHECK(b16.info(name).dtype == at::kBFloat16);
    CHECK(at::equal(b16.load(name), f32.load(name).to(at::kBFloat16)));
    CHECK(at::equal(b16.load(name, at::kFloat), f32.load(name).to(at::kBFloat16).to(at::kFloat)));
  }
  CHECK(b16.metadata().at("format") == "pt");
}

TEST_CASE("read_range reads any slice of a flattened tensor", "[safetensors]") {
  SafetensorsFile f(fixture("models/llama/model.safetensors"));
  const std::string name = "model.layers.1.mlp.down_proj.weight";
  at::Tensor all = f.load(name).reshape({-1});
  at::Tensor part = at::empty({101}, at::kDouble);
  f.read_range(name, 333, part);
  CHECK(at::equal(part, all.narrow(0, 333, 101).to(at::kDouble)));
  CHECK_THROWS_AS(f.read_range(name, all.numel() - 5, part), InvalidArgument);
  CHECK_THROWS_WITH(f.info("nope"), Contains("nope") && Contains("model.safetensors"));
}

TEST_CASE("save and load round-trip every dtype, and sharding writes an index", "[safetensors]") {
  std::string dir = test::temp_dir("st");
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"a.f32", at::randn({3, 5})},
      {"b.bf16", at::randn({7}).to(at::kBFloat16)},
      {"c.f16", at::randn({2, 2, 2}).to(at::kHalf)},
      {"d.i64", at::arange(10, at::kLong)},
      {"e.bool", at::rand({4}) > 0.5},
      {"f.empty", at::empty({0, 3})},
      {"g.scalar", at::tensor(3.5)},
  };
  save_safetensors(dir + "/one.safetensors", tensors, {{"format", "pt"}, {"by", "zerotrain"}});
  SafetensorsFile f(dir + "/one.safetensors");
  CHECK(f.names().size() == tensors.size());
  CHECK(f.metadata().at("by") == "zerotrain");
  for (const auto& [name, t] : tensors) {
    INFO(name);
    CHECK(at::equal(f.load(name), t));
  }
  // 5 GB in real use; tiny here to force several shards.
  auto files = save_sharded_safetensors(dir, tensors, 64, "model");
  CHECK(files.size() > 2);
  CHECK(std::filesystem::exists(dir + "/model.safetensors.index.json"));
  SafetensorsCheckpoint ckpt(dir);
  for (const auto& [name, t] : tensors) CHECK(at::equal(ckpt.load(name), t));
  // Small enough for one file: no index.
  std::string dir2 = test::temp_dir("st");
  CHECK(save_sharded_safetensors(dir2, tensors).size() == 1);
  CHECK(std::filesystem::exists(dir2 + "/model.safetensors"));
}

TEST_CASE("missing files and folders are IoErrors naming them", "[safetensors][errors]") {
  CHECK_THROWS_WITH(SafetensorsFile("/nonexistent/x.safetensors"),
                    Contains("/nonexistent/x.safetensors"));
  std::string dir = test::temp_dir("st");
  CHECK_THROWS_WITH(SafetensorsCheckpoint(dir), Contains("neither model.safetensors"));
  // An index that points at a missing shard.
  spit(dir + "/model.safetensors.index.json",
       R"({"weight_map": {"w": "model-00001-of-00002.safetensors"}})");
  CHECK_THROWS_WITH(SafetensorsCheckpoint(dir),
                    Contains("model-00001-of-00002.safetensors") && Contains("'w'"));
}

TEST_CASE("truncated and mutated safetensors never crash: IoError or a valid read",
          "[safetensors][fuzz]") {
  const std::string good = slurp(fixture("models/llama/model.safetensors"));
  std::string dir = test::temp_dir("fuzz");
  const std::string path = dir + "/f.safetensors";
  int errors = 0, valid = 0;
  auto attempt = [&](const std::string& bytes) {
    spit(path, bytes);
    try {
      SafetensorsFile f(path);
      for (const std::string& n : f.names()) (void)f.load(n).sum();  // must stay in bounds
      ++valid;
    } catch (const IoError& e) {
      ++errors;
      CHECK_THAT(e.what(), Contains(path));
    }
  };
  // Truncations: inside the length field, the header, and the data.
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(good[i]);
  for (size_t cut :
       {size_t{0}, size_t{3}, size_t{8}, size_t{9}, size_t{8 + header_len / 2},
        size_t{8 + header_len}, size_t{8 + header_len + 1}, good.size() / 2, good.size() - 1}) {
    attempt(good.substr(0, cut));
  }
  // Random byte flips in the length field and header (seeded).
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 400; ++trial) {
    std::string bytes = good;
    const size_t span = static_cast<size_t>(8 + header_len);
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      size_t at = rng() % span;
      bytes[at] = static_cast<char>(rng() % 256);
    }
    attempt(bytes);
  }
  // Hand-made malformed headers.
  auto with_header = [](const std::string& json, size_t data_bytes) {
    std::string out(8, '\0');
    uint64_t n = json.size();
    for (int i = 0; i < 8; ++i)
      out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
    return out + json + std::string(data_bytes, '\0');
  };
  attempt(with_header(R"({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}})", 16));
  attempt(with_header(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "u": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                      16));
  attempt(with_header(R"({"t": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})", 8));
  attempt(with_header(R"({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}})", 8));
  attempt(with_header(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 800]}})", 8));
  attempt(with_header(
      R"({"t": {"dtype": "F32", "shape": [99999999999, 99999999999], "data_offsets": [0, 8]}})",
      8));
  attempt(with_header(R"({"t": 5})", 8));
  attempt(with_header(R"([1, 2])", 8));
  attempt(with_header(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)", 8));
  attempt(std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}");
  INFO("errors " << errors << ", valid " << valid);
  CHECK(errors >= 9 + 10);  // every truncation and hand-made header, and many mutations
}
