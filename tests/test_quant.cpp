// The blockwise quantizer against bitsandbytes' algorithm as tests/tools/bnb_reference.py writes
// it from bitsandbytes' source: every threshold of the NF4 and FP4 trees and of the 8-bit
// dynamic search with its fp32 neighbours, partial and all-zero blocks, bf16 / fp16 inputs,
// double quantization (tests/fixtures/quant/bnb_vectors.json).
#include <rapidjson/document.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "quant/blockwise.hpp"
#include "support/catch.hpp"
#include "zerotrain/error.hpp"

namespace {

using zt::quant::FourBit;

rapidjson::Document read_fixture(const std::string& rel) {
  std::ifstream in(std::string(ZT_FIXTURES) + "/" + rel);
  std::stringstream text;
  text << in.rdbuf();
  rapidjson::Document d;
  d.Parse(text.str().c_str());
  REQUIRE(!d.HasParseError());
  return d;
}

const rapidjson::Document& vectors() {
  static const rapidjson::Document doc = read_fixture("quant/bnb_vectors.json");
  return doc;
}

template <typename T>
std::vector<T> numbers(const rapidjson::Value& v) {
  std::vector<T> out;
  for (const auto& x : v.GetArray()) out.push_back(static_cast<T>(x.GetUint()));
  return out;
}

at::Tensor from_bits(const rapidjson::Value& v, at::ScalarType dtype) {
  if (dtype == at::kFloat) {
    std::vector<uint32_t> b = numbers<uint32_t>(v);
    return at::from_blob(b.data(), {static_cast<int64_t>(b.size())}, at::kInt)
        .clone()
        .view(at::kFloat);
  }
  std::vector<int16_t> b;
  for (const auto& x : v.GetArray()) b.push_back(static_cast<int16_t>(x.GetUint()));
  return at::from_blob(b.data(), {static_cast<int64_t>(b.size())}, at::kShort).clone().view(dtype);
}

std::vector<uint8_t> from_hex(const std::string& hex) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<uint8_t>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

// Bit patterns, so that −0 and +0 (and NaN payloads) count as different.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.numel() != b.numel()) return false;
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

int64_t differing(const at::Tensor& a, const at::Tensor& b) {
  return a.ne(b).sum().item<int64_t>();
}

}  // namespace

TEST_CASE("4-bit blocks: codes, absmax and dequantized values equal bitsandbytes' algorithm",
          "[quant]") {
  const rapidjson::Document& d = vectors();
  int cases = 0;
  for (const auto& c : d["four_bit"].GetArray()) {
    const std::string name = c["name"].GetString();
    INFO(name);
    const FourBit type = *zt::quant::parse_four_bit(c["quant_type"].GetString());
    const int64_t blocksize = c["blocksize"].GetInt64();
    const std::string dt = c["dtype"].GetString();
    const at::ScalarType dtype = dt == "fp32"   ? at::kFloat
                                 : dt == "bf16" ? at::kBFloat16
                                                : at::kHalf;
    const at::Tensor x = from_bits(c["input_bits"], dtype);
    const zt::quant::FourBitBlocks q = zt::quant::quantize_4bit(x, type, blocksize);

    std::vector<uint8_t> packed = from_hex(c["packed"].GetString());
    const at::Tensor want_packed =
        at::from_blob(packed.data(), {static_cast<int64_t>(packed.size())}, at::kByte).clone();
    const at::Tensor want_absmax = from_bits(c["absmax_bits"], at::kFloat);
    CHECK(differing(q.packed, want_packed) == 0);
    CHECK(same_bits(q.absmax, want_absmax));

    const at::Tensor back =
        zt::quant::dequantize_4bit(q.packed, q.absmax, type, blocksize, x.numel(), at::kFloat);
    CHECK(same_bits(back, from_bits(c["dequantized_fp32_bits"], at::kFloat)));
    const at::Tensor back16 =
        zt::quant::dequantize_4bit(q.packed, q.absmax, type, blocksize, x.numel(), at::kBFloat16);
    CHECK(same_bits(back16, from_bits(c["dequantized_bf16_bits"], at::kBFloat16)));
    ++cases;
  }
  CHECK(cases >= 14);
}

TEST_CASE("4-bit code tables: quant_map as bitsandbytes stores it, dequantization values",
          "[quant]") {
  const rapidjson::Document& d = vectors();
  CHECK(same_bits(zt::quant::quant_map(FourBit::nf4),
                  from_bits(d["nf4_quant_map_bits"], at::kFloat)));
  CHECK(same_bits(zt::quant::quant_map(FourBit::fp4),
                  from_bits(d["fp4_quant_map_bits"], at::kFloat)));
  // Every code quantizes back to itself from its own value (the trees and tables agree), but
  // FP4's −0, which is +0's value and code.
  for (FourBit type : {FourBit::nf4, FourBit::fp4}) {
    const auto& values = zt::quant::code_values(type);
    for (int c = 0; c < 16; ++c) {
      if (type == FourBit::fp4 && c == 8) continue;
      CHECK(zt::quant::quantize_scaled(type, values[static_cast<size_t>(c)]) == c);
    }
  }
}

