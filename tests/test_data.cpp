// The data module: byte tokenizer, JSONL formats through every template (the rendered strings
// are specification, quoted from docs/data.md), label masks, truncation, errors with file and
// line, the token cache, collation, packing, and the sampler's orders. Single process; the
// world sizes in sampler tests are simulated (1, 2 and 4 ranks with the same global batch).
#include "support/catch.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <set>

#include <fmt/format.h>

#include "support/messages.hpp"
#include "support/ranks.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/log.hpp"
#include "zerotrain/safetensors.hpp"

using namespace zt;
using Catch::Contains;
using test::Has;
using test::LogCapture;
namespace fs = std::filesystem;

namespace {

void write_file(const std::string& path, const std::string& content) {
  std::ofstream(path, std::ios::binary) << content;
}

std::string data_file(const std::string& tag, const std::string& content) {
  const std::string path = test::temp_dir(tag) + "/data.jsonl";
  write_file(path, content);
  return path;
}

DataOptions with_template(const std::string& name) {
  DataOptions o;
  o.template_name = name;
  return o;
}

Dataset tokenize_text(const std::string& content, const DataOptions& o = {},
                      DatasetStats* stats = nullptr) {
  return tokenize_jsonl(data_file("data", content), *byte_tokenizer(), o, stats);
}

// The ids and labels an example should have, built from the pieces the templates render.
struct Expected {
  std::vector<int32_t> ids;
  std::vector<int32_t> labels;
  std::string prompt;  // the text of the masked pieces

  Expected& token(int32_t id, bool trained) {
    ids.push_back(id);
    labels.push_back(trained ? id : kIgnoreLabel);
    return *this;
  }
  Expected& text(const std::string& s, bool trained) {
    for (unsigned char c : s) token(c, trained);
    if (!trained) prompt += s;
    return *this;
  }
  Expected& bos(bool trained) { return token(byte_tokenizer()->bos_id(), trained); }
  Expected& eos() { return token(byte_tokenizer()->eos_id(), true); }
};

void check_example(const Dataset& d, int64_t i, const Expected& want) {
  CHECK(d.ids(i).to_vector() == want.ids);
  CHECK(d.labels(i).to_vector() == want.labels);
  // Decoding the masked tokens gives the prompt text back (decode skips bos).
  std::vector<int32_t> masked;
  for (int64_t t = 0; t < d.length(i); ++t) {
    if (d.labels(i)[t] == kIgnoreLabel) masked.push_back(d.ids(i)[t]);
  }
  CHECK(byte_tokenizer()->decode(masked) == want.prompt);
}

bool same_dataset(const Dataset& a, const Dataset& b) {
  return a.flat_ids() == b.flat_ids() && a.flat_labels() == b.flat_labels() &&
         a.offsets() == b.offsets() && a.document_offsets() == b.document_offsets();
}

std::vector<int64_t> sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// A tokenizer that behaves as the byte tokenizer but identifies itself differently.
class RenamedByteTokenizer : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view t) const override { return inner_->encode(t); }
  std::string decode(const std::vector<int32_t>& ids) const override { return inner_->decode(ids); }
  int32_t bos_id() const override { return inner_->bos_id(); }
  int32_t eos_id() const override { return inner_->eos_id(); }
  int32_t pad_id() const override { return inner_->pad_id(); }
  bool add_bos() const override { return inner_->add_bos(); }
  bool add_eos() const override { return inner_->add_eos(); }
  int64_t vocab_size() const override { return inner_->vocab_size(); }
  std::string fingerprint() const override { return "renamed"; }

 private:
  std::shared_ptr<Tokenizer> inner_ = byte_tokenizer();
};

}  // namespace

// ---- tokenizer -----------------------------------------------------------------------------

TEST_CASE("the byte tokenizer round-trips UTF-8 text, Chinese and emoji included", "[data]") {
  std::shared_ptr<Tokenizer> tok = byte_tokenizer();
  const std::string text = "Hello, 世界! 🙂 ### 回答：\n\t";
  std::vector<int32_t> ids = tok->encode(text);
  REQUIRE(ids.size() == text.size());
  for (size_t i = 0; i < ids.size(); ++i) CHECK(ids[i] == static_cast<unsigned char>(text[i]));
  CHECK(tok->decode(ids) == text);

  // Specials, -100 and ids past the byte range are skipped; invalid UTF-8 passes through.
  std::vector<int32_t> with_specials = {tok->bos_id(), 'h',  kIgnoreLabel, 'i', tok->eos_id(),
                                        tok->pad_id(), 0xFF, 0xFE,         300};
  CHECK(tok->decode(with_specials) == "hi\xFF\xFE");
  CHECK(tok->encode("\xFF\xFE") == std::vector<int32_t>{0xFF, 0xFE});
  CHECK(tok->encode("").empty());

  CHECK(tok->bos_id() == 256);
  CHECK(tok->eos_id() == 257);
  CHECK(tok->pad_id() == 258);
  CHECK(tok->vocab_size() == 259);
  CHECK(tok->add_bos());
  CHECK_FALSE(tok->add_eos());
  CHECK_FALSE(tok->fingerprint().empty());
  CHECK(byte_tokenizer() == tok);
}

TEST_CASE("load_tokenizer falls back to bytes only where that is right", "[data]") {
  {
    LogCapture log;
    CHECK(load_tokenizer("", 512) == byte_tokenizer());
    CHECK_FALSE(log.contains("tokenizer"));
  }
  const std::string plain = test::temp_dir("tok-plain");
  {
    LogCapture log;
    CHECK(load_tokenizer(plain, 259) == byte_tokenizer());
    CHECK(log.contains(plain));
  }
  // A host that feeds ids needs no tokenizer: the byte one comes whatever the model's size,
  // and encoding text for a model too small for it is the error.
  CHECK(load_tokenizer(plain, 100) == byte_tokenizer());
  CHECK(load_tokenizer("", 64) == byte_tokenizer());
  CHECK_THROWS_MATCHES(check_tokenizer_fits(*byte_tokenizer(), 100), ConfigError,
                       Has({"vocab_size is 100", "259", "input_ids"}));
  CHECK_NOTHROW(check_tokenizer_fits(*byte_tokenizer(), 259));
  DataOptions small;
  small.token_id_limit = 100;
  CHECK_THROWS_MATCHES(
      tokenize_jsonl(data_file("small", "{\"input_ids\": [5, 99]}\n{\"text\": \"a\"}\n"),
                     *byte_tokenizer(), small),
      ConfigError, Has({"vocab_size is 100", "259"}));
  CHECK(
      tokenize_jsonl(data_file("small_ids", "{\"input_ids\": [5, 99]}\n"), *byte_tokenizer(), small)
          .size() == 1);
  // Tokenizer files other than tokenizer.json are not read: a clear error instead of bytes.
  for (const char* name :
       {"tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json"}) {
    const std::string dir = test::temp_dir("tok-hf");
    write_file(dir + "/" + name, "{}");
    CHECK_THROWS_MATCHES(load_tokenizer(dir, 32000), ConfigError,
                         Has({dir, name, "no tokenizer.json", "save_pretrained"}));
  }
  // glm-4-9b-chat's remote-code folder calls its tiktoken rank file tokenizer.model: named as
  // such, with the -hf folder to use instead.
  const std::string tiktoken = test::temp_dir("tok-tiktoken");
  write_file(tiktoken + "/tokenizer.model", "IQ== 0\nIg== 1\nIw== 2\n");
  CHECK_THROWS_MATCHES(load_tokenizer(tiktoken, 32000), ConfigError,
                       Has({tiktoken + "/tokenizer.model", "tiktoken", "glm-4-9b-chat-hf"}));
  // A SentencePiece model (a protobuf) is not mistaken for one.
  const std::string spm = test::temp_dir("tok-spm");
  write_file(spm + "/tokenizer.model", std::string("\x0a\x0b\x0a\x05<unk>\x15\x00\x00", 12));
  CHECK_THROWS_MATCHES(load_tokenizer(spm, 32000), ConfigError, Has({"no tokenizer.json"}));
  // A tokenizer.json is read as one (docs/tokenizers.md; tests/test_tokenizer.cpp).
  const std::string broken = test::temp_dir("tok-hf");
  write_file(broken + "/tokenizer.json", "{}");
  CHECK_THROWS_MATCHES(load_tokenizer(broken, 32000), ConfigError,
                       Has({broken + "/tokenizer.json", "model"}));
  CHECK_THROWS_MATCHES(load_tokenizer(plain + "/missing", 512), IoError, Has({"missing"}));
}

// ---- formats and templates -----------------------------------------------------------------

TEST_CASE("text lines: bos + text + eos, every token trained", "[data]") {
  Dataset d = tokenize_text("{\"text\": \"abc\"}\n\n   \n{\"text\": \"你好\"}\n");
  REQUIRE(d.size() == 2);
  check_example(d, 0, Expected().bos(true).text("abc", true).eos());
  check_example(d, 1, Expected().bos(true).text("你好", true).eos());
  CHECK(d.total_tokens() == d.length(0) + d.length(1));
  CHECK(d.lengths() == std::vector<int64_t>{5, 8});
  CHECK_FALSE(d.packed());
}

