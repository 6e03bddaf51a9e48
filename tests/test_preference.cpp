// Preference training: pairs tokenized from TRL's and LLaMA-Factory's layouts with the prompt
// masked and bad pairs counted; per-token log-probabilities with per-token gradients; the
// reference as the model with its adapters off; the losses, metrics and gradients of the
// Python reference (tests/tools/make_preference_fixtures.py: TRL's and LLaMA-Factory's formulas
// over transformers + PEFT); and DPO runs that train the same at world 1, 2 and 4.
#include <fmt/format.h>
#include <rapidjson/document.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "support/catch.hpp"
#include "support/jobs.hpp"
#include "support/messages.hpp"
#include "support/preference_fixtures.hpp"
#include "support/ranks.hpp"
#include "train/preference.hpp"
#include "util/files.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/model.hpp"
#include "zerotrain/peft.hpp"
#include "zerotrain/safetensors.hpp"
#include "zerotrain/tokenizer.hpp"
#include "zerotrain/trainer.hpp"

using namespace zt;
using Catch::Contains;
using test::fixture_model;
namespace fs = std::filesystem;

namespace {

std::string fixture(const std::string& rel) {
  return std::string(ZT_FIXTURES) + "/" + rel;
}

std::vector<int32_t> ids_of(const Dataset& d, int64_t i) {
  return d.ids(i).to_vector();
}

// The answer part of example i: the ids whose labels count.
std::vector<int32_t> scored(const Dataset& d, int64_t i) {
  std::vector<int32_t> out;
  for (int64_t t = 0; t < d.length(i); ++t) {
    if (d.labels(i)[t] != kIgnoreLabel) out.push_back(d.labels(i)[t]);
  }
  return out;
}

int64_t prompt_length(const Dataset& d, int64_t i) {
  int64_t n = 0;
  while (n < d.length(i) && d.labels(i)[n] == kIgnoreLabel) ++n;
  return n;
}

std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST_CASE("preference pairs from TRL's and LLaMA-Factory's layouts: prompt masked, answers scored",
          "[preference][data]") {
  auto tok = load_tokenizer(fixture("tokenizers/qwen2"), 1 << 30);
  const std::string dir = test::temp_dir("pref-data");
  DataOptions o;
  o.preference = true;
  o.template_name = "chatml";
  o.max_length = 512;
  const int32_t eos = tok->eos_id();

  SECTION("TRL's standard form: prompt + answer encoded as one text, eos after") {
    files::write_atomic(dir + "/std.jsonl",
                        R"({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."})"
                        "\n");
    Dataset d = tokenize_preference_jsonl(dir + "/std.jsonl", *tok, o);
    REQUIRE(d.size() == 2);
    std::vector<int32_t> prompt = cat(tok->prefix_ids(), tok->encode("The sky is"));
    std::vector<int32_t> chosen =
        cat(cat(tok->prefix_ids(), tok->encode("The sky is blue.")), {eos});
    std::vector<int32_t> rejected =
        cat(cat(tok->prefix_ids(), tok->encode("The sky is green.")), {eos});
    CHECK(ids_of(d, 0) == chosen);
    CHECK(ids_of(d, 1) == rejected);
    CHECK(prompt_length(d, 0) == static_cast<int64_t>(prompt.size()));
    CHECK(scored(d, 0) ==
          std::vector<int32_t>(chosen.begin() + static_cast<long>(prompt.size()), chosen.end()));
    // The implicit-prompt form (only chosen and rejected) splits at their common start, the
    // space staying with the answers: the same pair.
    files::write_atomic(dir + "/implicit.jsonl",
                        R"({"chosen": "The sky is blue.", "rejected": "The sky is green."})"
                        "\n");
    Dataset implicit = tokenize_preference_jsonl(dir + "/implicit.jsonl", *tok, o);
    CHECK(implicit.flat_ids() == d.flat_ids());
    CHECK(implicit.flat_labels() == d.flat_labels());
  }

  SECTION("chat layouts: each sequence is the SFT conversation with only its last answer scored") {
    // The same conversation as SFT data tokenizes it, through the template.
    files::write_atomic(
        dir + "/sft.jsonl",
        R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, )"
        R"({"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sky colour?"}, )"
        R"({"role": "assistant", "content": "Blue."}]})"
        "\n"
        R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, )"
        R"({"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sky colour?"}, )"
        R"({"role": "assistant", "content": "Green."}]})"
        "\n");
    DataOptions sft = o;
    sft.preference = false;
    const Dataset want = tokenize_jsonl(dir + "/sft.jsonl", *tok, sft);
    const std::vector<std::string> layouts = {
        // TRL's conversational form
        R"({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, )"
        R"({"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sky colour?"}], )"
        R"("chosen": [{"role": "assistant", "content": "Blue."}], "rejected": [{"role": "assistant", "content": "Green."}]})",
        // TRL's implicit prompt in messages
        R"({"chosen": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, )"
        R"({"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sky colour?"}, )"
        R"({"role": "assistant", "content": "Blue."}], "rejected": [{"role": "system", "content": "Be brief."}, )"
        R"({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, )"
        R"({"role": "user", "content": "Sky colour?"}, {"role": "assistant", "content": "Green."}]})",
        // LLaMA-Factory's sharegpt
        R"({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}, )"
        R"({"from": "human", "value": "Sky colour?"}], "system": "Be brief.", )"
        R"("chosen": {"from": "gpt", "value": "Blue."}, "rejected": {"from": "gpt", "value": "Green."}})",
        // LLaMA-Factory's alpaca
        R"({"system": "Be brief.", "history": [["Hi", "Hello."]], "instruction": "Sky colour?", )"
        R"("input": "", "chosen": "Blue.", "rejected": "Green."})"};
    for (const std::string& line : layouts) {
      INFO(line);
      files::write_atomic(dir + "/chat.jsonl", line + "\n");
      Dataset d = tokenize_preference_jsonl(dir + "/chat.jsonl", *tok, o);
      REQUIRE(d.size() == 2);
      for (int64_t k = 0; k < 2; ++k) {
        CHECK(ids_of(d, k) == ids_of(want, k));
        // The last reply (and its end of turn) is scored, the earlier one is prompt.
        const std::vector<int32_t> all = scored(want, k), answer = scored(d, k);
        REQUIRE(!answer.empty());
        CHECK(answer.size() < all.size());
        CHECK(std::equal(answer.rbegin(), answer.rend(), all.rbegin()));
        CHECK(answer.front() == tok->encode(k == 0 ? "Blue." : "Green.").front());
      }
    }
  }

  SECTION("pairs no loss learns from are dropped and counted, with one warning") {
    files::write_atomic(dir + "/bad.jsonl",
                        R"({"prompt": "Q", "chosen": " same", "rejected": " same"})"
                        "\n"
                        R"({"prompt": "Q", "chosen": "", "rejected": " no"})"
                        "\n"
                        R"({"prompt": "Q", "chosen": " yes", "rejected": ""})"
                        "\n" +
                            fmt::format(R"({{"prompt": "{}", "chosen": " a", "rejected": " b"}})",
                                        std::string(600, 'x')) +
                            "\n"
                            R"({"prompt": "Q", "chosen": " yes", "rejected": " no"})"
                            "\n");
    test::LogCapture log;
    DatasetStats stats;
    Dataset d = tokenize_preference_jsonl(dir + "/bad.jsonl", *tok, o, &stats);
    CHECK(d.size() == 2);
    CHECK(stats.identical_pairs == 1);
    CHECK(stats.empty_answers == 2);
    CHECK(stats.long_prompts == 1);
    CHECK(log.contains("dropped 4 of 5 preference pair(s)"));
    // A conversation whose last prompt alone fills max_length is dropped too — never trained on
    // an earlier reply in place of the answer cut away.
    files::write_atomic(
        dir + "/turns.jsonl",
        fmt::format(
            R"({{"conversations": [{{"from": "human", "value": "Hi"}}, {{"from": "gpt", )"
            R"("value": "Hello."}}, {{"from": "human", "value": "{}"}}], "chosen": )"
            R"({{"from": "gpt", "value": "a"}}, "rejected": {{"from": "gpt", "value": "b"}}}})"
            "\n"
            R"({{"prompt": "Q", "chosen": " yes", "rejected": " no"}})"
            "\n",
            std::string(600, 'x')));
    DatasetStats turn_stats;
    Dataset turns = tokenize_preference_jsonl(dir + "/turns.jsonl", *tok, o, &turn_stats);
    CHECK(turn_stats.long_prompts == 1);
    CHECK(turns.size() == 2);
    // Answers that only differ past what truncation keeps are the same pair once cut.
    DataOptions short_o = o;
    short_o.max_length =
        static_cast<int64_t>(tok->prefix_ids().size() + tok->encode("Q").size()) + 1;
    files::write_atomic(dir + "/cut.jsonl",
                        R"({"prompt": "Q", "chosen": " yes indeed", "rejected": " yes no"})"
                        "\n"
                        R"({"prompt": "Q", "chosen": " yes", "rejected": " no"})"
                        "\n");
    DatasetStats cut_stats;
    Dataset cut = tokenize_preference_jsonl(dir + "/cut.jsonl", *tok, short_o, &cut_stats);
    CHECK(cut_stats.cut_identical_pairs == 1);
    CHECK(cut_stats.identical_pairs == 0);
    CHECK(cut.size() == 2);
    // Nothing usable: an error that says why.
    files::write_atomic(dir + "/none.jsonl",
                        R"({"prompt": "Q", "chosen": " same", "rejected": " same"})"
                        "\n");
    CHECK_THROWS_WITH(tokenize_preference_jsonl(dir + "/none.jsonl", *tok, o),
                      Contains("none.jsonl") && Contains("1 with identical"));
  }

  SECTION("TRL's truncation: keep_start, keep_end and max_prompt_length") {
    files::write_atomic(
        dir + "/long.jsonl",
        R"({"prompt": "one two three four five six", "chosen": " seven eight nine ten", )"
        R"("rejected": " eleven twelve"})"
        "\n");
    DataOptions whole = o;
    const Dataset full = tokenize_preference_jsonl(dir + "/long.jsonl", *tok, whole);
    const std::vector<int32_t> chosen = ids_of(full, 0);
    const int64_t prompt = prompt_length(full, 0);
    REQUIRE(prompt > 3);
    DataOptions start = o;
    start.max_length = prompt + 2;
    Dataset s = tokenize_preference_jsonl(dir + "/long.jsonl", *tok, start);
    CHECK(ids_of(s, 0) == std::vector<int32_t>(chosen.begin(), chosen.begin() + prompt + 2));
    DataOptions end = o;
    end.truncation_mode = "keep_end";
    end.max_length = 4;
    Dataset e = tokenize_preference_jsonl(dir + "/long.jsonl", *tok, end);
    CHECK(ids_of(e, 0) == std::vector<int32_t>(chosen.end() - 4, chosen.end()));
    DataOptions kept_prompt = o;
    kept_prompt.max_prompt_length = 2;
    Dataset p = tokenize_preference_jsonl(dir + "/long.jsonl", *tok, kept_prompt);
    CHECK(prompt_length(p, 0) == 2);
    CHECK(ids_of(p, 0) == std::vector<int32_t>(chosen.begin() + prompt - 2, chosen.end()));
  }

  SECTION("malformed records name the file, line and key") {
    const std::vector<std::pair<std::string, std::string>> bad = {
        {R"({"prompt": "Q", "chosen": " a"})", "rejected"},
        {R"({"prompt": "Q", "chosen": 3, "rejected": " b"})", "chosen"},
        {R"({"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "user", "content": "a"}], "rejected": " b"})",
         "role"},
        {R"({"prompt": [{"role": "user", "content": "Q"}], "chosen": [], "rejected": " b"})",
         "chosen"},
        {R"({"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}], "chosen": {"from": "gpt", "value": "a"}, "rejected": {"from": "gpt", "value": "b"}})",
         "conversations"},
        {R"({"instruction": 5, "chosen": "a", "rejected": "b"})", "instruction"},
        {R"([1, 2])", "object"},
    };
    for (const auto& [line, key] : bad) {
      INFO(line);
      files::write_atomic(dir + "/bad.jsonl", R"({"prompt": "Q", "chosen": " y", "rejected": " n"})"
                                              "\n" +
                                                  line + "\n");
      CHECK_THROWS_WITH(tokenize_preference_jsonl(dir + "/bad.jsonl", *tok, o),
                        Contains("bad.jsonl:2") && Contains(key));
    }
  }
}

