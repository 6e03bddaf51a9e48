// Tokenizer throughput: encodes a JSONL corpus ({"text": ...} lines) with HF tokenizer.json
// tokenizers and prints one `RESULT {json}` line per tokenizer.
//
//   zt_bench_tokenizer [--corpus PATH] [--mb 100] [--threads N] [--tokenizer DIR]...
//
// Without --corpus, a deterministic corpus of --mb MB is generated under the temp dir (kept for
// later runs): English-like prose and Chinese with Zipf-distributed vocabularies (so the
// pre-token cache sees a long tail, as with real text), Python / C++ code, numbers and dates.
// Without --tokenizer, the four fixture tokenizers (Qwen2, LLaMA-3, LLaMA-2, Mistral
// pipelines) are measured. Each of N threads encodes its own share of the lines with the one
// shared tokenizer; MB/s counts the JSONL bytes (reading and JSON parsing included), and
// encode_mb_per_s only the text given to encode.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include "zerotrain/tokenizer.hpp"

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

// Samples 0..n-1 with probability ∝ 1/(k+1)^s.
class Zipf {
 public:
  Zipf(size_t n, double s) : cdf_(n) {
    double sum = 0;
    for (size_t k = 0; k < n; ++k) cdf_[k] = (sum += 1.0 / std::pow(double(k + 1), s));
    for (double& c : cdf_) c /= sum;
  }
  size_t operator()(std::mt19937_64& rng) const {
    const double u = std::uniform_real_distribution<double>(0, 1)(rng);
    return std::min(cdf_.size() - 1,
                    size_t(std::lower_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin()));
  }

 private:
  std::vector<double> cdf_;
};

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

class CorpusWriter {
 public:
  CorpusWriter() : rng_(20261129), word_rank_(60000, 1.07), hanzi_rank_(3500, 1.0) {
    // English-like words from syllables: 60k distinct, the frequent ones short.
    static const char* const kSyllables[] = {
        "the",  "an",   "ing", "er",  "ed",  "re",  "in",  "on", "at", "es", "or", "ti",
        "al",   "ar",   "st",  "to",  "nt",  "ng",  "se",  "ha", "as", "ou", "io", "le",
        "is",   "it",   "en",  "co",  "de",  "ra",  "ri",  "ro", "li", "la", "ma", "me",
        "mo",   "ne",   "no",  "pa",  "pe",  "po",  "sa",  "so", "ta", "te", "un", "ver",
        "tion", "ment", "ly",  "ful", "pre", "con", "pro", "ex", "ab", "b",  "c",  "d",
        "f",    "g",    "h",   "k",   "l",   "m",   "n",   "p",  "r",  "s",  "t",  "w"};
    std::mt19937_64 g(7);
    for (size_t i = 0; i < 60000; ++i) {
      std::string w;
      const int parts = 1 + int(std::min<size_t>(3, i / 400)) + int(g() % 2);
      for (int p = 0; p < parts; ++p)
        w += kSyllables[g() % (sizeof(kSyllables) / sizeof(*kSyllables))];
      words_.push_back(w);
    }
    for (uint32_t i = 0; i < 3500; ++i) hanzi_.push_back(utf8(0x4E00 + uint32_t(g() % 0x51A5)));
  }

  // One line of prose, Chinese, code or numbers, as JSON text.
  std::string line() {
    std::string text;
    const size_t target = 200 + rng_() % 2800;
    switch (rng_() % 8) {
      case 0:
      case 1:
      case 2:
      case 3:
        prose(text, target);
        break;
      case 4:
      case 5:
        chinese(text, target);
        break;
      case 6:
        code(text, target);
        break;
      default:
        numbers(text, target);
        break;
    }
    rapidjson::StringBuffer buffer;
    rapidjson::Writer<rapidjson::StringBuffer> writer(buffer);
    writer.StartObject();
    writer.Key("text");
    writer.String(text.data(), rapidjson::SizeType(text.size()));
    writer.EndObject();
    return buffer.GetString();
  }

 private:
  const std::string& word() { return words_[word_rank_(rng_)]; }