TEST_CASE("8-bit dynamic map and codes equal bitsandbytes' create_dynamic_map and dQuantize",
          "[quant]") {
  const rapidjson::Document& d = vectors();
  const at::Tensor map = zt::quant::dynamic_map();
  REQUIRE(same_bits(map, from_bits(d["dynamic_map_bits"], at::kFloat)));
  // And what torch itself computed on the GPU machine (bitsandbytes builds the map with torch).
  const rapidjson::Document torch_map = read_fixture("quant/torch_dynamic_map.json");
  CHECK(same_bits(map, from_bits(torch_map["dynamic_map_bits"], at::kFloat)));

  const auto& e = d["eight_bit"];
  const at::Tensor x = from_bits(e["input_bits"], at::kFloat);
  const zt::quant::EightBitBlocks q = zt::quant::quantize_8bit(x, map, e["blocksize"].GetInt64());
  std::vector<uint8_t> codes = numbers<uint8_t>(e["codes"]);
  CHECK(differing(q.codes, at::from_blob(codes.data(), {static_cast<int64_t>(codes.size())},
                                         at::kByte)) == 0);
  CHECK(same_bits(q.absmax, from_bits(e["absmax_bits"], at::kFloat)));
  CHECK(same_bits(zt::quant::dequantize_8bit(q.codes, q.absmax, map, e["blocksize"].GetInt64()),
                  from_bits(e["dequantized_bits"], at::kFloat)));
}

TEST_CASE("double quantization: the absmax in 8-bit codes around their mean, and back", "[quant]") {
  const auto& dq = vectors()["double_quant"];
  const at::Tensor absmax = from_bits(dq["absmax_bits"], at::kFloat);
  const zt::quant::DoubleQuantized q = zt::quant::double_quantize(absmax);
  // The offset is a mean, whose summation order is the library's own: equal to a few ulp.
  float want_offset;
  const uint32_t ob = dq["offset_bits"].GetUint();
  std::memcpy(&want_offset, &ob, 4);
  CHECK(std::abs(q.offset - want_offset) <= 4 * std::abs(want_offset) * 1.2e-7f);

  // With the reference's offset, the nested codes and scales are bit-exact.
  zt::quant::DoubleQuantized given = q;
  given.offset = want_offset;
  const zt::quant::EightBitBlocks nested = zt::quant::quantize_8bit(
      absmax - want_offset, zt::quant::dynamic_map(), zt::quant::kNestedBlocksize);
  std::vector<uint8_t> codes = numbers<uint8_t>(dq["codes"]);
  CHECK(differing(nested.codes, at::from_blob(codes.data(), {static_cast<int64_t>(codes.size())},
                                              at::kByte)) == 0);
  CHECK(same_bits(nested.absmax, from_bits(dq["nested_absmax_bits"], at::kFloat)));
  given.codes = nested.codes;
  given.nested_absmax = nested.absmax;
  CHECK(same_bits(zt::quant::double_dequantize(given),
                  from_bits(dq["absmax_back_bits"], at::kFloat)));
  // Back to within the 8-bit code's resolution of the original.
  CHECK((zt::quant::double_dequantize(q) - absmax).abs().max().item<float>() <
        0.01f * absmax.abs().max().item<float>());
}

TEST_CASE("quantization refuses sizes, types and block sizes that do not fit", "[quant]") {
  const at::Tensor x = at::randn({100});
  CHECK_THROWS_AS(zt::quant::quantize_4bit(x, FourBit::nf4, 48), zt::InvalidArgument);
  CHECK_THROWS_AS(zt::quant::quantize_4bit(x, FourBit::nf4, 8192), zt::InvalidArgument);
  CHECK_THROWS_AS(zt::quant::quantize_4bit(x.to(at::kDouble), FourBit::nf4, 64),
                  zt::InvalidArgument);
  const zt::quant::FourBitBlocks q = zt::quant::quantize_4bit(x, FourBit::nf4, 64);
  // One element more or less than the codes hold, or a block's scale missing.
  CHECK_THROWS_AS(zt::quant::dequantize_4bit(q.packed, q.absmax, FourBit::nf4, 64, 102, at::kFloat),
                  zt::InvalidArgument);
  CHECK_THROWS_AS(zt::quant::dequantize_4bit(q.packed, q.absmax.narrow(0, 0, 1), FourBit::nf4, 64,
                                             100, at::kFloat),
                  zt::InvalidArgument);
  CHECK_THROWS_AS(zt::quant::dequantize_4bit(q.packed.to(at::kInt), q.absmax, FourBit::nf4, 64, 100,
                                             at::kFloat),
                  zt::InvalidArgument);
  CHECK_NOTHROW(zt::quant::dequantize_4bit(q.packed, q.absmax, FourBit::nf4, 64, 99, at::kFloat));
  CHECK(!zt::quant::parse_four_bit("int4"));
}