TEST_CASE("each dropped pair or KTO record is counted under what dropped it, in its own units",
          "[preference][data][counts]") {
  auto tok = load_tokenizer(fixture("tokenizers/qwen2"), 1 << 30);
  const std::string dir = test::temp_dir("pref-counts");
  DataOptions o;
  o.preference = true;
  o.template_name = "chatml";
  o.max_length = 512;
  const std::string kept = R"({"prompt": "Q", "chosen": " yes", "rejected": " no"})";

  SECTION("before the cut: identical or empty answers; after it: what max_length did") {
    files::write_atomic(dir + "/pairs.jsonl",
                        kept + "\n" +
                            R"({"prompt": "Q", "chosen": " same", "rejected": " same"})"
                            "\n"
                            R"({"prompt": "Q", "chosen": " yes indeed", "rejected": " yes no"})"
                            "\n"
                            R"({"prompt": "Q", "chosen": "", "rejected": " no"})"
                            "\n");
    // 1 token past the prompt: " yes indeed" and " yes no" both keep " yes".
    DataOptions cut = o;
    cut.max_length = static_cast<int64_t>(tok->encode("Q").size()) + 1;
    DatasetStats stats;
    test::LogCapture log;
    const Dataset d = tokenize_preference_jsonl(dir + "/pairs.jsonl", *tok, cut, &stats);
    CHECK(d.size() == 2);
    CHECK(stats.examples == 2);  // sequences: 1 pair
    CHECK(stats.dropped_examples == 6);
    CHECK(stats.identical_pairs == 1);
    CHECK(stats.cut_identical_pairs == 1);
    CHECK(stats.empty_answers == 1);
    CHECK(stats.long_prompts == 0);
    CHECK(log.contains(fmt::format(
        "dropped 3 of 4 preference pair(s), which no loss can learn from: 1 with identical "
        "chosen and rejected answers, 1 with an empty answer, 1 whose answers max_length {} cuts "
        "to the same sequence",
        cut.max_length)));

    // keep_end: answers that differ only in what the cut takes from their start.
    files::write_atomic(dir + "/ends.jsonl",
                        kept + "\n" +
                            R"({"prompt": "Q", "chosen": " yes indeed", "rejected": " no indeed"})"
                            "\n");
    DataOptions end = o;
    end.truncation_mode = "keep_end";
    end.max_length = static_cast<int64_t>(tok->encode(" indeed").size()) + 1;  // and eos
    DatasetStats end_stats;
    tokenize_preference_jsonl(dir + "/ends.jsonl", *tok, end, &end_stats);
    CHECK(end_stats.cut_identical_pairs == 1);
    CHECK(end_stats.identical_pairs == 0);
  }

  SECTION("keep_end leaving no answer token is counted apart from a prompt filling max_length") {
    // llama3_original writes the next assistant header after the answer: its last tokens.
    auto llama = load_tokenizer(fixture("tokenizers/llama3"), 1 << 30);
    files::write_atomic(
        dir + "/chat.jsonl",
        R"({"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "assistant", "content": "yes"}], )"
        R"("rejected": [{"role": "assistant", "content": "no"}]})"
        "\n");
    DataOptions end = o;
    end.template_name = "llama3_original";
    end.truncation_mode = "keep_end";
    end.max_length = 2;
    DatasetStats stats;
    CHECK_THROWS_WITH(tokenize_preference_jsonl(dir + "/chat.jsonl", *llama, end, &stats),
                      Contains("1 whose last 2 tokens (keep_end) hold no answer token"));
    DataOptions start = end;
    start.truncation_mode = "keep_start";
    CHECK_THROWS_WITH(tokenize_preference_jsonl(dir + "/chat.jsonl", *llama, start),
                      Contains("1 whose prompt alone fills max_length 2"));
  }

  SECTION("KTO: records dropped, with the examples they held") {
    o.kto = true;
    files::write_atomic(dir + "/kto.jsonl",
                        R"({"prompt": "Hi", "completion": " there", "label": true})"
                        "\n"
                        R"({"prompt": "Q", "chosen": " same", "rejected": " same"})"
                        "\n"
                        R"({"prompt": "Hi", "completion": "", "label": false})"
                        "\n");
    DatasetStats stats;
    test::LogCapture log;
    const Dataset d = tokenize_preference_jsonl(dir + "/kto.jsonl", *tok, o, &stats);
    CHECK(d.size() == 2);  // 1 example and its KL sequence
    CHECK(stats.examples == 2);
    CHECK(stats.dropped_examples == 6);  // 3 examples, each with its KL sequence
    CHECK(
        log.contains("dropped 2 of 3 KTO record(s) (3 KTO examples), which no loss can learn "
                     "from: 1 with identical chosen and rejected answers, 1 with an empty "
                     "answer"));
  }
}