  void prose(std::string& t, size_t target) {
    bool start = true;
    while (t.size() < target) {
      std::string w = word();
      if (start) w[0] = char(std::toupper(static_cast<unsigned char>(w[0])));
      t += w;
      start = false;
      const uint64_t r = rng_() % 100;
      if (r < 7) {
        t += ". ";
        start = true;
      } else if (r < 12) {
        t += ", ";
      } else if (r < 13) {
        t += "'s ";
      } else if (r < 14) {
        t += fmt::format(" {} ", rng_() % 2000);
      } else if (r < 15) {
        t += ".\n\n";
        start = true;
      } else {
        t += ' ';
      }
    }
  }

  void chinese(std::string& t, size_t target) {
    static const char* const kPunct[] = {"，", "。", "、", "：", "；", "！", "？"};
    while (t.size() < target) {
      const size_t n = 2 + rng_() % 14;
      for (size_t i = 0; i < n; ++i) t += hanzi_[hanzi_rank_(rng_)];
      if (rng_() % 6 == 0) t += fmt::format(" {} {} ", word(), rng_() % 100);
      t += kPunct[rng_() % 7];
    }
  }

  void code(std::string& t, size_t target) {
    int indent = 0;
    while (t.size() < target) {
      const std::string a = word(), b = word(), c = word();
      std::string pad(size_t(indent) * 4, ' ');
      switch (rng_() % 6) {
        case 0:
          t += fmt::format("{}def {}_{}({}, {}=None):\n", pad, a, b, c, a);
          indent = 1;
          break;
        case 1:
          t += fmt::format("{}for {} in range(len({})):\n", pad, a, b);
          indent = std::min(indent + 1, 3);
          break;
        case 2:
          t += fmt::format("{}{}.{} = {}[{}] * {:.3f}  # {}\n", pad, a, b, c, rng_() % 64,
                           (rng_() % 10000) / 7.0, word());
          break;
        case 3:
          t += fmt::format("{}if ({} != nullptr && {}->{} >= {}) {{ return {}; }}\n", pad, a, a, b,
                           rng_() % 100, c);
          break;
        case 4:
          t += fmt::format("{}std::vector<int64_t> {}{{{}, {}, {}}};\n", pad, a, rng_() % 9,
                           rng_() % 99, rng_() % 999);
          break;
        default:
          t += fmt::format("{}return {}({}, \"{} {}\")\n", pad, a, b, c, word());
          indent = std::max(indent - 1, 0);
          break;
      }
    }
  }

  void numbers(std::string& t, size_t target) {
    while (t.size() < target) {
      switch (rng_() % 5) {
        case 0:
          t += fmt::format("{} ", rng_() % 1000000007);
          break;
        case 1:
          t += fmt::format("{:.5f} ", double(rng_() % 10000000) / 997.0);
          break;
        case 2:
          t += fmt::format("{:04}-{:02}-{:02} ", 1990 + rng_() % 40, 1 + rng_() % 12,
                           1 + rng_() % 28);
          break;
        case 3:
          t += fmt::format("{}: {}, ", word(), rng_() % 100000);
          break;
        default:
          t += fmt::format("+{}-{}-{}\n", rng_() % 1000, rng_() % 10000, rng_() % 10000);
          break;
      }
    }
  }

  std::mt19937_64 rng_;
  Zipf word_rank_, hanzi_rank_;
  std::vector<std::string> words_, hanzi_;
};

std::string make_corpus(double mb) {
  const std::string path =
      (fs::temp_directory_path() / fmt::format("zt_tokenizer_bench_{}mb_v1.jsonl", mb)).string();
  std::error_code ec;
  if (fs::exists(path, ec)) return path;
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::binary);
  CorpusWriter w;
  const auto bytes = uint64_t(mb * 1e6);
  for (uint64_t written = 0; written < bytes;) {
    const std::string l = w.line();
    out << l << '\n';
    written += l.size() + 1;
  }
  out.close();
  fs::rename(tmp, path);
  return path;
}

struct Share {
  uint64_t jsonl_bytes = 0, text_bytes = 0, tokens = 0;
  double encode_seconds = 0;
};