TEST_CASE("instruction lines render each template exactly", "[data]") {
  const std::string with_input =
      R"({"instruction": "Translate", "input": "hello", "output": "bonjour"})";
  const std::string without_input = R"({"instruction": "Say hi", "output": "hi"})";
  const std::string null_input = R"({"instruction": "Say hi", "input": null, "output": "hi"})";
  const std::string content = with_input + "\n" + without_input + "\n" + null_input + "\n";

  struct Case {
    std::string name;
    std::string prompt_with_input;
    std::string prompt_without_input;
    std::string response_suffix;  // what the template closes a reply with, besides eos
    bool eos;
  };
  const Case cases[] = {
      {"alpaca_zh", "### 指令：Translate\nhello\n### 回答：", "### 指令：Say hi\n### 回答：", "",
       true},
      {"alpaca", "### Instruction:\nTranslate\n\n### Input:\nhello\n\n### Response:\n",
       "### Instruction:\nSay hi\n\n### Response:\n", "", true},
      {"chatml", "<|im_start|>user\nTranslate\nhello<|im_end|>\n<|im_start|>assistant\n",
       "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>\n", false},
      {"plain", "Translatehello", "Say hi", "", true},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    Dataset d = tokenize_text(content, with_template(c.name));
    REQUIRE(d.size() == 3);
    Expected first;
    first.bos(false).text(c.prompt_with_input, false).text("bonjour" + c.response_suffix, true);
    Expected second;
    second.bos(false).text(c.prompt_without_input, false).text("hi" + c.response_suffix, true);
    if (c.eos) {
      first.eos();
      second.eos();
    }
    check_example(d, 0, first);
    check_example(d, 1, second);
    check_example(d, 2, second);
  }
  // The default template is alpaca_zh.
  CHECK(same_dataset(tokenize_text(content), tokenize_text(content, with_template("alpaca_zh"))));
}

TEST_CASE("messages: chatml natively, other templates turn by turn", "[data]") {
  const std::string line =
      R"({"messages": [{"role": "system", "content": "Be brief."},)"
      R"( {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},)"
      R"( {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]})";
  const std::string no_system =
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})";
  const std::string content = line + "\n" + no_system + "\n";

  SECTION("chatml") {
    Dataset d = tokenize_text(content, with_template("chatml"));
    REQUIRE(d.size() == 2);
    check_example(d, 0,
                  Expected()
                      .bos(false)
                      .text("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi"
                            "<|im_end|>\n<|im_start|>assistant\n",
                            false)
                      .text("Hello!<|im_end|>\n", true)
                      .text("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", false)
                      .text("Goodbye.<|im_end|>\n", true));
    check_example(d, 1,
                  Expected()
                      .bos(false)
                      .text("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", false)
                      .text("Yo<|im_end|>\n", true));
  }
  SECTION("alpaca_zh") {
    Dataset d = tokenize_text(content, with_template("alpaca_zh"));
    check_example(d, 0,
                  Expected()
                      .bos(false)
                      .text("### 指令：Be brief.\nHi\n### 回答：", false)
                      .text("Hello!", true)
                      .eos()
                      .text("### 指令：Bye\n### 回答：", false)
                      .text("Goodbye.", true)
                      .eos());
    check_example(
        d, 1, Expected().bos(false).text("### 指令：Hi\n### 回答：", false).text("Yo", true).eos());
  }
  SECTION("alpaca") {
    Dataset d = tokenize_text(content, with_template("alpaca"));
    check_example(d, 0,
                  Expected()
                      .bos(false)
                      .text("### Instruction:\nBe brief.\nHi\n\n### Response:\n", false)
                      .text("Hello!", true)
                      .eos()
                      .text("### Instruction:\nBye\n\n### Response:\n", false)
                      .text("Goodbye.", true)
                      .eos());
  }
  SECTION("plain") {
    Dataset d = tokenize_text(content, with_template("plain"));
    check_example(d, 0,
                  Expected()
                      .bos(false)
                      .text("Be brief.\nHi", false)
                      .text("Hello!", true)
                      .eos()
                      .text("Bye", false)
                      .text("Goodbye.", true)
                      .eos());
  }
}

TEST_CASE("ShareGPT conversations, OpenAI content parts and alpaca history read as the same chat",
          "[data]") {
  // One conversation in each layout users have; all tokenize to the same example.
  const std::string openai =
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},)"
      R"( {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},)"
      R"( {"role": "assistant", "content": "Goodbye."}]})";
  const std::string sharegpt =
      R"({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},)"
      R"( {"from": "gpt", "value": "Hello!"}, {"from": "user", "value": "Bye"},)"
      R"( {"from": "chatgpt", "value": "Goodbye."}]})";
  const std::string sharegpt_system =
      R"({"system": "Be brief.", "conversations": [{"from": "human", "value": "Hi"}, {"from": "bard", "value": "Hello!"},)"
      R"( {"from": "human", "value": "Bye"}, {"from": "model", "value": "Goodbye."}]})";
  const std::string parts =
      R"({"messages": [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"text": "brief."}]},)"
      R"( {"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},)"
      R"( {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]})";
  const std::string alpaca =
      R"({"system": "Be brief.", "history": [["Hi", "Hello!"]], "instruction": "Bye", "output": "Goodbye."})";
  for (const char* t : {"chatml", "alpaca", "qwen2.5"}) {
    INFO("template " << t);
    Dataset d = tokenize_text(
        openai + "\n" + sharegpt + "\n" + sharegpt_system + "\n" + parts + "\n" + alpaca + "\n",
        with_template(t));
    REQUIRE(d.size() == 5);
    for (int64_t i = 1; i < 5; ++i) {
      INFO("example " << i);
      CHECK(d.ids(i).to_vector() == d.ids(0).to_vector());
      CHECK(d.labels(i).to_vector() == d.labels(0).to_vector());
    }
  }
}

TEST_CASE("\\u0000 is a character like any other in every layout; surrogate pairs read as one",
          "[data]") {
  // The same chat in each layout, its user turn holding `turn`: every layout must give the
  // example the others give (a NUL cut short in one field would not).
  auto layouts = [](const std::string& turn) {
    return R"({"messages": [{"role": "user", "content": ")" + turn +
           R"("}, {"role": "assistant", "content": "ok"}]})" + "\n" +
           R"({"conversations": [{"from": "human", "value": ")" + turn +
           R"("}, {"from": "gpt", "value": "ok"}]})" + "\n" +
           R"({"messages": [{"role": "user", "content": [{"type": "text", "text": ")" + turn +
           R"("}]}, {"role": "assistant", "content": "ok"}]})" + "\n" + R"({"history": [[")" +
           turn + R"(", "ok"]], "instruction": "next", "output": "ok"})" + "\n" +
           R"({"instruction": ")" + turn + R"(", "output": "ok"})" + "\n";
  };
  Dataset nul = tokenize_text(layouts("a\\u0000b"), with_template("chatml"));
  Dataset one = tokenize_text(layouts("a\\u0001b"), with_template("chatml"));
  REQUIRE(nul.size() == 5);
  for (int64_t i = 0; i < 5; ++i) {
    INFO("layout " << i);
    CHECK(nul.ids(i).size == one.ids(i).size);  // nothing cut at the NUL
    CHECK(nul.ids(i).to_vector() != one.ids(i).to_vector());
  }
  CHECK(nul.ids(0).to_vector() == nul.ids(1).to_vector());
  CHECK(nul.ids(0).to_vector() == nul.ids(2).to_vector());
  // A pair of escapes is one character, the same as its UTF-8 bytes.
  Dataset pair = tokenize_text("{\"text\": \"\\uD83D\\uDE00\"}\n", DataOptions());
  Dataset raw = tokenize_text("{\"text\": \"\xF0\x9F\x98\x80\"}\n", DataOptions());
  CHECK(pair.ids(0).to_vector() == raw.ids(0).to_vector());
  // An escaped backslash before "uDC00" is a backslash, not an escape.
  CHECK(tokenize_text("{\"text\": \"\\\\uDC00\"}\n", DataOptions()).size() == 1);
}

TEST_CASE("a file that is one JSON array reads element by element as JSONL does", "[data]") {
  const std::string a = R"({"instruction": "Is 3 odd?", "output": "yes"})";
  const std::string b =
      R"({"instruction": "Is 4 odd?", "input": "think [about] it, \"twice\"", "output": "no"})";
  const std::string c = R"({"text": "a, b ] c }"})";
  Dataset jsonl = tokenize_text(a + "\n" + b + "\n" + c + "\n", with_template("alpaca"));
  for (const std::string& array : {"[" + a + ", " + b + ",\n" + c + "]",
                                   "\xEF\xBB\xBF\n  [\n" + a + ",\n" + b + ",\n" + c + "\n]\n",
                                   "[" + a + "," + b + "," + c + ",]"}) {
    INFO(array);
    const std::string path = test::temp_dir("array") + "/alpaca_data.json";
    write_file(path, array);
    DatasetStats stats;
    Dataset d = tokenize_jsonl(path, *byte_tokenizer(), with_template("alpaca"), &stats);
    CHECK(same_dataset(d, jsonl));
    CHECK(stats.lines == 3);
  }
  // Errors name the element and its line.
  const std::string dir = test::temp_dir("array_bad");
  write_file(dir + "/bad.json", "[\n" + a + ",\n{\"instruction\": 5, \"output\": \"x\"}\n]");
  CHECK_THROWS_MATCHES(tokenize_jsonl(dir + "/bad.json", *byte_tokenizer(), DataOptions()),
                       ConfigError, Has({dir + "/bad.json: element 1 (line 3)", "instruction"}));
  write_file(dir + "/truncated.json", "[" + a + ", {\"text\": \"cut off");
  CHECK_THROWS_MATCHES(tokenize_jsonl(dir + "/truncated.json", *byte_tokenizer(), DataOptions()),
                       ConfigError, Has({"truncated.json", "element 1", "truncated"}));
  write_file(dir + "/open.json", "[" + a + ", ");
  CHECK_THROWS_MATCHES(tokenize_jsonl(dir + "/open.json", *byte_tokenizer(), DataOptions()),
                       ConfigError, Has({"open.json", "closing ']'"}));
  write_file(dir + "/after.json", "[" + a + "] {}");
  CHECK_THROWS_MATCHES(tokenize_jsonl(dir + "/after.json", *byte_tokenizer(), DataOptions()),
                       ConfigError, Has({"after.json", "after the JSON array"}));
}