TEST_CASE(
    "KTO's unpaired examples from TRL's and LLaMA-Factory's layouts, each with its KL sequence",
    "[preference][data]") {
  auto tok = load_tokenizer(fixture("tokenizers/qwen2"), 1 << 30);
  const std::string dir = test::temp_dir("kto-data");
  DataOptions o;
  o.preference = true;
  o.kto = true;
  o.template_name = "chatml";
  o.max_length = 512;
  DataOptions pairs = o;
  pairs.kto = false;

  SECTION("each layout gives the sequence a pair's answer gives, with its label") {
    // The same conversation in every layout; a pair of it tokenizes the two answers (the pair
    // layouts are checked against SFT tokenization above).
    files::write_atomic(
        dir + "/pair.jsonl",
        R"({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sky colour?"}], )"
        R"("chosen": [{"role": "assistant", "content": "Blue."}], "rejected": [{"role": "assistant", "content": "Green."}]})"
        "\n");
    const Dataset want = tokenize_preference_jsonl(dir + "/pair.jsonl", *tok, pairs);
    REQUIRE(want.size() == 2);
    CHECK(want.desirable().empty());
    const std::string records =
        // TRL's conversational unpaired record
        R"({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sky colour?"}], )"
        R"("completion": [{"role": "assistant", "content": "Blue."}], "label": true})"
        "\n"
        // LLaMA-Factory's messages with a label
        R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sky colour?"}, )"
        R"({"role": "assistant", "content": "Green."}], "label": false})"
        "\n"
        // LLaMA-Factory's sharegpt with kto_tag
        R"({"conversations": [{"from": "human", "value": "Sky colour?"}, {"from": "gpt", "value": "Blue."}], )"
        R"("system": "Be brief.", "kto_tag": true})"
        "\n"
        // alpaca with its output
        R"({"system": "Be brief.", "instruction": "Sky colour?", "input": "", "output": "Green.", "label": false})"
        "\n"
        // a pair: two examples, chosen desirable (TRL's unpair_preference_dataset)
        + files::read_text(dir + "/pair.jsonl");
    files::write_atomic(dir + "/kto.jsonl", records);
    const Dataset d = tokenize_preference_jsonl(dir + "/kto.jsonl", *tok, o);
    REQUIRE(d.size() == 12);                             // 6 examples, each with its KL sequence
    const std::vector<int> answer = {0, 1, 0, 1, 0, 1};  // want's row: chosen 0, rejected 1
    std::vector<uint8_t> labels;
    for (size_t i = 0; i < answer.size(); ++i) {
      INFO("example " << i);
      CHECK(ids_of(d, 2 * static_cast<int64_t>(i)) == ids_of(want, answer[i]));
      CHECK(d.labels(2 * static_cast<int64_t>(i)).to_vector() ==
            want.labels(answer[i]).to_vector());
      labels.insert(labels.end(), 2, answer[i] == 0 ? 1 : 0);
    }
    CHECK(d.desirable() == labels);
  }

  SECTION(
      "the KL sequence: the prompt with the completion of the example before, cut as the "
      "sequences are") {
    files::write_atomic(
        dir + "/text.jsonl",
        R"({"prompt": "The sky is", "completion": " blue.", "label": true})"
        "\n"
        R"({"prompt": "Fresh grass in spring is", "completion": " green.", "label": false})"
        "\n"
        R"({"prompt": "Snow is", "completion": " white and cold.", "label": true})"
        "\n");
    // Whole, then cut to 2 tokens past the longest prompt (every example keeps an answer token,
    // the longer sequences lose their ends).
    const Dataset whole = tokenize_preference_jsonl(dir + "/text.jsonl", *tok, o);
    int64_t longest_prompt = 0, longest = 0;
    for (int64_t i = 0; i < whole.size(); ++i) {
      longest_prompt = std::max(longest_prompt, prompt_length(whole, i));
      longest = std::max(longest, whole.length(i));
    }
    REQUIRE(longest > longest_prompt + 2);
    for (int64_t max_length : {o.max_length, longest_prompt + 2}) {
      INFO("max_length " << max_length);
      DataOptions cut = o;
      cut.max_length = max_length;
      const Dataset d = tokenize_preference_jsonl(dir + "/text.jsonl", *tok, cut);
      REQUIRE(d.size() == 6);
      CHECK(d.desirable() == std::vector<uint8_t>{1, 1, 0, 0, 1, 1});
      for (int64_t i = 0; i < 3; ++i) {
        INFO("example " << i);
        const int64_t own = 2 * i, other = 2 * ((i + 2) % 3);  // the one before; 0 takes 2
        const int64_t p = prompt_length(d, own), q = prompt_length(d, other);
        std::vector<int32_t> ids(d.ids(own).begin(), d.ids(own).begin() + p);
        std::vector<int32_t> labels(static_cast<size_t>(p), kIgnoreLabel);
        ids.insert(ids.end(), d.ids(other).begin() + q, d.ids(other).end());
        labels.insert(labels.end(), d.labels(other).begin() + q, d.labels(other).end());
        ids.resize(std::min<size_t>(ids.size(), static_cast<size_t>(max_length)));
        labels.resize(ids.size());
        CHECK(ids_of(d, own + 1) == ids);
        CHECK(d.labels(own + 1).to_vector() == labels);
        CHECK(d.length(own) <= max_length);
      }
      if (max_length == o.max_length) {  // whole: each sequence is TRL's standard form
        CHECK(ids_of(d, 0) ==
              cat(cat(tok->prefix_ids(), tok->encode("The sky is blue.")), {tok->eos_id()}));
      }
    }
  }

  SECTION("malformed records name the file, line and key; unusable ones are dropped and counted") {
    const std::string good = R"({"prompt": "Hi", "completion": " there", "label": true})";
    const std::vector<std::pair<std::string, std::string>> bad = {
        {R"({"prompt": "Hi", "completion": " there"})", "label"},
        {R"({"prompt": "Hi", "completion": " there", "label": "yes"})", "label"},
        {R"({"prompt": "Hi", "label": true})", "completion"},
        {R"({"completion": " there", "label": true})", "prompt"},
        {R"({"prompt": "Hi", "completion": [{"role": "user", "content": "x"}], "label": true})",
         "completion"},
        {R"([1, 2])", "kto.jsonl:2"},
    };
    for (const auto& [line, key] : bad) {
      INFO(line);
      files::write_atomic(dir + "/kto.jsonl", good + "\n" + line + "\n");
      CHECK_THROWS_WITH(tokenize_preference_jsonl(dir + "/kto.jsonl", *tok, o),
                        Contains("kto.jsonl:2") && Contains(key));
    }
    files::write_atomic(dir + "/kto.jsonl",
                        good + "\n" + R"({"prompt": "Hi", "completion": "", "label": false})" +
                            "\n" + R"({"prompt": "Hi", "chosen": " same", "rejected": " same"})" +
                            "\n" + good + "\n");
    DatasetStats stats;
    test::LogCapture log;
    const Dataset d = tokenize_preference_jsonl(dir + "/kto.jsonl", *tok, o, &stats);
    CHECK(d.size() == 4);
    CHECK(stats.empty_answers == 1);
    CHECK(stats.identical_pairs == 1);
    CHECK(log.contains("dropped 2 of 4 KTO record(s)"));
  }

  SECTION("the labels survive the cache, and a cache with broken ones is refused") {
    files::write_atomic(dir + "/kto.jsonl",
                        R"({"prompt": "Hi", "completion": " there", "label": false})"
                        "\n"
                        R"({"prompt": "Yo", "completion": " here", "label": true})"
                        "\n");
    const std::string cache = dir + "/cache";
    const Dataset first = load_or_tokenize(dir + "/kto.jsonl", *tok, o, cache);
    const Dataset again = load_or_tokenize(dir + "/kto.jsonl", *tok, o, cache);
    CHECK(first.desirable() == std::vector<uint8_t>{0, 0, 1, 1});
    CHECK(again.desirable() == first.desirable());
    // Pairs of the same file are another cache entry (no labels).
    const std::string path = dataset_cache_path(cache, dir + "/kto.jsonl", *tok, o);
    CHECK(path != dataset_cache_path(cache, dir + "/kto.jsonl", *tok, pairs));
    const SafetensorsFile f(path);
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const char* name : {"input_ids", "labels", "offsets"})
      tensors.emplace_back(name, f.load(name));
    for (const at::Tensor& flags :
         {at::tensor({0, 0, 2, 1}, at::kByte), at::tensor({0, 1}, at::kByte)}) {
      std::vector<std::pair<std::string, at::Tensor>> broken = tensors;
      broken.emplace_back("desirable", flags);
      save_safetensors(dir + "/broken.safetensors", broken, f.metadata());
      CHECK_THROWS_WITH(load_dataset(dir + "/broken.safetensors"),
                        Contains("broken.safetensors") && Contains("corrupt"));
    }
  }
}