void encode_lines(const zt::Tokenizer& tok, const std::vector<std::string>& lines, size_t begin,
                  size_t end, Share& share) {
  rapidjson::Document doc;
  for (size_t i = begin; i < end; ++i) {
    doc.Parse(lines[i].data(), lines[i].size());
    const rapidjson::Value& t = doc["text"];
    const auto start = Clock::now();
    const std::vector<int32_t> ids =
        tok.encode(std::string_view(t.GetString(), t.GetStringLength()));
    share.encode_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    share.jsonl_bytes += lines[i].size() + 1;
    share.text_bytes += t.GetStringLength();
    share.tokens += ids.size();
  }
}

// The folder's own name, also for a path given with a trailing slash ("real/qwen3/").
std::string folder_name(const std::string& dir) {
  fs::path p(dir);
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().string();
}

}  // namespace

int main(int argc, char** argv) {
  std::string corpus;
  double mb = 100;
  int threads = 1;
  std::vector<std::string> tokenizers;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 == argc) {
      std::fprintf(stderr,
                   "usage: zt_bench_tokenizer [--corpus PATH] [--mb 100] [--threads N] "
                   "[--tokenizer DIR]...\n");
      return 2;
    }
    const std::string value = argv[i + 1];
    if (flag == "--corpus")
      corpus = value;
    else if (flag == "--mb")
      mb = std::atof(value.c_str());
    else if (flag == "--threads")
      threads = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--tokenizer")
      tokenizers.push_back(value);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (tokenizers.empty()) {
    for (const char* name : {"qwen2", "llama3", "llama2", "mistral"}) {
      tokenizers.push_back(std::string(ZT_FIXTURES) + "/tokenizers/" + name);
    }
  }
  if (corpus.empty()) corpus = make_corpus(mb);
  std::vector<std::string> lines;
  {
    std::ifstream in(corpus, std::ios::binary);
    for (std::string l; std::getline(in, l);) {
      if (!l.empty()) lines.push_back(std::move(l));
    }
  }
  for (const std::string& dir : tokenizers) {
    std::shared_ptr<zt::Tokenizer> tok;
    try {
      tok = zt::load_tokenizer(dir, INT32_MAX);
    } catch (const std::exception& e) {
      rapidjson::StringBuffer buffer;  // the message may hold quotes: let the writer escape it
      rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
      w.StartObject();
      w.Key("bench");
      w.String("tokenizer");
      w.Key("tokenizer");
      w.String(fs::path(dir).filename().string().c_str());
      w.Key("error");
      w.String(e.what());
      w.EndObject();
      std::printf("RESULT %s\n", buffer.GetString());
      return 1;
    }
    std::vector<Share> shares(static_cast<size_t>(threads));
    std::vector<std::thread> pool;
    const auto start = Clock::now();
    for (int t = 0; t < threads; ++t) {
      const size_t begin = lines.size() * size_t(t) / size_t(threads);
      const size_t end = lines.size() * size_t(t + 1) / size_t(threads);
      pool.emplace_back(
          [&, t, begin, end] { encode_lines(*tok, lines, begin, end, shares[size_t(t)]); });
    }
    for (std::thread& th : pool) th.join();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    Share total;
    for (const Share& s : shares) {
      total.jsonl_bytes += s.jsonl_bytes;
      total.text_bytes += s.text_bytes;
      total.tokens += s.tokens;
      total.encode_seconds += s.encode_seconds;
    }
    const double mb_per_s = double(total.jsonl_bytes) / 1e6 / seconds;
    std::printf(
        "RESULT %s\n",
        fmt::format(
            R"J({{"bench": "tokenizer", "tokenizer": "{}", "threads": {}, "corpus_mb": {:.1f}, "tokens": {}, "bytes_per_token": {:.2f}, "seconds": {:.2f}, "mb_per_s": {:.2f}, "mb_per_s_per_core": {:.2f}, "encode_mb_per_s_per_core": {:.2f}}})J",
            folder_name(dir), threads, double(total.jsonl_bytes) / 1e6, total.tokens,
            double(total.text_bytes) / double(std::max<uint64_t>(1, total.tokens)), seconds,
            mb_per_s, mb_per_s / threads, double(total.text_bytes) / 1e6 / total.encode_seconds)
            .c_str());
    std::fflush(stdout);
  }
  return 0;
}