TEST_CASE("train_on_prompt trains every token of instruction and chat data", "[data]") {
  const std::string content =
      R"({"instruction": "Translate", "input": "hello", "output": "bonjour"})"
      "\n"
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})"
      "\n";
  for (const char* name : {"alpaca_zh", "alpaca", "chatml", "plain"}) {
    INFO(name);
    DataOptions o = with_template(name);
    Dataset masked = tokenize_text(content, o);
    o.train_on_prompt = true;
    Dataset trained = tokenize_text(content, o);
    CHECK(trained.flat_ids() == masked.flat_ids());
    CHECK(trained.flat_labels() == trained.flat_ids());
  }
}

// ---- TRL's SFT layouts and options (docs/data.md) --------------------------------------------

namespace {

std::shared_ptr<Tokenizer> fixture_tokenizer(const std::string& name) {
  return load_tokenizer(std::string(ZT_FIXTURES) + "/tokenizers/" + name, 1 << 30);
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Labels that train ids [from, to) and nothing else.
std::vector<int32_t> trained_span(const std::vector<int32_t>& ids, size_t from, size_t to) {
  std::vector<int32_t> labels(ids.size(), kIgnoreLabel);
  for (size_t i = from; i < to && i < ids.size(); ++i) labels[i] = ids[i];
  return labels;
}

TrainingArguments sft_flags(const std::vector<std::string>& flags) {
  TrainingArguments args;
  apply_training_flags(args, flags);
  return args;
}

}  // namespace

TEST_CASE("TRL prompt-completion text: prompt ids then completion ids, trained on the completion",
          "[data][sft]") {
  SECTION("byte tokenizer: bos and prompt masked, completion and eos trained") {
    const std::string content = R"({"prompt": "2+2=", "completion": "4"})"
                                "\n"
                                R"({"prompt": "", "completion": "ok", "id": 7})"
                                "\n";
    Dataset d = tokenize_text(content);
    REQUIRE(d.size() == 2);
    check_example(d, 0, Expected().bos(false).text("2+2=", false).text("4", true).eos());
    check_example(d, 1, Expected().bos(false).text("ok", true).eos());

    // completion_only_loss false (TRL's), or train_on_prompt: every token trains.
    DataOptions no_completion_only, on_prompt;
    no_completion_only.completion_only_loss = false;
    on_prompt.train_on_prompt = true;
    for (const DataOptions& o : {no_completion_only, on_prompt}) {
      Dataset all = tokenize_text(content, o);
      CHECK(all.flat_ids() == d.flat_ids());
      CHECK(all.flat_labels() == all.flat_ids());
    }
  }
  SECTION("Qwen2's tokenizer: the ids of the prompt, then of the completion, then eos") {
    auto tok = fixture_tokenizer("qwen2");
    const std::string prompt = "Question: what is the capital of France?\n";
    const std::string completion = "The capital is Paris.";
    const std::string path = data_file(
        "pc-qwen", fmt::format(R"({{"prompt": "{}", "completion": "{}"}})"
                               "\n"
                               R"({{"prompt": "{}", "completion": "{}<|endoftext|>"}})"
                               "\n",
                               "Question: what is the capital of France?\\n", completion,
                               "Question: what is the capital of France?\\n", completion));
    Dataset d = tokenize_jsonl(path, *tok, DataOptions());
    REQUIRE(d.size() == 2);
    const std::vector<int32_t> p = tok->encode(prompt);  // Qwen adds no bos
    const std::vector<int32_t> want = concat(concat(p, tok->encode(completion)), {tok->eos_id()});
    for (int64_t i = 0; i < 2; ++i) {  // a completion ending in eos gets no second one
      CHECK(d.ids(i).to_vector() == want);
      CHECK(d.labels(i).to_vector() == trained_span(want, p.size(), want.size()));
    }
  }
  SECTION("LLaMA-2's tokenizer: bos, then prompt + completion encoded as one text (TRL)") {
    // A prompt that ends inside a word: encoded apart, the two texts give other ids than
    // encoded together, and the example is what TRL makes, tokenizer(prompt + completion)
    // with the first len(tokenizer(prompt)) ids masked.
    auto tok = fixture_tokenizer("llama2");
    REQUIRE(tok->add_bos());
    const std::string prompt = "Hello wor", completion = "ld, again";
    REQUIRE(concat(tok->encode(prompt), tok->encode(completion)) !=
            tok->encode(prompt + completion));
    Dataset d =
        tokenize_jsonl(data_file("pc-llama", fmt::format(R"({{"prompt": "{}", "completion": "{}"}})"
                                                         "\n",
                                                         prompt, completion)),
                       *tok, DataOptions());
    const std::vector<int32_t> prompt_ids = concat(tok->prefix_ids(), tok->encode(prompt));
    const std::vector<int32_t> want =
        concat(concat(tok->prefix_ids(), tok->encode(prompt + completion)), {tok->eos_id()});
    CHECK(d.ids(0).to_vector() == want);
    CHECK(d.labels(0).to_vector() == trained_span(want, prompt_ids.size(), want.size()));
    CHECK(d.labels(0)[0] == kIgnoreLabel);
  }
}

TEST_CASE("TRL prompt-completion messages: the messages record's tokens, the completion trained",
          "[data][sft]") {
  const std::string messages =
      R"({"messages": [{"role": "system", "content": "Be brief."},)"
      R"( {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},)"
      R"( {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]})";
  const std::string prompt_completion =
      R"({"prompt": [{"role": "system", "content": "Be brief."},)"
      R"( {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},)"
      R"( {"role": "user", "content": "Bye"}],)"
      R"( "completion": [{"role": "assistant", "content": "Goodbye."}]})";

  SECTION("Qwen2.5's format with Qwen2's tokenizer") {
    auto tok = fixture_tokenizer("qwen2");
    DataOptions o = with_template("qwen2.5");
    const std::string path = data_file("pc-chat", messages + "\n" + prompt_completion + "\n");
    Dataset d = tokenize_jsonl(path, *tok, o);
    REQUIRE(d.size() == 2);
    // The text apply_chat_template writes, by hand: the prompt with its generation prompt,
    // then the reply and its end of turn (trained), then the newline after it (not trained).
    const std::string prompt =
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n";
    const std::vector<int32_t> ids = tok->encode(prompt + "Goodbye.<|im_end|>\n");
    const size_t reply_start = tok->encode(prompt).size();
    const size_t reply_end = tok->encode(prompt + "Goodbye.<|im_end|>").size();
    CHECK(d.ids(0).to_vector() == ids);
    CHECK(d.ids(1).to_vector() == ids);
    CHECK(d.labels(1).to_vector() == trained_span(ids, reply_start, reply_end));
    // The messages record trains the first reply too; everything else is the same.
    std::vector<int32_t> first_reply_masked = d.labels(0).to_vector();
    const size_t first = tok->encode(prompt.substr(0, prompt.find("Hello!"))).size();
    CHECK(first_reply_masked[first] == ids[first]);
    std::fill(first_reply_masked.begin(), first_reply_masked.begin() + reply_start, kIgnoreLabel);
    CHECK(first_reply_masked == d.labels(1).to_vector());

    // completion_only_loss false: every reply trains, as in the messages record (TRL's
    // assistant masks); with assistant_only_loss false too, every token.
    o.completion_only_loss = false;
    Dataset replies = tokenize_jsonl(path, *tok, o);
    CHECK(replies.labels(1).to_vector() == d.labels(0).to_vector());
    o.assistant_only_loss = false;
    Dataset all = tokenize_jsonl(path, *tok, o);
    CHECK(all.labels(1).to_vector() == ids);
    CHECK(all.labels(0).to_vector() == ids);
  }
  SECTION("an instruction template: the prompt's reply and its eos masked") {
    Dataset d = tokenize_text(prompt_completion + "\n", with_template("alpaca_zh"));
    REQUIRE(d.size() == 1);
    check_example(d, 0,
                  Expected()
                      .bos(false)
                      .text("### 指令：Be brief.\nHi\n### 回答：", false)
                      .text("Hello!", false)
                      .token(byte_tokenizer()->eos_id(), false)
                      .text("### 指令：Bye\n### 回答：", false)
                      .text("Goodbye.", true)
                      .eos());
    // The same tokens as the messages record.
    CHECK(d.flat_ids() == tokenize_text(messages + "\n", with_template("alpaca_zh")).flat_ids());
  }
  SECTION("a prompt that is one user message, through chatml") {
    Dataset d = tokenize_text(
        R"({"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Yo"}]})"
        "\n",
        with_template("chatml"));
    check_example(d, 0,
                  Expected()
                      .bos(false)
                      .text("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", false)
                      .text("Yo<|im_end|>\n", true));
  }
}

TEST_CASE("assistant_only_loss: a messages record trains its replies, or every token when false",
          "[data][sft]") {
  auto tok = fixture_tokenizer("qwen2");
  const std::string path = data_file(
      "aol",
      R"({"messages": [{"role": "system", "content": "Be brief."},)"
      R"( {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},)"
      R"( {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]})"
      "\n"
      R"({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]})"
      "\n");
  const std::string system = "<|im_start|>system\nBe brief.<|im_end|>\n";
  const std::string turn1 = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
  const std::string turn2 =
      "Hello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
      "<|im_start|>assistant\n";
  const std::vector<int32_t> ids = tok->encode(system + turn1 + turn2 + "Goodbye.<|im_end|>\n");
  // The assistant's tokens: each reply through its <|im_end|>.
  std::vector<int32_t> replies(ids.size(), kIgnoreLabel);
  for (const auto& [before, reply] :
       {std::pair{system + turn1, std::string("Hello!<|im_end|>")},
        std::pair{system + turn1 + turn2, std::string("Goodbye.<|im_end|>")}}) {
    const size_t from = tok->encode(before).size(), to = tok->encode(before + reply).size();
    for (size_t i = from; i < to; ++i) replies[i] = ids[i];
  }

  TrainingArguments args =
      sft_flags({"--assistant_only_loss", "true", "--template", "qwen2.5", "--max_length", "512"});
  Dataset d = tokenize_jsonl(path, *tok, data_options_for(args));
  REQUIRE(d.size() == 2);
  CHECK(d.ids(0).to_vector() == ids);
  CHECK(d.labels(0).to_vector() == replies);  // system and user turns masked

  // TRL's default, false: every token of the conversation trains, system and users included.
  Dataset all = tokenize_jsonl(
      path, *tok,
      data_options_for(sft_flags({"--assistant_only_loss", "false", "--template", "qwen2.5"})));
  CHECK(all.flat_ids() == d.flat_ids());
  CHECK(all.flat_labels() == all.flat_ids());
  // Unset, zerotrain's default: the replies.
  CHECK(same_dataset(
      tokenize_jsonl(path, *tok, data_options_for(sft_flags({"--template", "qwen2.5"}))), d));
}

TEST_CASE("dataset_text_field names the key of plain-text records", "[data][sft]") {
  DataOptions o =
      data_options_for(sft_flags({"--dataset_text_field", "content", "--template", "alpaca"}));
  CHECK(o.text_field == "content");
  Dataset d = tokenize_text("{\"content\": \"abc\", \"id\": 3}\n", o);
  check_example(d, 0, Expected().bos(true).text("abc", true).eos());
  // "text" is then another key, and an unknown layout names the field.
  const std::string path = data_file("field", "{\"text\": \"abc\"}\n");
  CHECK_THROWS_MATCHES(tokenize_jsonl(path, *byte_tokenizer(), o), ConfigError,
                       Has({"unknown layout", "\"content\" (plain text, dataset_text_field)"}));
  for (const char* taken : {"messages", "prompt", ""}) {
    o.text_field = taken;
    CHECK_THROWS_MATCHES(tokenize_jsonl(path, *byte_tokenizer(), o), ConfigError,
                         Has({"dataset_text_field"}));
  }
}

TEST_CASE("TRL's SFT options are accepted by name, or refused saying why", "[data][sft]") {
  TrainingArguments a = sft_flags({"--max_length", "64", "--completion_only_loss", "false",
                                   "--assistant_only_loss", "None", "--packing", "true"});
  CHECK(a.max_length == 64);
  CHECK(a.packing);
  DataOptions o = data_options_for(a);
  CHECK_FALSE(o.completion_only_loss);
  CHECK(o.assistant_only_loss);  // None: zerotrain's default
  CHECK(data_options_for(sft_flags({"--completion_only_loss", "None"})).completion_only_loss);

  // Without effect on results: accepted, each with its warning.
  TrainingArguments f =
      sft_flags({"--padding_free", "true", "--pad_token", "<|endoftext|>", "--eos_token", "None"});
  for (const char* name : {"padding_free", "pad_token", "eos_token"}) {
    INFO(name);
    REQUIRE(f.ignored.count(name) == 1);
    CHECK_THAT(f.ignored[name], Contains("TRL's " + std::string(name)));
  }
  // Another eos than the tokenizer's: refused.
  CHECK_THROWS_MATCHES(sft_flags({"--eos_token", "<|im_end|>"}), ConfigError,
                       Has({"eos_token", "tokenizer_config.json"}));
  // Contradictions, and SFT options on preference stages.
  CHECK_THROWS_MATCHES(sft_flags({"--train_on_prompt", "true", "--completion_only_loss", "true"}),
                       ConfigError, Has({"train_on_prompt", "completion_only_loss"}));
  CHECK_THROWS_MATCHES(sft_flags({"--train_on_prompt", "true", "--assistant_only_loss", "true"}),
                       ConfigError, Has({"train_on_prompt", "assistant_only_loss"}));
  CHECK_NOTHROW(sft_flags({"--train_on_prompt", "true", "--assistant_only_loss", "false"}));
  CHECK_THROWS_MATCHES(sft_flags({"--stage", "dpo", "--completion_only_loss", "false"}),
                       ConfigError, Has({"completion_only_loss", "SFT option", "stage dpo"}));
  // TRL's truncation_mode keep_end is not what SFT data does: refused, also where a cache of
  // the same data kept its start.
  const std::string dir = test::temp_dir("keep-end");
  const std::string path = data_file("keep-end", "{\"text\": \"abc\"}\n");
  DataOptions start = with_template("alpaca");
  load_or_tokenize(path, *byte_tokenizer(), start, dir);
  DataOptions end = start;
  end.truncation_mode = "keep_end";
  CHECK_THROWS_MATCHES(load_or_tokenize(path, *byte_tokenizer(), end, dir), ConfigError,
                       Has({"truncation_mode keep_end", "keep_start"}));
  CHECK_THROWS_MATCHES(sft_flags({"--stage", "kto", "--dataset_text_field", "content"}),
                       ConfigError, Has({"dataset_text_field", "stage kto"}));
}

TEST_CASE("pre-tokenized lines are taken as they are", "[data]") {
  Dataset d = tokenize_text(
      "{\"input_ids\": [1, 2, 3], \"labels\": [-100, 2, 3]}\n{\"input_ids\": [258, 0]}\n");
  REQUIRE(d.size() == 2);
  CHECK(d.ids(0).to_vector() == std::vector<int32_t>{1, 2, 3});
  CHECK(d.labels(0).to_vector() == std::vector<int32_t>{kIgnoreLabel, 2, 3});
  CHECK(d.ids(1).to_vector() == std::vector<int32_t>{258, 0});
  CHECK(d.labels(1).to_vector() == std::vector<int32_t>{258, 0});
}

TEST_CASE("truncation keeps the start, and examples left untrained are dropped and counted",
          "[data]") {
  const std::string long_prompt = std::string(40, 'p');
  const std::string long_line =
      "{\"instruction\": \"" + long_prompt + "\", \"output\": \"answer\"}";
  const std::string content =
      "{\"text\": \"0123456789abcdef\"}\n" + long_line +
      "\n{\"instruction\": \"short\", \"output\": \"answer that is long\"}\n";
  DataOptions o = with_template("plain");
  o.max_length = 12;
  DatasetStats stats;
  LogCapture log;
  Dataset d = tokenize_text(content, o, &stats);
  REQUIRE(d.size() == 2);
  check_example(d, 0, Expected().bos(true).text("0123456789a", true));
  check_example(d, 1, Expected().bos(false).text("short", false).text("answer", true));
  CHECK(stats.lines == 3);
  CHECK(stats.examples == 2);
  CHECK(stats.dropped_examples == 1);
  CHECK(stats.skipped_lines == 0);
  CHECK(stats.tokens == d.total_tokens());
  CHECK(log.contains("dropped 1 example"));

  // With train_on_prompt the long example keeps trained (prompt) tokens and stays.
  o.train_on_prompt = true;
  CHECK(tokenize_text(content, o).size() == 3);

  // When nothing is left the file is an error naming it.
  o.train_on_prompt = false;
  const std::string path =
      data_file("all-dropped", "{\"instruction\": \"" + long_prompt + "\", \"output\": \"x\"}\n");
  CHECK_THROWS_MATCHES(tokenize_jsonl(path, *byte_tokenizer(), o), ConfigError,
                       Has({path, "no usable example", "1 dropped"}));
}

TEST_CASE("each dropped example is counted under its cause, also through the cache",
          "[data][counts]") {
  DataOptions o = with_template("plain");
  o.max_length = 12;
  std::string long_ids, long_labels;
  for (int i = 0; i < 20; ++i) {
    long_ids += fmt::format("{}{}", i ? ", " : "", 65 + i);
    long_labels += fmt::format("{}-100", i ? ", " : "");
  }
  const std::string path =
      data_file("counts",
                // no trained token, within max_length and past it: not truncation's doing
                "{\"input_ids\": [1, 2, 3], \"labels\": [-100, -100, -100]}\n"
                "{\"input_ids\": [" +
                    long_ids + "], \"labels\": [" + long_labels + "]}\n" +
                    // a prompt that fills max_length: truncation's
                    "{\"instruction\": \"" + std::string(40, 'p') +
                    "\", \"output\": \"answer\"}\n" + "{\"text\": \"kept\"}\n");
  DatasetStats stats;
  {
    LogCapture log;
    const Dataset d = tokenize_jsonl(path, *byte_tokenizer(), o, &stats);
    CHECK(d.size() == 1);
    CHECK(
        log.contains("dropped 3 example(s): 2 without a trained token, 1 left without a "
                     "trained token by truncation to max_length 12"));
  }
  CHECK(stats.examples == 1);
  CHECK(stats.dropped_examples == 3);
  CHECK(stats.untrained_examples == 2);
  CHECK(stats.truncated_examples == 1);
  CHECK(stats.skipped_truncated == 0);

  // The causes survive the cache.
  const std::string cache_dir = test::temp_dir("counts-cache");
  load_or_tokenize(path, *byte_tokenizer(), o, cache_dir);
  DatasetStats cached;
  {
    LogCapture log;
    load_or_tokenize(path, *byte_tokenizer(), o, cache_dir, &cached);
    CHECK(log.contains("from the cache"));
  }
  CHECK(cached.untrained_examples == 2);
  CHECK(cached.truncated_examples == 1);
  // A cache written before the causes were counted drops records without saying why: it is
  // tokenized again, not read with every cause 0.
  const std::string file = dataset_cache_path(cache_dir, path, *byte_tokenizer(), o);
  std::map<std::string, std::string> old;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  {
    const SafetensorsFile f(file);
    old = f.metadata();
    for (const char* name : {"input_ids", "labels", "offsets"})
      tensors.emplace_back(name, f.load(name));
  }
  for (const char* cause : {"untrained_examples", "truncated_examples", "skipped_truncated",
                            "cut_answers", "cut_identical_pairs"}) {
    old.erase(cause);
  }
  save_safetensors(file, tensors, old);
  DatasetStats again;
  {
    LogCapture log;
    load_or_tokenize(path, *byte_tokenizer(), o, cache_dir, &again);
    CHECK(log.contains("before dropped records were counted by cause; tokenizing again"));
  }
  CHECK(again.untrained_examples == 2);
  CHECK(again.truncated_examples == 1);
}

TEST_CASE("every malformed line is an error naming file, line and key", "[data]") {
  struct Case {
    std::string line;
    std::vector<std::string> expected;
  };
  const Case cases[] = {
      {R"({"text": "unterminated)", {"invalid JSON", "column"}},
      {R"([1, 2])", {"expected an object"}},
      {R"({"text": 5})", {"text: expected a string, found 5"}},
      {R"({"text": null})", {"text: expected a string"}},
      {R"({"instruction": "x"})", {"output: expected a string, found nothing"}},
      {R"({"instruction": "x", "output": ["y"]})", {"output: expected a string"}},
      {R"({"instruction": "x", "input": 3, "output": "y"})", {"input: expected a string"}},
      {R"({"completion": "y"})",
       {"unknown layout", "\"prompt\" + \"completion\" (TRL's", "\"conversations\" (ShareGPT",
        "\"messages\" (OpenAI"}},
      {R"({"prompt": "x"})", {"\"prompt\" record needs a \"completion\""}},
      {R"({"prompt": "x", "chosen": "a"})", {"needs a \"completion\"", "--stage dpo"}},
      {R"({"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]})",
       {"completion: expected a string, as the prompt is"}},
      {R"({"prompt": 5, "completion": "y"})", {"prompt: expected a string (text) or a list"}},
      {R"({"prompt": [{"role": "user", "content": "x"}], "completion": "y"})",
       {"completion: expected a list of one assistant message"}},
      {R"({"prompt": [{"role": "user", "content": "x"}], "completion": [{"role": "user", "content": "y"}]})",
       {"completion[0].role", "the assistant's reply"}},
      {R"({"prompt": [{"role": "user", "content": "x"}], "completion": [{"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]})",
       {"completion: has 2 messages"}},
      {R"({"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "completion": [{"role": "assistant", "content": "z"}]})",
       {"prompt", "must end with a user message"}},
      {R"({})", {"unknown layout", "empty object"}},
      {R"({"input_ids": [1, 999]})", {"input_ids: entry 1 is 999", "[0, 259)"}},
      {R"({"input_ids": [1, -100]})", {"input_ids: entry 1 is -100"}},
      {R"({"input_ids": [1.5]})", {"input_ids: entry 0 is 1.5"}},
      {R"({"input_ids": []})", {"input_ids: expected a non-empty array"}},
      {R"({"input_ids": [1, 2], "labels": [1]})", {"labels: has 1 entries but input_ids has 2"}},
      {R"({"input_ids": [1, 2], "labels": [1, -5]})", {"labels: entry 1 is -5"}},
      {R"({"messages": "hi"})", {"messages: expected a non-empty array"}},
      {R"({"messages": [{"role": "narrator", "content": "x"}]})",
       {"messages[0].role", "\"narrator\" is not a role"}},
      {R"({"conversations": [{"from": "human", "value": "x"}, {"from": "tool", "value": "y"}]})",
       {"conversations[1].from", "\"tool\""}},
      {R"({"instruction": "x", "output": "y", "history": [["a"]]})", {"history", "entry 0"}},
      {R"({"messages": [{"role": "user"}]})", {"messages[0].content: expected a string"}},
      {R"({"messages": [{"role": "user", "content": "x"}]})", {"must end with an assistant"}},
      {R"({"messages": [{"role": "assistant", "content": "x"}]})", {"must follow a user"}},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]})",
       {"messages[1].role", "first message"}},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})",
       {"messages[1].role", "two user messages"}},
      {R"({"text": "a", "text": "b"})", {"text: the key appears twice"}},
      // Surrogates are not characters: refused in every field, escaped or as raw bytes.
      {R"({"text": "a\uDC00b"})", {"lone low surrogate", "column 12"}},
      {R"({"instruction": "x", "output": "\uD800"})", {"lone high surrogate"}},
      {R"({"messages": [{"role": "user", "content": "\uDBFFz"}]})", {"lone high surrogate"}},
      {"{\"text\": \"a\xED\xB0\x80"
       "b\"}",
       {"bytes of a UTF-16 surrogate"}},
  };
  for (const Case& c : cases) {
    INFO(c.line);
    // The bad line is line 3: blank lines count in the numbering.
    const std::string path = data_file("bad", "{\"text\": \"fine\"}\n\n" + c.line + "\n");
    try {
      tokenize_jsonl(path, *byte_tokenizer(), DataOptions());
      FAIL("no error");
    } catch (const ConfigError& e) {
      const std::string message = e.what();
      INFO(message);
      CHECK(message.rfind(path + ":3: ", 0) == 0);
      CHECK_THAT(message, Contains("skip_bad_lines"));
      for (const std::string& part : c.expected) CHECK_THAT(message, Contains(part));
    }
  }
}