TEST_CASE("label_log_probs: the rows' log-probabilities of full logits, with each entry's gradient",
          "[preference][model]") {
  // A trained output layer (its gradients recomputed in backward) and a frozen one (the hidden
  // states' gradients formed in forward, scaled row by row in backward).
  for (const auto& [family, frozen_head] : std::vector<std::pair<std::string, bool>>{
           {"llama", false}, {"qwen2", false}, {"llama", true}, {"qwen2", true}}) {
    INFO(family << (frozen_head ? ", frozen output layer" : ""));
    auto model = fixture_model(family);
    if (frozen_head) {
      for (auto& p : model->named_parameters()) {
        if (p.key() == "lm_head.weight" ||
            (family == "qwen2" && p.key() == "model.embed_tokens.weight"))
          p.value().set_requires_grad(false);
      }
    }
    SafetensorsFile data(fixture("models/" + family + "/expected.safetensors"));
    const at::Tensor ids = data.load("input_ids"), labels = data.load("labels");
    const at::Tensor mask = data.load("attention_mask");
    // Chunks smaller than a row, so chunk boundaries fall inside rows. The mean logits asked
    // for too: a metric beside the log-probs, which must leave them and their gradients as
    // they are.
    at::Tensor mean_logits;
    at::Tensor got = model->label_log_probs(ids, labels, mask, 5, {}, &mean_logits);
    const at::Tensor logits = model->logits(ids, mask);
    const int64_t t = ids.size(1);
    REQUIRE(mean_logits.sizes() == got.sizes());
    CHECK_FALSE(mean_logits.requires_grad());
    // Entry t: the mean over the vocabulary of the logits that score label t (position t - 1).
    CHECK(at::allclose(mean_logits.narrow(1, 1, t - 1), logits.narrow(1, 0, t - 1).mean(-1), 1e-5,
                       1e-5));
    CHECK(mean_logits.narrow(1, 0, 1).abs().max().item<double>() == 0.0);
    const at::Tensor y = labels.narrow(1, 1, t - 1);
    const at::Tensor want_tail = at::log_softmax(logits.narrow(1, 0, t - 1), -1)
                                     .gather(2, y.clamp_min(0).unsqueeze(2))
                                     .squeeze(2) *
                                 y.ne(-100);
    const at::Tensor want = at::cat({at::zeros({ids.size(0), 1}), want_tail}, 1);
    CHECK(at::allclose(got, want, 1e-5, 1e-5));
    // The rows' sums are the loss's, negated.
    CHECK(got.sum().item<double>() ==
          Approx(-model->loss(ids, labels, mask).sum.item<double>()).epsilon(1e-5));
    // Each entry's own weight reaches the parameters (a preference loss weighs rows apart).
    const at::Tensor w = at::randn(got.sizes());
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    (got * w).sum().backward();
    std::map<std::string, at::Tensor> chunked;
    for (const auto& p : model->named_parameters()) {
      if (p.value().requires_grad()) chunked[p.key()] = p.value().grad().clone();
    }
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    const at::Tensor full = model->logits(ids, mask);
    const at::Tensor lp = at::log_softmax(full.narrow(1, 0, t - 1), -1)
                              .gather(2, y.clamp_min(0).unsqueeze(2))
                              .squeeze(2) *
                          y.ne(-100);
    (lp * w.narrow(1, 1, t - 1)).sum().backward();
    for (const auto& p : model->named_parameters()) {
      if (!p.value().requires_grad()) continue;
      INFO(p.key());
      const at::Tensor g = p.value().grad();
      CHECK(at::allclose(chunked[p.key()], g, 1e-4, 1e-6 * (1 + g.abs().max().item<double>())));
    }
  }
}

TEST_CASE("adapters switched off give the base model, and back on the adapted one",
          "[preference][peft]") {
  auto base = fixture_model("llama");
  auto model = fixture_model("llama");
  SafetensorsFile data(fixture("models/llama/expected.safetensors"));
  const at::Tensor ids = data.load("input_ids"), mask = data.load("attention_mask");
  const at::Tensor base_logits = base->logits(ids, mask);
  for (const char* method : {"lora", "ptuning", "prefix"}) {
    INFO(method);
    auto m = fixture_model("llama");
    PeftConfig c;
    if (std::string(method) == "lora") {
      c.type = FinetuningType::kLora;
      c.lora.r = 4;
      c.lora.alpha = 8;
    } else {
      c.type =
          std::string(method) == "ptuning" ? FinetuningType::kPTuning : FinetuningType::kPrefix;
      c.prompt.num_virtual_tokens = 3;
    }
    apply_peft(*m, c, 7);
    {
      at::NoGradGuard no_grad;
      for (auto& p : m->named_parameters()) {
        if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0, 0.05);
      }
    }
    m->eval();
    const at::Tensor adapted = m->label_log_probs(ids, data.load("labels"), mask);
    m->set_adapters_enabled(false);
    CHECK_FALSE(m->adapters_enabled());
    CHECK(at::allclose(m->logits(ids, mask), base_logits, 1e-5, 1e-5));
    const at::Tensor off = m->label_log_probs(ids, data.load("labels"), mask);
    CHECK(at::allclose(off, base->label_log_probs(ids, data.load("labels"), mask), 1e-5, 1e-5));
    m->set_adapters_enabled(true);
    CHECK(at::allclose(m->label_log_probs(ids, data.load("labels"), mask), adapted));
    CHECK((adapted - off).abs().max().item<double>() > 1e-4);  // the adapter mattered
  }
}

TEST_CASE("preference losses, metrics and gradients are TRL's and LLaMA-Factory's (PEFT fixture)",
          "[preference][peft]") {
  for (const char* family : {"llama", "qwen2", "glm"}) {
    INFO(family);
    CHECK(test::check_pair_fixture(family, at::kCPU) >= 8);
  }
}

TEST_CASE(
    "KTO's losses, KL estimate, metrics and gradients are TRL's and LLaMA-Factory's "
    "(PEFT fixture)",
    "[preference][peft]") {
  for (const char* family : {"llama", "qwen2", "glm"}) {
    INFO(family);
    CHECK(test::check_kto_fixture(family, at::kCPU) == 3);
  }
}

// ---- runs ------------------------------------------------------------------------------------

namespace {

using test::write_pairs;

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t end; (end = text.find('\n', start)) != std::string::npos; start = end + 1) {
    out.push_back(text.substr(start, end - start));
  }
  return out;
}

// Run `out`'s logged values of `keys` against `reference`'s, step by step (2e-4 relative, then
// `margin`); a key not in `reference` yet is taken from this run.
void compare_logged(std::map<std::string, std::map<int64_t, double>>& reference,
                    const std::string& out, const std::vector<const char*>& keys,
                    double margin = 1e-5) {
  for (const char* key : keys) {
    const std::map<int64_t, double> got = test::logged(out, key);
    REQUIRE(got.size() >= 2);
    if (reference.count(key) == 0) {
      reference[key] = got;
      continue;
    }
    for (const auto& [step, value] : reference[key]) {
      INFO(key << " at step " << step);
      CHECK(got.at(step) == Approx(value).epsilon(2e-4).margin(margin));
    }
  }
}

std::vector<std::string> dpo_flags(const std::string& dir, const std::vector<std::string>& extra) {
  return test::tiny_run_flags(dir,
                              {"--stage",
                               "dpo",
                               "--finetuning_type",
                               "lora",
                               "--lora_r",
                               "4",
                               "--per_device_train_batch_size",
                               "2",
                               "--learning_rate",
                               "2e-2",
                               "--max_steps",
                               "6",
                               "--logging_steps",
                               "1",
                               "--save_steps",
                               "100",
                               "--seed",
                               "5",
                               "--pref_beta",
                               "0.5"},
                              extra);
}

}  // namespace

TEST_CASE("rank: dpo run", "[.rank]") {
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(args, test::split_flags(std::getenv("ZT_FLAGS")));
  Trainer trainer(args, comm);
  const TrainResult r = trainer.train();
  CHECK(r.global_step == args.max_steps);
}

TEST_CASE("DPO trains the same at world 1, 2 and 4 under every ZeRO stage, and learns",
          "[preference][trainer][slow]") {
  if (test::skip_cpu_world(4)) return;
  const std::string dir = test::temp_dir("dpo-runs");
  write_pairs(dir, "train.jsonl", 24, 1);
  write_pairs(dir, "eval.jsonl", 8, 2);
  for (const char* loss : {"sigmoid", "simpo"}) {
    INFO(loss);
    std::map<std::string, std::map<int64_t, double>> reference;
    for (int stage : {0, 3, 1, 2}) {
      for (int world : {1, 2, 4}) {
        if (stage == 1 || stage == 2) {  // stages 1 and 2: at 2 ranks, against the rest
          if (world != 2 || std::string(loss) != "sigmoid") continue;
        }
        INFO("stage " << stage << ", world " << world);
        const std::string out = fmt::format("{}/out-{}-{}-{}", dir, loss, stage, world);
        const int micro = 4 / world;
        std::vector<std::string> flags =
            dpo_flags(dir, {"--output_dir", out, "--pref_loss", loss, "--eval_file",
                            dir + "/eval.jsonl", "--eval_strategy", "steps", "--eval_steps", "3",
                            "--eval_on_start", "true", "--per_device_train_batch_size",
                            std::to_string(micro), "--deepspeed", test::stage_json(stage)});
        test::run_ranks(world, "rank: dpo run", std::chrono::seconds(240),
                        {{"ZT_FLAGS", test::join_flags(flags)}});
        compare_logged(
            reference, out,
            {"loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logits/chosen",
             "logits/rejected", "eval_loss", "eval_rewards/margins", "eval_logits/chosen"});
      }
    }
    // Learning: the policy prefers the chosen answers more than at the start (where, for DPO,
    // the policy is the reference: margin 0).
    const auto margins = reference["eval_rewards/margins"];
    CHECK(margins.rbegin()->second > margins.begin()->second + 0.05);
  }
}

namespace {

// KTO's examples as LLaMA-Factory's alpaca layout with a label: the right answer desirable, an
// evasive one not (half each).
std::string write_feedback(const std::string& dir, const std::string& name, int count, int salt) {
  std::string text;
  for (int i = 0; i < count; ++i) {
    const int n = static_cast<int>((int64_t{i} * 7919 + int64_t{salt} * 104729) % 10007);
    const bool right = (i + salt) % 2 == 0;
    text += fmt::format(
        "{{\"instruction\": \"Is {} even or odd?\", \"output\": \"{}\", \"label\": {}}}\n", n,
        right ? (n % 2 ? "odd" : "even") : "no idea", right ? "true" : "false");
  }
  files::write_atomic(dir + "/" + name, text);
  return dir + "/" + name;
}

}  // namespace

TEST_CASE("KTO trains the same at world 1, 2 and 4 under every ZeRO stage, and learns",
          "[preference][trainer][slow]") {
  if (test::skip_cpu_world(4)) return;
  const std::string dir = test::temp_dir("kto-runs");
  write_feedback(dir, "train.jsonl", 24, 1);
  write_feedback(dir, "eval.jsonl", 8, 2);
  const std::vector<std::string> common{
      "--stage",         "kto",   "--eval_file",         dir + "/eval.jsonl",
      "--eval_strategy", "steps", "--eval_steps",        "3",
      "--eval_on_start", "true",  "--kto_chosen_weight", "1.2",
      "--pref_ftx",      "0.1",   "--learning_rate",     "1e-2"};
  auto run = [&](int world, const std::string& name, std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    extra.insert(extra.end(), {"--output_dir", dir + "/" + name});
    test::run_ranks(world, "rank: dpo run", std::chrono::seconds(240),
                    {{"ZT_FLAGS", test::join_flags(dpo_flags(dir, extra))}});
    return dir + "/" + name;
  };
  const std::vector<const char*> keys = {
      "loss",      "kl",      "rewards/chosen",       "rewards/margins",     "logits/chosen",
      "eval_loss", "eval_kl", "eval_rewards/margins", "eval_logits/rejected"};
  std::map<std::string, std::map<int64_t, double>> reference;
  const auto compare = [&](const std::string& out) { compare_logged(reference, out, keys); };
  for (int stage : {0, 3}) {
    for (int world : {1, 2, 4}) {
      INFO("stage " << stage << ", world " << world);
      // World 1 accumulates two micro-batches: the KL estimate spans the global batch.
      compare(run(world, fmt::format("out-{}-{}", stage, world),
                  {"--per_device_train_batch_size", std::to_string(world == 1 ? 2 : 4 / world),
                   "--gradient_accumulation_steps", world == 1 ? "2" : "1", "--deepspeed",
                   test::stage_json(stage)}));
    }
  }
  for (int stage : {1, 2}) {  // stages 1 and 2 at 2 ranks, against the rest
    INFO("stage " << stage << ", world 2");
    compare(run(2, fmt::format("out-{}-2", stage),
                {"--per_device_train_batch_size", "2", "--deepspeed", test::stage_json(stage)}));
  }
  // The reference computed once equals the adapters-off forward of every step.
  {
    INFO("precomputed reference");
    compare(run(2, "precomputed",
                {"--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2",
                 "--precompute_ref_log_probs", "true", "--deepspeed", test::stage_json(0)}));
  }
  // KL estimates that matter (z0 > 0), and learning: the desirable answers' reward rises above
  // the undesirable ones' (at the start the policy is the reference: margin 0).
  const auto kl = reference["kl"];
  CHECK(std::any_of(kl.begin(), kl.end(), [](const auto& e) { return e.second > 1e-4; }));
  const auto margins = reference["eval_rewards/margins"];
  CHECK(margins.begin()->second == Approx(0.0).margin(1e-9));
  CHECK(margins.rbegin()->second > 0.5);
  // Full fine-tuning: the reference precomputed by default, its first step at rewards 0.
  const std::string full = run(
      2, "full",
      {"--finetuning_type", "full", "--learning_rate", "1e-3", "--deepspeed", test::stage_json(3)});
  CHECK(fs::exists(full + "/checkpoint-6/ref_log_probs.safetensors") ==
        fs::exists(full + "/checkpoint-6"));
  int first_step_rewards = 0;
  for (const char* key : {"rewards/chosen", "rewards/rejected"}) {
    const std::map<int64_t, double> rewards = test::logged(full, key);
    if (rewards.count(1)) {  // a step's examples may all be of one kind
      CHECK(rewards.at(1) == Approx(0.0).margin(1e-9));
      ++first_step_rewards;
    }
    CHECK(std::any_of(rewards.begin(), rewards.end(),
                      [](const auto& e) { return std::abs(e.second) > 1e-4; }));
  }
  CHECK(first_step_rewards > 0);
}