TEST_CASE("pre-tokenized ids are checked against the model's vocabulary, not the tokenizer's",
          "[data]") {
  // A model with more embedding rows than its tokenizer has tokens (Qwen2.5, or an inline config
  // with the byte tokenizer) takes any id below its vocab_size.
  const std::string path = data_file("ids_limit", "{\"input_ids\": [1, 999, 3]}\n");
  DataOptions o;
  o.token_id_limit = 1000;
  Dataset d = tokenize_jsonl(path, *byte_tokenizer(), o);
  REQUIRE(d.size() == 1);
  CHECK(d.ids(0).to_vector() == std::vector<int32_t>{1, 999, 3});
  o.token_id_limit = 999;
  CHECK_THROWS_WITH(tokenize_jsonl(path, *byte_tokenizer(), o),
                    Contains("entry 1 is 999") && Contains("[0, 999)"));
  // The limit is part of the cache key: a dataset checked against another limit is not reused.
  CHECK(dataset_cache_path("c", path, *byte_tokenizer(), o) !=
        dataset_cache_path("c", path, *byte_tokenizer(), DataOptions()));
}

TEST_CASE("tokenizing on many threads gives the sequential pass's dataset, counts and errors",
          "[data]") {
  // More lines than one batch (8192), in every format, with malformed lines, blank lines and
  // an example that truncation leaves without a trained token.
  std::string text;
  for (int i = 0; i < 20000; ++i) {
    switch (i % 5) {
      case 0:
        text += fmt::format("{{\"text\": \"line {} ü\"}}\n", i);
        break;
      case 1:
        text += fmt::format("{{\"instruction\": \"q{}\", \"output\": \"a{}\"}}\n", i, i);
        break;
      case 2:
        text += fmt::format("{{\"input_ids\": [{}, 7, 9]}}\n", i % 250);
        break;
      case 3:
        text += i % 1000 == 3 ? "{\"text\": 5}\n" : "\n";
        break;
      default:
        text += fmt::format(
            "{{\"messages\": [{{\"role\": \"user\", \"content\": \"{}\"}}, "
            "{{\"role\": \"assistant\", \"content\": \"ok\"}}]}}\n",
            std::string(i % 40, 'x'));
    }
  }
  const std::string path = data_file("threads", text);
  DataOptions o;
  o.skip_bad_lines = true;
  o.max_length = 30;  // long prompts lose every trained token
  Dataset d[2];
  DatasetStats st[2];
  for (int k = 0; k < 2; ++k) {
    ::setenv("ZT_CPU_THREADS", k == 0 ? "1" : "4", 1);
    d[k] = tokenize_jsonl(path, *byte_tokenizer(), o, &st[k]);
  }
  CHECK(st[0].skipped_lines == 20);
  CHECK(st[0].dropped_examples > 0);
  CHECK(st[1].lines == st[0].lines);
  CHECK(st[1].skipped_lines == st[0].skipped_lines);
  CHECK(st[1].dropped_examples == st[0].dropped_examples);
  // File order, checked against the file itself: the pre-tokenized lines [i % 250, 7, 9] come
  // out in the order they were written.
  std::vector<int32_t> firsts, expected;
  for (int i = 2; i < 20000; i += 5) expected.push_back(i % 250);
  for (int64_t i = 0; i < d[1].size(); ++i) {
    const std::vector<int32_t> ids = d[1].ids(i).to_vector();
    if (ids.size() == 3 && ids[1] == 7 && ids[2] == 9) firsts.push_back(ids[0]);
  }
  CHECK(firsts == expected);
  REQUIRE(d[1].size() == d[0].size());
  for (int64_t i = 0; i < d[0].size(); ++i) {
    REQUIRE(d[1].ids(i).to_vector() == d[0].ids(i).to_vector());
    REQUIRE(d[1].labels(i).to_vector() == d[0].labels(i).to_vector());
  }
  // Without skip_bad_lines the first malformed line in file order is the error, both ways.
  o.skip_bad_lines = false;
  std::string message[2];
  for (int k = 0; k < 2; ++k) {
    ::setenv("ZT_CPU_THREADS", k == 0 ? "1" : "4", 1);
    try {
      tokenize_jsonl(path, *byte_tokenizer(), o);
    } catch (const ConfigError& e) {
      message[k] = e.what();
    }
  }
  ::unsetenv("ZT_CPU_THREADS");
  CHECK_THAT(message[0], Contains(path + ":4: "));
  CHECK(message[1] == message[0]);
}