TEST_CASE(
    "the reference log-probs precomputed before training: the online reference's, kept for "
    "resume",
    "[preference][trainer]") {
  if (test::skip_cpu_world(2)) return;
  const std::string dir = test::temp_dir("dpo-precompute");
  write_pairs(dir, "train.jsonl", 24, 3);
  write_pairs(dir, "eval.jsonl", 6, 4);
  const std::vector<std::string> common{"--eval_file",     dir + "/eval.jsonl",
                                        "--eval_strategy", "steps",
                                        "--eval_steps",    "3",
                                        "--save_steps",    "3"};
  auto run = [&](int world, const std::string& out, std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    extra.insert(extra.end(), {"--output_dir", dir + "/" + out});
    test::run_ranks(world, "rank: dpo run", std::chrono::seconds(240),
                    {{"ZT_FLAGS", test::join_flags(dpo_flags(dir, extra))}});
    return dir + "/" + out;
  };
  // LoRA: the reference computed once equals the adapters-off forward of every step.
  const std::string online = run(1, "lora-online", {});
  const std::string stored =
      run(2, "lora-precomputed",
          {"--precompute_ref_log_probs", "true", "--per_device_train_batch_size", "1"});
  CHECK(fs::exists(stored + "/checkpoint-3/ref_log_probs.safetensors"));
  CHECK_FALSE(fs::exists(online + "/checkpoint-3/ref_log_probs.safetensors"));
  for (const char* key : {"loss", "rewards/chosen", "eval_rewards/margins"}) {
    const auto want = test::logged(online, key), got = test::logged(stored, key);
    REQUIRE(want.size() >= 2);
    for (const auto& [step, value] : want) {
      INFO(key << " at step " << step);
      CHECK(got.at(step) == Approx(value).epsilon(2e-4).margin(1e-6));
    }
  }
  // Full fine-tuning (the default: precomputed) under ZeRO-3 at 2 ranks: the first step scores
  // the model that is the reference (rewards 0), and a run resumed mid-way continues exactly.
  const std::vector<std::string> full{
      "--finetuning_type", "full", "--learning_rate", "1e-3", "--deepspeed", test::stage_json(3)};
  const std::string whole = run(2, "full", full);
  CHECK(test::logged(whole, "rewards/chosen").at(1) == Approx(0.0).margin(1e-9));
  CHECK(test::logged(whole, "rewards/margins").at(6) != Approx(0.0).margin(1e-6));
  fs::create_directories(dir + "/full-resumed");
  fs::copy(whole + "/checkpoint-3", dir + "/full-resumed/checkpoint-3",
           fs::copy_options::recursive);
  std::vector<std::string> resume = full;
  resume.insert(resume.end(), {"--resume_from_checkpoint", dir + "/full-resumed/checkpoint-3"});
  const std::string resumed = run(1, "full-resumed", resume);
  for (const char* key : {"loss", "rewards/margins"}) {
    for (int64_t step = 4; step <= 6; ++step) {
      INFO(key << " at step " << step);
      CHECK(test::logged(resumed, key).at(step) ==
            Approx(test::logged(whole, key).at(step)).epsilon(2e-4).margin(1e-6));
    }
  }
  // Without the stored log-probs the resumed run cannot know its reference: an error naming
  // the file, never log-probs of the trained model.
  fs::remove(dir + "/full-resumed/checkpoint-3/ref_log_probs.safetensors");
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  std::vector<std::string> flags = dpo_flags(dir, resume);
  flags.insert(flags.end(),
               {"--output_dir", dir + "/full-resumed", "--overwrite_output_dir", "true"});
  apply_training_flags(args, flags);
  CHECK_THROWS_WITH(Trainer(args, comm), Contains("ref_log_probs.safetensors"));
  // A table that is not this run's, or is damaged: refused naming the file, never scored with.
  const std::string table = dir + "/full-resumed/checkpoint-3/ref_log_probs.safetensors";
  const SafetensorsFile good(whole + "/checkpoint-3/ref_log_probs.safetensors");
  const at::Tensor train_table = good.load("train");
  const std::map<std::string, std::string> meta{{"format", "pt"},
                                                {"train_data", good.metadata().at("train_data")},
                                                {"eval_data", good.metadata().at("eval_data")}};
  save_safetensors(
      table, {{"train", train_table}, {"eval", good.load("eval")}},
      {{"format", "pt"}, {"train_data", "0000-24"}, {"eval_data", meta.at("eval_data")}});
  CHECK_THROWS_WITH(Trainer(args, comm), Contains(table) && Contains("other train data"));
  for (const at::Tensor& bad : {train_table.narrow(0, 0, 10), train_table.to(at::kFloat),
                                train_table.clone().fill_(std::nan(""))}) {
    save_safetensors(table, {{"train", bad}, {"eval", good.load("eval")}}, meta);
    CHECK_THROWS_WITH(Trainer(args, comm), Contains(table) && Contains("damaged"));
  }
}

TEST_CASE("a frozen reference model, sharded as the policy, scores as the precomputed table does",
          "[preference][trainer][slow]") {
  if (test::skip_cpu_world(4)) return;
  // Full fine-tuning with precompute_ref_log_probs false: the starting weights kept as each
  // rank keeps its compute copy and swapped in for every reference forward. The steps equal
  // those of the precomputed table (the same model scored) at world 1, 2 and 4 under ZeRO-3
  // (and stage 2 at 2 ranks), for DPO and KTO; a run resumed at another world size rebuilds
  // the reference from the starting weights and continues exactly.
  const std::string dir = test::temp_dir("dpo-frozen");
  write_pairs(dir, "train.jsonl", 24, 3);
  write_pairs(dir, "eval.jsonl", 6, 4);
  auto run = [&](int world, const std::string& out, std::vector<std::string> extra) {
    extra.insert(extra.end(),
                 {"--finetuning_type", "full", "--learning_rate", "1e-3", "--eval_file",
                  dir + "/eval.jsonl", "--eval_strategy", "steps", "--eval_steps", "3",
                  "--save_steps", "3", "--output_dir", dir + "/" + out});
    test::run_ranks(world, "rank: dpo run", std::chrono::seconds(240),
                    {{"ZT_FLAGS", test::join_flags(dpo_flags(dir, extra))}});
    return dir + "/" + out;
  };
  const auto same = [](const std::string& want, const std::string& got,
                       const std::vector<const char*>& keys) {
    std::map<std::string, std::map<int64_t, double>> reference;
    compare_logged(reference, want, keys, 1e-6);
    compare_logged(reference, got, keys, 1e-6);
  };
  for (const char* stage : {"dpo", "kto"}) {
    INFO(stage);
    const std::vector<const char*> keys =
        std::string(stage) == "dpo"
            ? std::vector<const char*>{"loss", "rewards/margins", "eval_loss",
                                       "eval_rewards/margins"}
            : std::vector<const char*>{"loss", "kl", "rewards/chosen", "eval_loss", "eval_kl"};
    const std::string table = run(2, fmt::format("{}-table", stage),
                                  {"--stage", stage, "--deepspeed", test::stage_json(3)});
    CHECK(fs::exists(table + "/checkpoint-3/ref_log_probs.safetensors"));
    for (int world : {1, 2, 4}) {
      INFO("world " << world);
      const std::string frozen = run(
          world, fmt::format("{}-frozen-{}", stage, world),
          {"--stage", stage, "--precompute_ref_log_probs", "false", "--per_device_train_batch_size",
           std::to_string(world == 1 ? 2 : 4 / world), "--gradient_accumulation_steps",
           world == 1 ? "2" : "1", "--deepspeed", test::stage_json(3)});
      CHECK_FALSE(fs::exists(frozen + "/checkpoint-3/ref_log_probs.safetensors"));
      same(table, frozen, keys);
    }
  }
  // Stage 2 (the reference a whole replica), and resume at 1 rank from a save at 2 ranks.
  const std::string table = dir + "/dpo-table";
  const std::string stage2 =
      run(2, "dpo-frozen-stage2",
          {"--precompute_ref_log_probs", "false", "--deepspeed", test::stage_json(2)});
  same(table, stage2, {"loss", "rewards/margins"});
  fs::create_directories(dir + "/resumed");
  fs::copy(dir + "/dpo-frozen-2/checkpoint-3", dir + "/resumed/checkpoint-3",
           fs::copy_options::recursive);
  const std::string resumed =
      run(1, "resumed",
          {"--precompute_ref_log_probs", "false", "--deepspeed", test::stage_json(3),
           "--resume_from_checkpoint", dir + "/resumed/checkpoint-3"});
  for (int64_t step = 4; step <= 6; ++step) {
    INFO("resumed, step " << step);
    CHECK(test::logged(resumed, "loss").at(step) ==
          Approx(test::logged(table, "loss").at(step)).epsilon(2e-4).margin(1e-6));
  }
  // The host's own pairs train full fine-tuning against the frozen reference: the first step
  // scores the policy against itself (log 2).
  auto comm = std::shared_ptr<Communicator>(test::join());
  TrainingArguments args;
  apply_training_flags(
      args, dpo_flags(dir, {"--finetuning_type", "full", "--precompute_ref_log_probs", "false",
                            "--output_dir", dir + "/host"}));
  Trainer host(args, comm);
  const Dataset pairs = tokenize_preference_jsonl(dir + "/train.jsonl", *load_tokenizer("", 259),
                                                  data_options_for(host.arguments()));
  const Batch b = collate(pairs, {0, 2, 1, 3}, 0);
  const StepStats st =
      host.train_preference_step(b.input_ids.narrow(0, 0, 2), b.labels.narrow(0, 0, 2),
                                 b.input_ids.narrow(0, 2, 2), b.labels.narrow(0, 2, 2));
  CHECK(st.loss == Approx(std::log(2.0)).epsilon(1e-6));
}

TEST_CASE("the reference of every adapter method is the model the run starts from",
          "[preference][trainer][reference]") {
  // DPO's and KTO's reference is the model as the run starts. At the first step the policy is
  // that model, so every reward is 0 (DPO's loss log 2, KTO's kl 0) whatever the method: PiSSA
  // (its base holds the residual: adapters off is not the start), over a 4-bit base too, an
  // adapter continued from a folder, P-Tuning's and prefix tuning's first virtual tokens, and
  // plain LoRA and DoRA. Online and precomputed alike; and the online reference equals the
  // precomputed table at every later step, where adapters off would keep a trained module of
  // modules_to_save as trained. One rank, in process; tolerance: fp32 sums of a tiny model.
  const std::string dir = test::temp_dir("reference-starts");
  write_pairs(dir, "train.jsonl", 16, 7);
  const std::string feedback = write_feedback(dir, "feedback.jsonl", 16, 7);
  auto comm = std::shared_ptr<Communicator>(test::join());
  auto flags = [&](const std::string& out, std::vector<std::string> extra) {
    extra.insert(extra.end(), {"--output_dir", dir + "/" + out, "--max_steps", "3",
                               "--per_device_train_batch_size", "4"});
    TrainingArguments args;
    apply_training_flags(args, dpo_flags(dir, extra));
    return args;
  };
  // The adapter to continue: a short LoRA run's (an SFT-then-DPO user's habit).
  const std::string sft = test::write_data(dir, "sft.jsonl", 16, 7);
  Trainer(flags("to-continue", {"--stage", "sft", "--train_file", sft}), comm).train();
  struct Method {
    const char* name;
    std::vector<std::string> flags;
  };
  const Method methods[] = {
      {"lora", {}},
      {"dora", {"--use_dora", "true"}},
      {"pissa", {"--pissa_init", "true", "--pissa_iter", "-1"}},
      {"pissa-4bit", {"--pissa_init", "true", "--pissa_iter", "2", "--quantization_bit", "4"}},
      {"saved-module", {"--lora_modules_to_save", "lm_head"}},
      {"continued", {"--adapter_name_or_path", dir + "/to-continue"}},
      {"ptuning", {"--finetuning_type", "ptuning", "--num_virtual_tokens", "4"}},
      {"prefix", {"--finetuning_type", "prefix", "--num_virtual_tokens", "4"}},
  };
  for (const Method& m : methods) {
    for (const char* stage : {"dpo", "kto"}) {
      std::map<std::string, std::map<int64_t, double>> online;
      for (const char* precompute : {"false", "true"}) {
        INFO(m.name << ", " << stage << ", precompute_ref_log_probs " << precompute);
        const std::string out = fmt::format("{}-{}-{}", m.name, stage, precompute);
        std::vector<std::string> extra = m.flags;
        extra.insert(extra.end(), {"--stage", stage, "--precompute_ref_log_probs", precompute});
        if (std::string(stage) == "kto") extra.insert(extra.end(), {"--train_file", feedback});
        Trainer(flags(out, extra), comm).train();
        const std::string path = dir + "/" + out;
        CHECK(test::logged(path, "rewards/chosen").at(1) == Approx(0.0).margin(1e-6));
        if (std::string(stage) == "dpo") {
          CHECK(test::logged(path, "loss").at(1) == Approx(std::log(2.0)).epsilon(1e-6));
        } else {
          CHECK(test::logged(path, "kl").at(1) == Approx(0.0).margin(1e-6));
        }
        compare_logged(online, path, {"loss", "rewards/chosen", "rewards/rejected"}, 1e-6);
      }
    }
  }
}

TEST_CASE("rpo_alpha adds the chosen answers' token-mean NLL over the global batch",
          "[preference][trainer]") {
  if (test::skip_cpu_world(2)) return;
  // At the first step the policy is the reference: DPO's loss is log 2 exactly, and with
  // rpo_alpha α the step's loss is log 2 + α · the chosen answers' NLL averaged over all their
  // tokens — what an SFT run on the chosen answers logs at its first step (same model, same
  // order, the same sequences).
  const std::string dir = test::temp_dir("dpo-rpo");
  write_pairs(dir, "train.jsonl", 24, 5);
  std::string sft;
  for (const std::string& line : split_lines(files::read_text(dir + "/train.jsonl"))) {
    const size_t chosen = line.find("\"chosen\"");
    const size_t rejected = line.find(", \"rejected\"");
    sft += line.substr(0, chosen) + "\"output\"" + line.substr(chosen + 8, rejected - chosen - 8) +
           "}\n";
  }
  files::write_atomic(dir + "/sft.jsonl", sft);
  auto first_loss = [&](const std::vector<std::string>& extra, const std::string& out) {
    std::vector<std::string> flags = dpo_flags(dir, extra);
    flags.insert(flags.end(), {"--output_dir", dir + "/" + out, "--max_steps", "1",
                               "--per_device_train_batch_size", "8"});
    test::run_ranks(2, "rank: dpo run", std::chrono::seconds(240),
                    {{"ZT_FLAGS", test::join_flags(flags)}});
    return test::logged(dir + "/" + out, "loss").at(1);
  };
  const double nll = first_loss({"--stage", "sft", "--train_file", dir + "/sft.jsonl"}, "sft");
  CHECK(first_loss({}, "dpo") == Approx(std::log(2.0)).epsilon(1e-6));
  CHECK(first_loss({"--rpo_alpha", "0.7"}, "rpo") ==
        Approx(std::log(2.0) + 0.7 * nll).epsilon(1e-5));
}