TEST_CASE("missing, empty and unusable files and bad options are errors naming them", "[data]") {
  const std::string dir = test::temp_dir("files");
  CHECK_THROWS_MATCHES(tokenize_jsonl(dir + "/none.jsonl", *byte_tokenizer(), DataOptions()),
                       IoError, Has({dir + "/none.jsonl"}));
  for (const char* content : {"", "\n  \n\n"}) {
    const std::string path = data_file("empty", content);
    CHECK_THROWS_MATCHES(tokenize_jsonl(path, *byte_tokenizer(), DataOptions()), ConfigError,
                         Has({path, "empty"}));
  }
  const std::string path = data_file("ok", "{\"text\": \"a\"}\n");
  CHECK_THROWS_MATCHES(tokenize_jsonl(path, *byte_tokenizer(), with_template("vicuna")),
                       ConfigError, Has({"template", "vicuna"}));
  DataOptions zero;
  zero.max_length = 0;
  CHECK_THROWS_MATCHES(tokenize_jsonl(path, *byte_tokenizer(), zero), ConfigError,
                       Has({"max_length"}));
}

TEST_CASE("skip_bad_lines skips and counts malformed lines", "[data]") {
  const std::string content =
      "{\"text\": \"one\"}\n"
      "not json\n"
      "{\"text\": \"two\"}\n"
      "{\"input_ids\": [999]}\n"
      "{\"text\": \"three\"}\n";
  DataOptions o;
  o.skip_bad_lines = true;
  DatasetStats stats;
  LogCapture log;
  Dataset d = tokenize_text(content, o, &stats);
  CHECK(d.size() == 3);
  CHECK(stats.lines == 5);
  CHECK(stats.skipped_lines == 2);
  CHECK(stats.examples == 3);
  CHECK(log.contains("skipped 2 malformed line(s)"));
  CHECK(log.contains(":2: invalid JSON"));  // the first one, with its line

  const std::string all_bad = data_file("all-bad", "nope\n[]\n");
  CHECK_THROWS_MATCHES(tokenize_jsonl(all_bad, *byte_tokenizer(), o), ConfigError,
                       Has({all_bad, "2 skipped"}));
}