TEST_CASE("train_preference_step: the host's pairs give the steps train() gives",
          "[preference][trainer]") {
  // The same pairs, in the file's order (sequential sampling), four a step: through train() from
  // train_file, and handed over batch by batch from the host.
  const std::string dir = test::temp_dir("dpo-host");
  write_pairs(dir, "train.jsonl", 16, 7);
  auto comm = std::shared_ptr<Communicator>(test::join());
  auto args_for = [&](const std::string& out) {
    TrainingArguments args;
    std::vector<std::string> flags =
        dpo_flags(dir, {"--output_dir", dir + "/" + out, "--train_sampling_strategy", "sequential",
                        "--per_device_train_batch_size", "4", "--max_steps", "4"});
    apply_training_flags(args, flags);
    return args;
  };
  Trainer(args_for("file"), comm).train();
  const std::map<int64_t, double> want = test::logged(dir + "/file", "loss");
  REQUIRE(want.size() == 4);
  Trainer host(args_for("host"), comm);
  DataOptions o = data_options_for(host.arguments());
  const Dataset pairs =
      tokenize_preference_jsonl(dir + "/train.jsonl", *load_tokenizer("", 259), o);
  for (int64_t step = 0; step < 4; ++step) {
    std::vector<int64_t> rows;
    for (int64_t p = 4 * step; p < 4 * step + 4; ++p) rows.push_back(2 * p);
    for (int64_t p = 4 * step; p < 4 * step + 4; ++p) rows.push_back(2 * p + 1);
    const Batch b = collate(pairs, rows, 0);
    const StepStats st =
        host.train_preference_step(b.input_ids.narrow(0, 0, 4), b.labels.narrow(0, 0, 4),
                                   b.input_ids.narrow(0, 4, 4), b.labels.narrow(0, 4, 4));
    INFO("step " << step + 1);
    CHECK(st.stepped);
    CHECK(st.loss == Approx(want.at(step + 1)).epsilon(1e-5));
  }
  // Hostile shapes and rows: errors naming what is wrong.
  const at::Tensor ids = at::full({2, 6}, 5, at::kLong);
  at::Tensor labels = ids.clone();
  CHECK_THROWS_WITH(host.train_preference_step(ids, labels, ids.narrow(1, 0, 5), labels),
                    Contains("one shape"));
  CHECK_THROWS_WITH(host.train_preference_step(ids, at::full({2, 6}, -100, at::kLong), ids, labels),
                    Contains("no scored answer token"));
  CHECK_THROWS_WITH(host.train_preference_step(ids + 1000, labels, ids, labels),
                    Contains("chosen_ids") && Contains("outside the vocabulary"));
}

TEST_CASE("a preference run counts its data in pairs or KTO examples, each drop by its cause",
          "[preference][trainer][counts]") {
  const std::string dir = test::temp_dir("pref-run-counts");
  const std::string path = write_pairs(dir, "train.jsonl", 8, 1);
  std::ofstream(path, std::ios::app)
      << R"({"instruction": "Same?", "chosen": "yes", "rejected": "yes"})"
         "\n"
         R"({"instruction": "Empty?", "chosen": "", "rejected": "no"})"
         "\n";
  auto comm = std::shared_ptr<Communicator>(test::join());
  for (const char* stage : {"dpo", "kto"}) {
    INFO(stage);
    const bool kto = std::string(stage) == "kto";
    TrainingArguments args;
    apply_training_flags(args, dpo_flags(dir, {"--stage", stage, "--max_steps", "1", "--output_dir",
                                               dir + "/" + stage}));
    test::LogCapture log;
    Trainer(args, comm).train();
    // 8 pairs kept (16 sequences); read as KTO data the 10 pair records are 20 examples, of
    // which 16 are kept, each with its KL sequence.
    CHECK(log.contains(fmt::format("training data '{}': {}", path,
                                   kto ? "16 KTO examples, each with its KL sequence (32 sequences)"
                                       : "8 pairs (16 sequences)")));
    CHECK(log.contains(kto ? "; 2 KTO records (4 KTO examples) dropped: 1 with identical chosen "
                             "and rejected answers, 1 with an empty answer"
                           : "; 2 pairs dropped: 1 with identical chosen and rejected answers, 1 "
                             "with an empty answer"));
    CHECK_FALSE(log.contains("dropped by truncation"));
    CHECK(log.contains(kto ? "num KTO examples = 16" : "num pairs = 8"));
  }
}

TEST_CASE("stage dpo: settings it cannot honour are refused, naming the option",
          "[preference][errors]") {
  const std::string dir = test::temp_dir("dpo-errors");
  write_pairs(dir, "train.jsonl", 8, 1);
  auto comm = std::shared_ptr<Communicator>(test::join());
  auto attempt = [&](const std::vector<std::string>& extra) {
    TrainingArguments args;
    apply_training_flags(args, dpo_flags(dir, extra));
    Trainer trainer(args, comm);
  };
  CHECK_THROWS_WITH(attempt({"--packing", "true"}), Contains("packing"));
  CHECK_THROWS_WITH(attempt({"--pref_loss", "hinge", "--dpo_label_smoothing", "0.1"}),
                    Contains("dpo_label_smoothing"));
  TrainingArguments args;
  CHECK_THROWS_WITH(apply_training_flags(args, {"--pref_loss", "kto_pair"}), Contains("pref_loss"));
  CHECK_THROWS_WITH(apply_training_flags(args, {"--stage", "rm"}), Contains("stage"));
  CHECK_THROWS_WITH(apply_training_flags(args, {"--label_smoothing", "0.5"}),
                    Contains("label_smoothing"));
  // KTO: only its losses, no rpo_alpha, and no host pairs.
  CHECK_THROWS_WITH(attempt({"--stage", "kto", "--pref_loss", "hinge"}),
                    Contains("pref_loss hinge") && Contains("stage dpo"));
  CHECK_THROWS_WITH(attempt({"--pref_loss", "kto"}), Contains("stage kto"));
  CHECK_THROWS_WITH(attempt({"--stage", "kto", "--rpo_alpha", "0.5"}), Contains("rpo_alpha"));
  CHECK_THROWS_WITH(attempt({"--stage", "kto", "--dpo_label_smoothing", "0.1"}),
                    Contains("dpo_label_smoothing"));
  {
    TrainingArguments kto;
    apply_training_flags(kto, dpo_flags(dir, {"--stage", "kto", "--output_dir", dir + "/kto"}));
    Trainer trainer(kto, comm);
    const at::Tensor ids = at::randint(3, 100, {2, 6}, at::kLong);
    CHECK_THROWS_WITH(trainer.train_preference_step(ids, ids, ids, ids), Contains("stage kto"));
    CHECK_THROWS_WITH(trainer.train_step(ids, ids), Contains("stage kto"));
  }
  // A reference-free loss trains full fine-tuning.
  CHECK_NOTHROW(attempt(
      {"--finetuning_type", "full", "--pref_loss", "orpo", "--output_dir", dir + "/full-orpo"}));
}