TEST_CASE("data_options_for copies the data options of the training arguments", "[data]") {
  TrainingArguments args;
  args.template_name = "chatml";
  args.max_length = 77;
  args.train_on_prompt = true;
  args.skip_bad_lines = true;
  DataOptions o = data_options_for(args);
  CHECK(o.template_name == "chatml");
  CHECK(o.max_length == 77);
  CHECK(o.train_on_prompt);
  CHECK(o.skip_bad_lines);
  // "auto" is resolved against the model folder by the trainer (resolve_template).
  CHECK(data_options_for(TrainingArguments()).template_name == "auto");
}

// ---- cache ---------------------------------------------------------------------------------

TEST_CASE("the token cache round-trips and is reused only for the same inputs", "[data]") {
  const std::string dir = test::temp_dir("cache");
  const std::string path = dir + "/train.jsonl";
  write_file(path,
             "{\"text\": \"a\"}\n{\"instruction\": \"i\", \"output\": \"o\"}\nbad line\n"
             "{\"input_ids\": [5, 6], \"labels\": [-100, 6]}\n");
  const std::string cache_dir = dir + "/cache";
  DataOptions o;
  o.skip_bad_lines = true;
  const Tokenizer& tok = *byte_tokenizer();

  DatasetStats fresh_stats;
  Dataset fresh = tokenize_jsonl(path, tok, o, &fresh_stats);

  SECTION("save_dataset / load_dataset") {
    save_dataset(fresh, dir + "/saved.safetensors", fresh_stats);
    DatasetStats loaded_stats;
    Dataset loaded = load_dataset(dir + "/saved.safetensors", &loaded_stats);
    CHECK(same_dataset(loaded, fresh));
    CHECK(loaded_stats.lines == fresh_stats.lines);
    CHECK(loaded_stats.skipped_lines == 1);
    CHECK(loaded_stats.examples == fresh_stats.examples);
    CHECK(loaded_stats.tokens == fresh_stats.tokens);

    Dataset packed = pack(fresh, 64, iota(fresh.size()));
    save_dataset(packed, dir + "/packed.safetensors");
    Dataset packed_back = load_dataset(dir + "/packed.safetensors");
    CHECK(packed_back.packed());
    CHECK(same_dataset(packed_back, packed));
  }

  SECTION("load_or_tokenize writes the cache once and then reads it") {
    const std::string file = dataset_cache_path(cache_dir, path, tok, o);
    CHECK(fs::path(file).parent_path() == fs::path(cache_dir));
    CHECK(fs::path(file).filename().string().rfind("train-", 0) == 0);
    CHECK_FALSE(fs::exists(file));
    DatasetStats stats;
    CHECK(same_dataset(load_or_tokenize(path, tok, o, cache_dir, &stats), fresh));
    CHECK(fs::exists(file));
    CHECK(stats.skipped_lines == 1);
    {
      LogCapture log;
      DatasetStats cached;
      CHECK(same_dataset(load_or_tokenize(path, tok, o, cache_dir, &cached), fresh));
      CHECK(log.contains("from the cache"));
      CHECK(cached.skipped_lines == 1);
      CHECK(cached.tokens == fresh_stats.tokens);
    }
    // No cache folder: plain tokenization.
    CHECK(same_dataset(load_or_tokenize(path, tok, o, "", nullptr), fresh));
  }

  SECTION("the cache key follows the file, the tokenizer and every option") {
    const std::string base = dataset_cache_path(cache_dir, path, tok, o);
    CHECK(dataset_cache_path(cache_dir, path, tok, o) == base);
    std::set<std::string> keys{base};
    DataOptions other = o;
    other.template_name = "chatml";
    keys.insert(dataset_cache_path(cache_dir, path, tok, other));
    other = o;
    other.max_length = 512;
    keys.insert(dataset_cache_path(cache_dir, path, tok, other));
    other = o;
    other.train_on_prompt = true;
    keys.insert(dataset_cache_path(cache_dir, path, tok, other));
    other = o;
    other.skip_bad_lines = false;
    keys.insert(dataset_cache_path(cache_dir, path, tok, other));
    keys.insert(dataset_cache_path(cache_dir, path, RenamedByteTokenizer(), o));
    other = o;
    other.completion_only_loss = false;
    keys.insert(dataset_cache_path(cache_dir, path, tok, other));
    other = o;
    other.assistant_only_loss = false;
    keys.insert(dataset_cache_path(cache_dir, path, tok, other));
    other = o;
    other.text_field = "content";
    keys.insert(dataset_cache_path(cache_dir, path, tok, other));
    CHECK(keys.size() == 9);
    // The key is the content's: a copy elsewhere (same name) reuses the tokens.
    const std::string copy = dir + "/copy/train.jsonl";
    fs::create_directories(dir + "/copy");
    fs::copy_file(path, copy);
    CHECK(dataset_cache_path(cache_dir, copy, tok, o) == base);

    // New content of another size, then of the same size with the same modification time.
    std::ofstream(path, std::ios::app) << "{\"text\": \"b\"}\n";
    const std::string grown = dataset_cache_path(cache_dir, path, tok, o);
    CHECK(keys.count(grown) == 0);
    const fs::file_time_type before = fs::last_write_time(path);
    std::ifstream in(path, std::ios::binary);
    std::string text(std::istreambuf_iterator<char>(in), {});
    in.close();
    text[text.find("\"b\"") + 1] = 'c';
    write_file(path, text);
    fs::last_write_time(path, before);
    CHECK(fs::file_size(path) == text.size());
    CHECK(dataset_cache_path(cache_dir, path, tok, o) != grown);

    CHECK_THROWS_MATCHES(dataset_cache_path(cache_dir, dir + "/none.jsonl", tok, o), IoError,
                         Has({dir + "/none.jsonl"}));
  }

  SECTION("a corrupt cache file is detected, and load_or_tokenize replaces it") {
    const std::string file = dataset_cache_path(cache_dir, path, tok, o);
    load_or_tokenize(path, tok, o, cache_dir);
    const auto size = fs::file_size(file);
    fs::resize_file(file, size - 3);
    CHECK_THROWS_MATCHES(load_dataset(file), IoError, Has({file}));
    {
      LogCapture log;
      CHECK(same_dataset(load_or_tokenize(path, tok, o, cache_dir), fresh));
      CHECK(log.contains("tokenizing again"));
    }
    CHECK(same_dataset(load_dataset(file), fresh));

    // Well-formed safetensors whose content is not a consistent dataset (in the format version
    // this build writes).
    const std::map<std::string, std::string> meta{
        {"format", "zerotrain-dataset"},
        {"version", SafetensorsFile(file).metadata().at("version")}};
    const at::Tensor ids = at::arange(4, at::kInt);
    const std::string bad = dir + "/bad.safetensors";
    save_safetensors(bad, {{"input_ids", ids}, {"labels", ids}, {"offsets", at::tensor({0L, 3L})}},
                     meta);
    CHECK_THROWS_MATCHES(load_dataset(bad), IoError, Has({bad, "offsets"}));
    save_safetensors(bad, {{"input_ids", ids}, {"offsets", at::tensor({0L, 4L})}}, meta);
    CHECK_THROWS_MATCHES(load_dataset(bad), IoError, Has({bad, "labels"}));
    save_safetensors(
        bad, {{"input_ids", ids}, {"labels", ids.to(at::kLong)}, {"offsets", at::tensor({0L, 4L})}},
        meta);
    CHECK_THROWS_MATCHES(load_dataset(bad), IoError, Has({bad, "labels"}));
    save_safetensors(bad, {{"input_ids", ids}, {"labels", ids}, {"offsets", at::tensor({0L, 4L})}},
                     {{"format", "pt"}});
    CHECK_THROWS_MATCHES(load_dataset(bad), IoError, Has({bad, "format"}));
    save_safetensors(bad,
                     {{"input_ids", ids},
                      {"labels", at::full({4}, -7, at::kInt)},
                      {"offsets", at::tensor({0L, 4L})}},
                     meta);
    CHECK_THROWS_MATCHES(load_dataset(bad), IoError, Has({bad, "labels"}));
    CHECK_THROWS_MATCHES(load_dataset(dir + "/none.safetensors"), IoError,
                         Has({dir + "/none.safetensors"}));

    // Ids the model's embedding has no row for: refused with the limit, and a cache file holding
    // them under the right key is replaced, never trained on.
    const at::Tensor far = at::tensor({5, 900, 7, 8}, at::kInt);
    save_safetensors(bad, {{"input_ids", far}, {"labels", ids}, {"offsets", at::tensor({0L, 4L})}},
                     meta);
    CHECK_NOTHROW(load_dataset(bad));
    CHECK_THROWS_MATCHES(load_dataset(bad, nullptr, tok.vocab_size()), IoError,
                         Has({bad, "input id 900 at position 1", "vocabulary"}));
    save_safetensors(bad, {{"input_ids", ids}, {"labels", far}, {"offsets", at::tensor({0L, 4L})}},
                     meta);
    CHECK_THROWS_MATCHES(load_dataset(bad, nullptr, tok.vocab_size()), IoError,
                         Has({bad, "label 900"}));
    std::map<std::string, std::string> forged = meta;
    forged["key"] = SafetensorsFile(file).metadata().at("key");
    for (const char* stat : {"lines", "examples", "skipped_lines", "dropped_examples", "tokens"})
      forged[stat] = "0";
    save_safetensors(file, {{"input_ids", far}, {"labels", ids}, {"offsets", at::tensor({0L, 4L})}},
                     forged);
    LogCapture log;
    CHECK(same_dataset(load_or_tokenize(path, tok, o, cache_dir), fresh));
    CHECK(log.contains("outside the vocabulary"));
  }
}

// ---- batches -------------------------------------------------------------------------------

TEST_CASE("collate pads right and masks padding", "[data]") {
  Dataset d;
  d.add({1, 2, 3}, {kIgnoreLabel, 2, 3});
  d.add({4, 5, 6, 7, 8}, {4, 5, kIgnoreLabel, 7, 8});
  d.add({9}, {9});
  const std::vector<int64_t> indices{2, 0, 1};
  Batch b = collate(d, indices, 258);
  REQUIRE(b.input_ids.sizes() == at::IntArrayRef({3, 5}));
  for (const at::Tensor& t : {b.input_ids, b.labels, b.attention_mask}) {
    CHECK(t.scalar_type() == at::kLong);
    CHECK(t.sizes() == b.input_ids.sizes());
  }
  CHECK_FALSE(b.position_ids.defined());
  CHECK_FALSE(b.document_ids.defined());
  int64_t targets = 0;
  for (int64_t r = 0; r < 3; ++r) {
    const TokenView ids = d.ids(indices[r]);
    const TokenView labels = d.labels(indices[r]);
    for (int64_t t = 0; t < 5; ++t) {
      const bool real = t < ids.size;
      CHECK(b.input_ids[r][t].item<int64_t>() == (real ? ids[t] : 258));
      CHECK(b.labels[r][t].item<int64_t>() == (real ? labels[t] : kIgnoreLabel));
      CHECK(b.attention_mask[r][t].item<int64_t>() == (real ? 1 : 0));
      if (real && labels[t] != kIgnoreLabel) ++targets;
    }
  }
  CHECK(b.target_tokens == targets);
  CHECK(b.target_tokens == (b.labels != kIgnoreLabel).sum().item<int64_t>());

  Batch empty = collate(d, {}, 258);
  CHECK(empty.input_ids.sizes() == at::IntArrayRef({0, 0}));
  CHECK(empty.labels.sizes() == at::IntArrayRef({0, 0}));
  CHECK(empty.attention_mask.sizes() == at::IntArrayRef({0, 0}));
  CHECK(empty.target_tokens == 0);

  CHECK_THROWS_AS(collate(d, {0, 3}, 258), InvalidArgument);
  CHECK_THROWS_AS(collate(d, {0}, -1), InvalidArgument);
  CHECK_THROWS_AS(d.add({1}, {1, 2}), InvalidArgument);
  CHECK_THROWS_AS(d.add({}, {}), InvalidArgument);
  CHECK_THROWS_AS(d.ids(-1), InvalidArgument);
}

TEST_CASE("packing keeps examples whole, in order, and marks document boundaries", "[data]") {
  // Example i has tokens 100·i + t, so every packed token can be traced back.
  const std::vector<int64_t> lengths{3, 4, 2, 5, 1, 6, 8, 2, 7, 3};
  Dataset d;
  for (size_t i = 0; i < lengths.size(); ++i) {
    std::vector<int32_t> ids;
    for (int64_t t = 0; t < lengths[i]; ++t) ids.push_back(static_cast<int32_t>(100 * i + t));
    d.add(ids, ids);
  }
  const int64_t max_length = 8;
  const std::vector<int64_t> order = epoch_order(d.size(), 7, 0, true);
  Dataset p = pack(d, max_length, order);
  REQUIRE(p.packed());
  CHECK(p.total_tokens() == d.total_tokens());

  std::vector<int64_t> seen;  // examples in the order the packed documents hold them
  for (int64_t s = 0; s < p.size(); ++s) {
    INFO("sequence " << s);
    CHECK(p.length(s) <= max_length);
    int64_t t = 0;
    for (int64_t doc : p.document_lengths(s)) {
      const int64_t example = p.ids(s)[t] / 100;
      REQUIRE(d.length(example) == doc);  // whole: the document is the entire example
      for (int64_t k = 0; k < doc; ++k) {
        CHECK(p.ids(s)[t + k] == d.ids(example)[k]);
        CHECK(p.labels(s)[t + k] == (k == 0 ? kIgnoreLabel : d.labels(example)[k]));
      }
      seen.push_back(example);
      t += doc;
    }
    CHECK(t == p.length(s));
    // Greedy: the next sequence's first example did not fit into this one.
    if (s + 1 < p.size()) CHECK(p.length(s) + p.document_lengths(s + 1).front() > max_length);
  }
  CHECK(seen == order);

  std::vector<int64_t> rows = iota(p.size());
  Batch b = collate(p, rows, 0);
  REQUIRE(b.position_ids.defined());
  REQUIRE(b.document_ids.defined());
  for (int64_t r = 0; r < p.size(); ++r) {
    int64_t t = 0;
    int64_t doc_index = 0;
    for (int64_t doc : p.document_lengths(r)) {
      for (int64_t k = 0; k < doc; ++k, ++t) {
        CHECK(b.position_ids[r][t].item<int64_t>() == k);
        CHECK(b.document_ids[r][t].item<int64_t>() == doc_index);
      }
      ++doc_index;
    }
    for (; t < b.input_ids.size(1); ++t) {
      CHECK(b.document_ids[r][t].item<int64_t>() == -1);
      CHECK(b.attention_mask[r][t].item<int64_t>() == 0);
      CHECK(b.labels[r][t].item<int64_t>() == kIgnoreLabel);
    }
  }
  CHECK(b.target_tokens == (b.labels != kIgnoreLabel).sum().item<int64_t>());

  CHECK_THROWS_AS(pack(d, 7, order), InvalidArgument);  // example 6 has 8 tokens
  CHECK_THROWS_AS(pack(p, 8, {0}), InvalidArgument);
  CHECK_THROWS_AS(pack(d, 8, {0, 10}), InvalidArgument);
  CHECK_THROWS_AS(p.add({1}, {1}), InvalidArgument);
}

// ---- sampling ------------------------------------------------------------------------------

TEST_CASE("epoch orders are seeded permutations, pinned across platforms", "[data]") {
  for (int64_t n : {0, 1, 2, 17, 1000}) {
    INFO(n);
    CHECK(sorted(epoch_order(n, 42, 3, true)) == iota(n));
    CHECK(epoch_order(n, 42, 3, false) == iota(n));
    CHECK(epoch_order(n, 42, 3, true) == epoch_order(n, 42, 3, true));
  }
  CHECK(epoch_order(1000, 42, 0, true) != epoch_order(1000, 42, 1, true));
  CHECK(epoch_order(1000, 42, 0, true) != epoch_order(1000, 43, 0, true));
  CHECK(epoch_order(1000, 42, 0, true) != iota(1000));
  // splitmix64 seeded with seed + epoch driving Fisher–Yates with rejection sampling, as
  // docs/data.md describes, computed independently in Python. A change here reorders every run.
  CHECK(epoch_order(10, 42, 0, true) == std::vector<int64_t>{0, 9, 5, 8, 6, 4, 7, 2, 1, 3});
  CHECK(epoch_order(10, 42, 1, true) == std::vector<int64_t>{4, 2, 5, 6, 1, 3, 9, 8, 7, 0});
  CHECK(epoch_order(12, UINT64_MAX, 1, true) ==
        std::vector<int64_t>{4, 1, 6, 8, 0, 5, 2, 3, 11, 9, 10, 7});
}

TEST_CASE("length grouping sorts megabatches and puts the longest first", "[data]") {
  const int64_t n = 203;
  const int64_t megabatch = 16;
  std::vector<int64_t> lengths(n);
  for (int64_t i = 0; i < n; ++i) lengths[i] = (i * 37) % 23 + 1;
  lengths[150] = 100;  // one clear longest example, away from the start
  const std::vector<int64_t> base = epoch_order(n, 5, 2, true);
  const std::vector<int64_t> grouped = epoch_order(n, 5, 2, true, &lengths, megabatch);
  CHECK(sorted(grouped) == iota(n));
  CHECK(grouped == epoch_order(n, 5, 2, true, &lengths, megabatch));
  CHECK(lengths[grouped[0]] == 100);

  // Each megabatch holds its slice of the plain order, sorted by length, longest first, ties in
  // plain order — except that HF swaps the longest example (in the megabatch starting at `m`)
  // with the first element of megabatch 0.
  std::vector<int64_t> base_position(n);
  for (int64_t p = 0; p < n; ++p) base_position[base[p]] = p;
  const int64_t m = base_position[150] / megabatch * megabatch;
  REQUIRE(m != 0);  // the seed puts the longest example outside megabatch 0, so the swap happens
  for (int64_t p = 0; p < n; ++p) {
    INFO("position " << p);
    const bool moved = p == 0 || p == m;
    CHECK((base_position[grouped[p]] / megabatch == p / megabatch) != moved);
    const bool sorted_pair = p % megabatch != 0 && p - 1 != m && !moved;
    if (sorted_pair) {
      const int64_t a = grouped[p - 1];
      const int64_t b = grouped[p];
      CHECK(lengths[a] >= lengths[b]);
      if (lengths[a] == lengths[b]) CHECK(base_position[a] < base_position[b]);
    }
  }
  // What moved to m is the longest of megabatch 0.
  for (int64_t p = 0; p < megabatch; ++p) CHECK(lengths[grouped[m]] >= lengths[base[p]]);

  // HF's megabatch size: min(n / (4·G), 50)·G, at least G.
  CHECK(length_megabatch(10, 8) == 8);
  CHECK(length_megabatch(320, 8) == 80);
  CHECK(length_megabatch(1000000, 8) == 400);
  CHECK_THROWS_AS(epoch_order(n, 5, 2, true, &lengths, 0), InvalidArgument);
  std::vector<int64_t> short_lengths(3, 1);
  CHECK_THROWS_AS(epoch_order(n, 5, 2, true, &short_lengths, 4), InvalidArgument);
}

TEST_CASE("a step uses the same samples for world 1, 2 and 4 with the global batch fixed",
          "[data]") {
  const int64_t n = 37;
  const std::vector<int64_t> order = epoch_order(n, 1234, 0, true);
  const GlobalBatch layouts[] = {{2, 4, 1}, {4, 2, 1}, {2, 2, 2}, {1, 4, 2}, {2, 1, 4}, {1, 2, 4}};
  const int64_t G = 8;
  for (bool drop_last : {false, true}) {
    INFO("drop_last " << drop_last);
    const int64_t steps = steps_per_epoch(n, G, drop_last);
    if (drop_last) {
      CHECK(steps * G <= n);
      CHECK(n < (steps + 1) * G);
    } else {
      CHECK((steps - 1) * G < n);
      CHECK(n <= steps * G);
    }
    std::multiset<int64_t> epoch;
    for (int64_t s = 0; s < steps; ++s) {
      // Order positions [s·G, (s + 1)·G), wrapping around to the start of the order.
      std::vector<int64_t> want;
      for (int64_t p = s * G; p < (s + 1) * G; ++p) want.push_back(order[p % n]);
      for (const GlobalBatch& g : layouts) {
        INFO("step " << s << ", micro " << g.micro_batch << " × accumulation " << g.accumulation
                     << " × world " << g.world);
        REQUIRE(g.size() == G);
        std::vector<int64_t> got;
        for (int64_t a = 0; a < g.accumulation; ++a) {
          for (int64_t r = 0; r < g.world; ++r) {
            std::vector<int64_t> micro = micro_batch_indices(order, g, s, a, r);
            CHECK(static_cast<int64_t>(micro.size()) == g.micro_batch);
            got.insert(got.end(), micro.begin(), micro.end());
          }
        }
        CHECK(sorted(got) == sorted(want));
      }
      epoch.insert(want.begin(), want.end());
    }
    if (drop_last) {
      // No wrap-around: distinct examples, the 5 left over unused.
      CHECK(static_cast<int64_t>(std::set<int64_t>(epoch.begin(), epoch.end()).size()) ==
            steps * G);
    } else {
      // Every example once; the padding repeats the start of the order.
      for (int64_t p = 0; p < n; ++p) {
        CHECK(epoch.count(order[p]) == (p < steps * G - n ? 2u : 1u));
      }
    }
  }
  // Past the epoch (the incomplete step exists only without drop_last; the caller stops first).
  CHECK_THROWS_AS(micro_batch_indices(order, layouts[0], steps_per_epoch(n, G, false), 0, 0),
                  InvalidArgument);
  CHECK_THROWS_AS(micro_batch_indices(order, {2, 2, 2}, 0, 2, 0), InvalidArgument);
  CHECK_THROWS_AS(micro_batch_indices(order, {2, 2, 2}, 0, 0, 2), InvalidArgument);
  CHECK_THROWS_AS(micro_batch_indices(order, {2, 2, 2}, -1, 0, 0), InvalidArgument);
  CHECK(steps_per_epoch(0, 8, false) == 0);
}

TEST_CASE("eval batches cover every example once with the same count on every rank", "[data]") {
  for (int64_t n : {0, 1, 7, 16, 17, 50}) {
    for (int64_t world : {1, 2, 3, 4}) {
      for (int64_t batch_size : {1, 3, 8}) {
        INFO("n " << n << ", world " << world << ", batch_size " << batch_size);
        const size_t count = (n + world * batch_size - 1) / (world * batch_size);
        std::vector<int64_t> all;
        for (int64_t rank = 0; rank < world; ++rank) {
          auto batches = eval_batches(n, world, rank, batch_size);
          CHECK(batches.size() == count);
          for (const auto& batch : batches) {
            CHECK(static_cast<int64_t>(batch.size()) <= batch_size);
            all.insert(all.end(), batch.begin(), batch.end());
          }
        }
        CHECK(sorted(all) == iota(n));
      }
    }
  }
  CHECK_THROWS_AS(eval_batches(10, 2, 2, 4), InvalidArgument);
  CHECK_THROWS_AS(eval_batches(10, 2, 0, 0), InvalidArgument);
}
