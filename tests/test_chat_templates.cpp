// The models' chat formats against their own chat_template texts (data/chat_templates/),
// rendered by jinja2 with transformers' settings (tests/tools/render_chat_templates.py): the
// same text for every conversation shape, the same refusals; `--template auto` recognizes each
// text; the trained labels are the replies and their end-of-turn markers. The Jinja interpreter
// against jinja2 on other models' templates, llama.cpp's collection among them over
// conversations with tools and reasoning (fixtures/chat_templates/llamacpp/cases.json).
#include "support/catch.hpp"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <rapidjson/document.h>

#include "data/chat_templates.hpp"
#include "data/jinja.hpp"
#include "support/ranks.hpp"
#include "tokenizer/hf_tokenizer.hpp"
#include "util/files.hpp"
#include "util/json.hpp"
#include "zerotrain/data.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/tokenizer.hpp"

using namespace zt;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

struct Format {
  const char* name;
  const char* bos;  // nullptr: the tokenizer has none (Qwen)
  const char* eos;
};

const Format kFormats[] = {
    {"qwen2", nullptr, "<|im_end|>"},
    {"qwen2.5", nullptr, "<|im_end|>"},
    {"qwen3", nullptr, "<|im_end|>"},
    {"llama3", "<|begin_of_text|>", "<|eot_id|>"},
    {"llama3_original", "<|begin_of_text|>", "<|end_of_text|>"},
    {"llama3.1", "<|begin_of_text|>", "<|eot_id|>"},
    {"llama3.2", "<|begin_of_text|>", "<|eot_id|>"},
    {"llama2", "<s>", "</s>"},
    {"mistral_v0.1", "<s>", "</s>"},
    {"mistral_v0.2", "<s>", "</s>"},
    {"mistral_v0.3", "<s>", "</s>"},
    {"chatglm3", nullptr, "</s>"},
    {"glm4", nullptr, "<|endoftext|>"},
};

using Turns =
    std::vector<std::pair<std::string, std::string>>;  // (role, content), system first if any

// The conversation shapes: with and without a system message, one and two exchanges, and
// content that the templates' trim/strip and Qwen3's reasoning split act on.
const std::vector<Turns>& conversations() {
  static const std::vector<Turns> all = {
      {{"system", "You are a helpful assistant."},
       {"user", "Hi!"},
       {"assistant", "Hello! How can I help?"},
       {"user", "What is 2+2?"},
       {"assistant", "2+2 = 4."}},
      {{"user", "Hi"}, {"assistant", "Yo"}},
      {{"user", "  spaced \n"},
       {"assistant", "\u3000full-width space and tab\t "},
       {"user", "两个问题？\n\n第二行"},
       {"assistant", "好的。\n"}},
      {{"system", " Be brief. "},
       {"user", "x"},
       {"assistant", "<think>\nstep one\n</think>\n\nThe answer"},
       {"user", "y"},
       {"assistant", "<think>\nstep two\n</think>\n\nAnother"}},
  };
  return all;
}

data::Chat chat_of(const Turns& turns) {
  data::Chat c;
  for (const auto& [role, content] : turns) {
    if (role == "system") {
      c.system = content;
    } else {
      c.messages.push_back({role, content, ""});
    }
  }
  return c;
}

std::string jinja_python() {
  static const std::string found = [] {
    for (const char* py : {"python3", "/usr/bin/python3"}) {
      if (std::system(fmt::format("{} -c 'import jinja2' >/dev/null 2>&1", py).c_str()) == 0)
        return std::string(py);
    }
    return std::string();
  }();
  return found;
}

// What jinja2 made of one case: the text, or the error it stopped with (`raised`: the
// template's own raise_exception).
struct Jinja2Rendering {
  std::optional<std::string> text;
  std::string error;
  bool raised = false;
};

// jinja2's renderings (tests/tools/render_chat_templates.py) of the template file at `path` with
// f's special tokens, one per entry of `cases` (the script's job entries: messages,
// add_generation_prompt, tools, kwargs).
std::vector<Jinja2Rendering> jinja2_render(const Format& f, const std::string& path,
                                           const rapidjson::Value& cases) {
  const std::string py = jinja_python();
  if (py.empty()) FAIL("no python3 with jinja2 (make deps installs python3-jinja2)");
  rapidjson::Document job(rapidjson::kObjectType);
  auto& a = job.GetAllocator();
  job.AddMember("template", rapidjson::Value(path.c_str(), a), a);
  if (f.bos) job.AddMember("bos_token", rapidjson::Value(f.bos, a), a);
  if (f.eos) job.AddMember("eos_token", rapidjson::Value(f.eos, a), a);
  job.AddMember("cases", rapidjson::Value(cases, a), a);
  const std::string dir = test::temp_dir("jinja");
  files::write_atomic(dir + "/job.json", json::dump(job));
  const std::string command =
      fmt::format("{} {}/tests/tools/render_chat_templates.py {}/job.json {}/out.json", py,
                  ZT_SOURCE_ROOT, dir, dir);
  REQUIRE(std::system(command.c_str()) == 0);
  const rapidjson::Document out = json::parse(files::read_text(dir + "/out.json"), "out.json");
  REQUIRE(out.IsArray());
  REQUIRE(out.Size() == cases.Size());
  std::vector<Jinja2Rendering> renderings;
  for (const auto& r : out.GetArray()) {
    Jinja2Rendering one;
    if (r.HasMember("text")) {
      one.text = json::text(r["text"]);
    } else {
      one.error = json::text(r["error"]);
      one.raised = r.HasMember("raised") && r["raised"].GetBool();
    }
    renderings.push_back(std::move(one));
  }
  return renderings;
}

// jinja2's renderings of `cases` (messages, add_generation_prompt) with the template file at
// `path` (default: the format's reference text); nullopt where jinja2 stopped.
std::vector<std::optional<std::string>> reference(const Format& f,
                                                  const std::vector<std::pair<Turns, bool>>& cases,
                                                  std::string path = "") {
  if (path.empty()) path = fmt::format("{}/{}.jinja", ZT_DATA "/chat_templates", f.name);
  rapidjson::Document list(rapidjson::kArrayType);
  auto& a = list.GetAllocator();
  for (const auto& [turns, generation] : cases) {
    rapidjson::Value messages(rapidjson::kArrayType);
    for (const auto& [role, content] : turns) {
      rapidjson::Value m(rapidjson::kObjectType);
      m.AddMember("role", rapidjson::Value(role.c_str(), a), a);
      m.AddMember("content", rapidjson::Value(content.c_str(), a), a);
      messages.PushBack(m, a);
    }
    rapidjson::Value c(rapidjson::kObjectType);
    c.AddMember("messages", messages, a);
    c.AddMember("add_generation_prompt", generation, a);
    list.PushBack(c, a);
  }
  std::vector<std::optional<std::string>> texts;
  for (Jinja2Rendering& r : jinja2_render(f, path, list)) texts.push_back(std::move(r.text));
  return texts;
}

std::string joined(const std::vector<data::Piece>& pieces) {
  std::string s;
  for (const data::Piece& p : pieces) s += p.text;
  return s;
}

}  // namespace

TEST_CASE("each model format renders what transformers renders with the model's chat_template",
          "[data][templates]") {
  for (const Format& f : kFormats) {
    INFO("template " << f.name);
    const data::ChatTemplate& t = data::chat_template(f.name);
    CHECK(t.whole_text());
    // Whole conversations, and the prompt of each one's last user message.
    std::vector<std::pair<Turns, bool>> cases;
    for (const Turns& c : conversations()) {
      cases.emplace_back(c, false);
      cases.emplace_back(Turns(c.begin(), c.end() - 1), true);
    }
    const auto want = reference(f, cases);
    REQUIRE(want.size() == cases.size());
    for (size_t k = 0; k < cases.size(); ++k) {
      INFO("case " << k << (cases[k].second ? " (generation prompt)" : ""));
      const data::Chat chat = chat_of(cases[k].first);
      if (!want[k]) {  // the model's template refuses it: so does zerotrain, saying why
        CHECK_THROWS_AS(cases[k].second ? t.prompt(chat) : joined(t.render(chat)), ConfigError);
        continue;
      }
      const std::string got = cases[k].second ? t.prompt(chat) : joined(t.render(chat));
      CHECK(got == *want[k]);
    }
  }
}

namespace {

// Templates without a built-in format (tests/fixtures/chat_templates/SOURCES.md).
const Format kOtherTemplates[] = {
    {"gemma3", "<bos>", "<eos>"},
    {"gemma2", "<bos>", "<eos>"},
    {"mistral_nemo", "<s>", "</s>"},
    {"deepseek_v3", "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
     "<\uff5cend\u2581of\u2581sentence\uff5c>"},
    {"phi4", nullptr, "<|im_end|>"},
    {"phi3", "<s>", "<|endoftext|>"},
};

// llama.cpp's collection of real templates (models/templates/), with tool calls, tool results,
// tool definitions and reasoning: rendered over llamacpp/cases.json (SOURCES.md). The tokens are
// the models' own where the template uses them, none where it does not.
const char* const kDeepSeekBos = "<\uff5cbegin\u2581of\u2581sentence\uff5c>";
const Format kLlamaCppTemplates[] = {
    {"llamacpp/ByteDance-Seed-OSS", nullptr, nullptr},
    {"llamacpp/CohereForAI-c4ai-command-r-plus-tool_use", "<BOS_TOKEN>", nullptr},
    {"llamacpp/CohereForAI-c4ai-command-r7b-12-2024-tool_use", "<BOS_TOKEN>", nullptr},
    {"llamacpp/GLM-4.6", nullptr, nullptr},
    {"llamacpp/GLM-4.7-Flash", nullptr, nullptr},
    {"llamacpp/glm_4_5", nullptr, nullptr},
    {"llamacpp/HuggingFaceTB-SmolLM3-3B", nullptr, nullptr},
    {"llamacpp/Kimi-K2-Thinking", nullptr, nullptr},
    {"llamacpp/moonshotai-Kimi-K2", nullptr, nullptr},
    {"llamacpp/MiniMax-M2", nullptr, nullptr},
    {"llamacpp/mistralai-Mistral-Small-3.1-24B-Instruct-2503", "<s>", "</s>"},
    {"llamacpp/Mistral-Small-3.2-24B-Instruct-2506", "<s>", "</s>"},
    {"llamacpp/unsloth-mistral-Devstral-Small-2507", "<s>", "</s>"},
    {"llamacpp/NVIDIA-Nemotron-Nano-v2", nullptr, nullptr},
    {"llamacpp/NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "<|begin_of_text|>", nullptr},
    {"llamacpp/Qwen-Qwen2.5-7B-Instruct", nullptr, nullptr},
    {"llamacpp/Qwen-Qwen3-0.6B", nullptr, nullptr},
    {"llamacpp/Qwen3-Coder", nullptr, nullptr},
    {"llamacpp/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", kDeepSeekBos, nullptr},
    {"llamacpp/deepseek-ai-DeepSeek-V3.1", kDeepSeekBos, nullptr},
    {"llamacpp/deepseek-ai-DeepSeek-V3.2", kDeepSeekBos, nullptr},
    {"llamacpp/google-gemma-4-31B-it", "<bos>", nullptr},
    {"llamacpp/ibm-granite-granite-3.3-2B-Instruct", nullptr, nullptr},
    {"llamacpp/llama-cpp-microsoft-Phi-4-mini-instruct", nullptr, "<|endoftext|>"},
    {"llamacpp/meetkai-functionary-medium-v3.1", "<|begin_of_text|>", nullptr},
    {"llamacpp/meetkai-functionary-medium-v3.2", "<|begin_of_text|>", nullptr},
    {"llamacpp/meta-llama-Llama-3.1-8B-Instruct", "<|begin_of_text|>", nullptr},
    {"llamacpp/meta-llama-Llama-3.2-3B-Instruct", "<|begin_of_text|>", nullptr},
    {"llamacpp/openai-gpt-oss-120b", nullptr, nullptr},
};

// Every template the interpreter is checked on: the built-in formats' texts and the others.
std::vector<std::pair<Format, std::string>> all_template_files() {
  std::vector<std::pair<Format, std::string>> out;
  for (const Format& f : kFormats)
    out.emplace_back(f, fmt::format("{}/chat_templates/{}.jinja", ZT_DATA, f.name));
  for (const Format& f : kOtherTemplates)
    out.emplace_back(f, fmt::format("{}/chat_templates/{}.jinja", ZT_FIXTURES, f.name));
  return out;
}

jinja::Dict context_of(const Format& f, const Turns& turns, bool generation) {
  jinja::List messages;
  for (const auto& [role, content] : turns)
    messages.emplace_back(
        jinja::Dict{{"role", jinja::Value(role)}, {"content", jinja::Value(content)}});
  jinja::Dict c{{"messages", jinja::Value(messages)},
                {"add_generation_prompt", jinja::Value(generation)},
                {"tools", jinja::Value::none()},
                {"documents", jinja::Value::none()}};
  if (f.bos) c.emplace_back("bos_token", jinja::Value(f.bos));
  if (f.eos) c.emplace_back("eos_token", jinja::Value(f.eos));
  return c;
}

// A model folder holding only `file`'s template in tokenizer_config.json with f's tokens.
std::string folder_with(const Format& f, const std::string& file) {
  const std::string dir = test::temp_dir("template_folder");
  rapidjson::Document config(rapidjson::kObjectType);
  auto& a = config.GetAllocator();
  const std::string text = files::read_text(file);
  config.AddMember("chat_template", rapidjson::Value(text.c_str(), a), a);
  if (f.bos) config.AddMember("bos_token", rapidjson::Value(f.bos, a), a);
  if (f.eos) config.AddMember("eos_token", rapidjson::Value(f.eos, a), a);
  files::write_atomic(dir + "/tokenizer_config.json", json::dump(config, true));
  return dir;
}

}  // namespace

TEST_CASE("the Jinja interpreter renders every chat template as jinja2 does under transformers",
          "[data][templates][jinja]") {
  for (const auto& [f, file] : all_template_files()) {
    INFO("template " << file);
    const jinja::Template t(files::read_text(file), file);
    std::vector<std::pair<Turns, bool>> cases;
    for (const Turns& c : conversations()) {
      cases.emplace_back(c, false);
      cases.emplace_back(Turns(c.begin(), c.end() - 1), true);
    }
    const auto want = reference(f, cases, file);
    REQUIRE(want.size() == cases.size());
    for (size_t k = 0; k < cases.size(); ++k) {
      INFO("case " << k << (cases[k].second ? " (generation prompt)" : ""));
      const jinja::Dict context = context_of(f, cases[k].first, cases[k].second);
      if (!want[k]) {  // raise_exception in jinja2: a ConfigError here
        CHECK_THROWS_WITH(t.render(context), Contains("the template raised"));
        continue;
      }
      CHECK(t.render(context).text == *want[k]);
    }
  }
}

namespace {

// One conversation of llamacpp/cases.json: its entry of the jinja2 script's job (tools resolved
// from tool_sets) and the same as the interpreter's context.
struct JsonCase {
  std::string name;
  jinja::Dict context;  // without the special tokens
};

// The cases, and their job entries (appended to `job_cases`, allocated in `doc`).
std::vector<JsonCase> json_cases(rapidjson::Document& doc, rapidjson::Value& job_cases) {
  const std::string file = ZT_FIXTURES "/chat_templates/llamacpp/cases.json";
  const rapidjson::Document all = json::parse(files::read_text(file), file);
  auto& a = doc.GetAllocator();
  std::vector<JsonCase> out;
  for (const auto& c : all["cases"].GetArray()) {
    rapidjson::Value entry(rapidjson::kObjectType);
    entry.AddMember("messages", rapidjson::Value(c["messages"], a), a);
    entry.AddMember("add_generation_prompt", c["add_generation_prompt"].GetBool(), a);
    if (c.HasMember("tools"))
      entry.AddMember("tools", rapidjson::Value(all["tool_sets"][c["tools"].GetString()], a), a);
    if (c.HasMember("kwargs")) entry.AddMember("kwargs", rapidjson::Value(c["kwargs"], a), a);
    // The interpreter's context from the same JSON: what transformers passes (tools None when
    // there are none), then the extra variables.
    const jinja::Value v = jinja::from_json(json::dump(entry), file);
    jinja::Dict context{
        {"messages", v.get("messages")},
        {"tools", v.get("tools").is_undefined() ? jinja::Value::none() : v.get("tools")},
        {"documents", jinja::Value::none()},
        {"add_generation_prompt", v.get("add_generation_prompt")}};
    if (const jinja::Value kwargs = v.get("kwargs"); kwargs.is_dict())
      context.insert(context.end(), kwargs.dict().begin(), kwargs.dict().end());
    out.push_back({json::text(c["name"]), std::move(context)});
    job_cases.PushBack(entry, a);
  }
  return out;
}

}  // namespace

TEST_CASE("the Jinja interpreter renders llama.cpp's templates with tools and reasoning as jinja2",
          "[data][templates][jinja]") {
  rapidjson::Document doc(rapidjson::kObjectType);
  rapidjson::Value job_cases(rapidjson::kArrayType);
  const std::vector<JsonCase> cases = json_cases(doc, job_cases);
  REQUIRE(cases.size() >= 10);
  for (const Format& f : kLlamaCppTemplates) {
    const std::string file = fmt::format("{}/chat_templates/{}.jinja", ZT_FIXTURES, f.name);
    INFO("template " << file);
    std::optional<jinja::Template> t;
    try {
      t.emplace(files::read_text(file), file);
    } catch (const ConfigError& e) {
      FAIL_CHECK("the interpreter refuses the template: " << e.what());
      continue;
    }
    const std::vector<Jinja2Rendering> want = jinja2_render(f, file, job_cases);
    size_t rendered = 0;
    for (size_t k = 0; k < cases.size(); ++k) {
      INFO("case " << k << ": " << cases[k].name);
      jinja::Dict context = cases[k].context;
      if (f.bos) context.emplace_back("bos_token", jinja::Value(f.bos));
      if (f.eos) context.emplace_back("eos_token", jinja::Value(f.eos));
      if (!want[k].text) {
        INFO("jinja2: " << want[k].error);
        if (want[k].raised) {  // the template's raise_exception: the same refusal, its message
          CHECK_THROWS_WITH(t->render(context),
                            Contains("the template raised") && Contains(want[k].error));
        } else {  // jinja2 itself stops (undefined used, wrong type, sandbox): a ConfigError
          CHECK_THROWS_AS(t->render(context), ConfigError);
        }
        continue;
      }
      ++rendered;
      CHECK(t->render(context).text == *want[k].text);
    }
    // Every template renders some of the cases, so none is checked only on its refusals.
    CHECK(rendered > 0);
  }
}

TEST_CASE("the Jinja interpreter's semantics at their edges are jinja2's",
          "[data][templates][jinja]") {
  // Scoping, loop variables, filters, tests, methods, slices and printing, each a template of
  // its own rendered by both over one conversation.
  const std::vector<std::string> snippets = {
      "{% set s = 'ab' %}{% for i in range(3) %}{% set s = s ~ s %}{{ s|length }} {% endfor %}"
      "{{ s|length }}",
      "{% for i in range(3) %}{% if i == 0 %}{% set t = 'x' %}{% endif %}[{{ t }}]{% endfor %}",
      "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
      "{{ ns.n }}",
      "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ loop.first }}{{ loop.last }}"
      "{{ loop.revindex0 }}{% if not loop.last %},{% endif %}{% endfor %}",
      "{% for m in messages if m.role == 'assistant' %}{{ loop.index0 }}:{{ m.content[:3] }}|"
      "{% else %}none{% endfor %}",
      "{{ messages|length }} {{ messages|map(attribute='role')|join(',') }} "
      "{{ messages|selectattr('role', 'equalto', 'user')|list|length }}",
      "{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1.0 }} {{ 1e3 }} "
      "{{ 3.14 * 2 }} {{ true }} {{ none }} {{ [1, 'a', none] }} {{ {'k': 1} }}",
      "{{ 'a,b,,c'.split(',') }} {{ '  x  '.strip() }}|{{ 'xxhixx'.strip('x') }} "
      "{{ 'Hello'.startswith('He') }} {{ 'abc'[::-1] }} {{ 'héllo'[1:3] }} "
      "{{ 'a b  c'.split() }} {{ 'a-b-c'.rsplit('-', 1) }} {{ 'ab' * 3 }}",
      "{{ messages[0]|tojson }} {{ {'a': [1, 2.5, none, true, 'é\n']}|tojson(indent=2) }}",
      "{% macro m(x, y='d') %}<{{ x }}{{ y }}>{% endmacro %}{{ m(1) }}{{ m(2, y='e') }}{{ m(x=3) "
      "}}",
      "{%- for m in messages -%}\n  {{ m.role }}\n{%- endfor %}\n  {% if true %}\n    "
      "x\n  {% endif %}\n{# c #}\ny",
      "{{ 'x' if messages|length > 2 else 'y' }} {{ 1 < 2 < 3 }} {{ 'a' in 'cat' }} "
      "{{ 'role' in messages[0] }} {{ 3 is odd }} {{ none is none }} {{ 'x' is string }} "
      "{{ messages is iterable }} {{ undefined_thing is defined }} {{ 4 is divisibleby 2 }}",
      "{% filter upper %}abc {{ messages[0].role }}{% endfilter %} {% set b %}in{{ 1 }}"
      "{% endset %}[{{ b }}] {{ messages|last|tojson }}",
      "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %} "
      "{{ {'a': 1}.get('z', 'dflt') }} {{ [3, 1, 2]|sort|join }} {{ [1, 2, 2]|unique|list }} "
      "{{ ' x '|trim }}|{{ 'x'|default('d') }}{{ nothing|default('d') }} {{ 'A b'|lower }}",
      // Markup (|safe, |escape): what is added, joined or formatted into it is escaped; ~ and
      // tojson give plain text.
      "{{ \"<a href='\"|safe + \"x'y\\\"<&\" + \"'>\"|safe }} {{ ('<'|safe ~ '<') + '>' }} "
      "{{ '<b>'|e }} {{ '<b>'|e|e }} {{ '<b>'|safe|forceescape }} {{ ('x'|safe).upper() + '&' }} "
      "{{ ' <x> '|safe|trim + '<' }} {{ (','|safe).join(['<', '>']) }} "
      "{{ ['<', '>']|join(','|safe) }} {{ ('a<'|safe)[1] + '<' }} {{ ('<a>'|safe * 2) + '&' }} "
      "{{ ['x'|safe] }} {{ ('{}'|safe).format('<') }} {{ ('<'|safe|string) + '<' }} "
      "{{ ('a'|safe).replace(\"'\", 'x') }} {{ {'k': '<'|safe}|tojson + '<' }}",
      // Dict keys of any scalar type (1, 1.0 and True one key; json.dumps' key strings); tuples.
      "{% set d = {1: 'a', 0: 'b', 'k': 'c', none: 'n', 2.5: 'f', true: 'T'} %}{{ d[1] }}"
      "{{ d[0] }}{{ d['k'] }}{{ d[none] }} {{ d }} {{ d|tojson }} {{ 1 in d }} {{ '1' in d }} "
      "{{ d.get(0) }}{{ d.get(7, 'z') }} {{ {1: 2} == {1.0: 2} }} {{ d|length }} {{ d|list }} "
      "{% for k, v in {16: 'x', 2: 'y'}|dictsort %}{{ k }}{{ v }}{% endfor %} "
      "{{ {3: 'a', 1: 'b'}|tojson(sort_keys=true) }} {{ {2: 'x'}.items()|list }} "
      "{{ (1, 'a') }} {{ (1,) }} {{ (1, 2) == [1, 2] }} {{ (1,) + (2,) }} {{ {(1, 2): 'p'} }}",
      // sort, unique, min, max, dictsort: case-insensitive unless told; dictsort by / reverse.
      "{{ ['b', 'A', 'a', 'C']|sort }} {{ ['b', 'A', 'a', 'C']|sort(case_sensitive=true) }} "
      "{{ ['b', 'A', 'a']|sort(reverse=true) }} {{ ['a', 'A', 'b', 'B']|unique|list }} "
      "{{ ['b', 'A', 'B']|min }} {{ ['b', 'A', 'B']|max }} "
      "{{ ['b', 'A']|max(case_sensitive=true) }} "
      "{% for k, v in {'b': 1, 'A': 2, 'c': 3}|dictsort %}{{ k }}{% endfor %} "
      "{{ {'x': 2, 'y': 1, 'Z': 3}|dictsort(by='value') }} "
      "{{ {'x': 2, 'Y': 1}|dictsort(reverse=true) }} "
      "{{ messages|map(attribute='role')|unique|list }} "
      "{{ messages|sort(attribute='role')|map(attribute='role')|join }}",
      // Filters that walk a value yield nothing for a false one.
      "{{ none|selectattr('a')|list }} {{ none|map(attribute='a')|list }} {{ ''|select|list }} "
      "{{ none|reject('none')|list }} {{ none|rejectattr('a', 'none')|list }} "
      "{{ 0|map('string')|list }}",
      // Case, lines, padding, replace and repr as Python's.
      "{{ 'Éa ñ ǅ'|upper }} {{ 'ÉA Ñ'|lower }} {{ 'Éa'.upper() }} "
      "{{ 'hello-wORLD of (jinja) it\\'s'|title }} "
      "{{ 'a\\r\\nb\\rc\\x0bd\\n\\ne\\n'.splitlines() }} "
      "{{ 'x\\r\\ny\\n\\nz'|indent(2, first=true) }}|{{ 'x\\n\\ny\\n'|indent(blank=true) }}|"
      "{{ ''|indent(first=true) }}|{{ 'ab'|center(5) }}|{{ 'abc'|center(6) }}| "
      "{{ 'abc'.replace('', '-') }} {{ 'abc'|replace('', '-', 2) }} "
      "{{ 'aaa'.replace('a', 'bb', 2) }} "
      "{{ ['\\x00\\x7f\\xa0\\u200b\\u2028é✓\\U0001F600', \"a'b\", 'a\"b'] }}",
  };
  const Format f{"snippet", "<s>", "</s>"};
  const std::vector<std::pair<Turns, bool>> cases = {{conversations()[1], false}};
  for (const std::string& text : snippets) {
    INFO(text);
    const std::string file = test::temp_dir("snippet") + "/t.jinja";
    files::write_atomic(file, text);
    const auto want = reference(f, cases, file);
    REQUIRE(want[0]);
    CHECK(jinja::Template(text, file).render(context_of(f, cases[0].first, false)).text ==
          *want[0]);
  }
}

TEST_CASE("a chat template without a built-in format trains its replies as transformers renders it",
          "[data][templates][jinja]") {
  // llama.cpp's copies of templates zerotrain has built in: `auto` picks the built-in format,
  // which must then render and train them as the rest.
  const std::map<std::string, std::string> built_in = {
      {"llamacpp/Qwen-Qwen2.5-7B-Instruct", "qwen2.5"},
      {"llamacpp/Qwen-Qwen3-0.6B", "qwen3"},
      {"llamacpp/meta-llama-Llama-3.1-8B-Instruct", "llama3.1"},
      {"llamacpp/meta-llama-Llama-3.2-3B-Instruct", "llama3.2"},
  };
  // Templates that jinja2 cannot render without tool definitions (they walk `tools`, which
  // transformers passes as None): no plain conversation to train on.
  const std::set<std::string> need_tools = {
      "llamacpp/llama-cpp-microsoft-Phi-4-mini-instruct",
      "llamacpp/NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
      "llamacpp/CohereForAI-c4ai-command-r-plus-tool_use",
  };
  std::vector<Format> templates(std::begin(kOtherTemplates), std::end(kOtherTemplates));
  for (const Format& f : kLlamaCppTemplates)
    if (!need_tools.count(f.name)) templates.push_back(f);
  for (const Format& f : templates) {
    INFO("template " << f.name);
    const std::string file = fmt::format("{}/chat_templates/{}.jinja", ZT_FIXTURES, f.name);
    const std::string dir = folder_with(f, file);
    std::string source;
    const std::string name = data::detect_chat_template(dir, &source);
    const auto known = built_in.find(f.name);
    CHECK(name ==
          (known != built_in.end() ? known->second : "jinja:" + dir + "/tokenizer_config.json"));
    CHECK_THAT(source, Contains("tokenizer_config.json"));
    const data::ChatTemplate& t = data::chat_template(name);
    CHECK(t.whole_text());
    std::vector<std::pair<Turns, bool>> cases;
    for (const Turns& c : conversations()) {
      cases.emplace_back(c, false);
      cases.emplace_back(Turns(c.begin(), c.end() - 1), true);
    }
    const auto want = reference(f, cases, file);
    for (size_t k = 0; k < cases.size(); ++k) {
      INFO("case " << k << (cases[k].second ? " (generation prompt)" : ""));
      const data::Chat chat = chat_of(cases[k].first);
      if (!want[k]) {
        CHECK_THROWS_AS(cases[k].second ? t.prompt(chat) : joined(t.render(chat)), ConfigError);
        continue;
      }
      if (cases[k].second) {
        CHECK(t.prompt(chat) == *want[k]);
        continue;
      }
      const std::vector<data::Piece> pieces = t.render(chat);
      CHECK(joined(pieces) == *want[k]);
      // One trained piece per reply, holding the reply's text (as the template writes it) and
      // starting where the generation prompt of the turns before it ends.
      std::vector<std::string> trained;
      size_t replies = 0;
      for (const data::Piece& p : pieces) {
        if (p.trained) trained.push_back(p.text);
      }
      for (const auto& m : cases[k].first) replies += m.first == "assistant";
      REQUIRE(trained.size() == replies);
      // A reply never starts inside a tag (a special token split between prompt and reply),
      // however the template frames a reply's reasoning.
      for (size_t i = 0; i + 1 < pieces.size(); ++i) {
        if (pieces[i].trained || !pieces[i + 1].trained) continue;
        const size_t open = pieces[i].text.rfind('<');
        CHECK((open == std::string::npos || pieces[i].text.find('>', open) != std::string::npos));
      }
      size_t r = 0;
      for (const auto& m : cases[k].first) {
        if (m.first != "assistant") continue;
        std::string reply = m.second;
        // Templates trim or split the reply; its last word is there either way.
        const size_t space = reply.find_last_not_of(" \t\n\u3000");
        CHECK_FALSE(trained[r].empty());
        if (space != std::string::npos) {
          const size_t word = reply.find_last_of(" \n", space);
          CHECK_THAT(trained[r], Contains(reply.substr(
                                     word == std::string::npos ? 0 : word + 1,
                                     space - (word == std::string::npos ? 0 : word + 1) + 1)));
        }
        ++r;
      }
    }
  }
  // A template file named on the command line, and what cannot be read, named.
  const std::string file = fmt::format("{}/chat_templates/phi4.jinja", ZT_FIXTURES);
  const data::ChatTemplate& named = data::chat_template("jinja:" + file);
  data::Chat chat;
  chat.messages.push_back({"user", "Hi", ""});
  CHECK(named.prompt(chat) ==
        "<|im_start|>user<|im_sep|>Hi<|im_end|><|im_start|>assistant<|im_sep|>");
  CHECK_THROWS_WITH(data::chat_template("jinja:/nonexistent/t.jinja"),
                    Contains("/nonexistent/t.jinja"));
  const std::string bad = test::temp_dir("bad_template") + "/t.jinja";
  files::write_atomic(bad, "{% for x in %}{% endfor %}");
  CHECK_THROWS_WITH(data::chat_template("jinja:" + bad), Contains(bad) && Contains("line 1"));
}

TEST_CASE("template auto recognizes each model's chat_template and keeps alpaca_zh without one",
          "[data][templates]") {
  for (const Format& f : kFormats) {
    INFO(f.name);
    const std::string text =
        files::read_text(fmt::format("{}/chat_templates/{}.jinja", ZT_DATA, f.name));
    // In tokenizer_config.json, as most folders carry it.
    const std::string dir = test::temp_dir("auto");
    rapidjson::Document config(rapidjson::kObjectType);
    config.AddMember("chat_template", rapidjson::Value(text.c_str(), config.GetAllocator()),
                     config.GetAllocator());
    files::write_atomic(dir + "/tokenizer_config.json", json::dump(config, true));
    std::string source;
    CHECK(data::detect_chat_template(dir, &source) == f.name);
    CHECK_THAT(source, Contains("tokenizer_config.json"));
    // As chat_template.jinja, which newer transformers write (it wins over the JSON).
    files::write_atomic(dir + "/chat_template.jinja", text + "\n");
    CHECK(data::detect_chat_template(dir, &source) == f.name);
    CHECK_THAT(source, Contains("chat_template.jinja"));
  }
  const std::string none = test::temp_dir("auto_none");
  files::write_atomic(none + "/tokenizer_config.json", R"({"bos_token": "<s>"})");
  CHECK(data::detect_chat_template(none) == "alpaca_zh");
  CHECK(data::detect_chat_template("") == "alpaca_zh");
  const std::string other = test::temp_dir("auto_other");
  files::write_atomic(other + "/tokenizer_config.json",
                      R"({"chat_template": "{{ messages[0]['content'] }}"})");
  // Another template: rendered as written by the Jinja interpreter; one it cannot parse is
  // refused naming the file and the line.
  CHECK(data::detect_chat_template(other) == "jinja:" + other + "/tokenizer_config.json");
  files::write_atomic(other + "/chat_template.jinja", "{{ messages[0]['content'] }}\n{% raw %}");
  CHECK_THROWS_WITH(data::detect_chat_template(other), Contains(other + "/chat_template.jinja") &&
                                                           Contains("line 2") && Contains("raw"));
  // The list form: the "default" entry.
  const std::string listed = test::temp_dir("auto_list");
  rapidjson::Document config(rapidjson::kObjectType);
  rapidjson::Value entries(rapidjson::kArrayType), entry(rapidjson::kObjectType);
  const std::string text = files::read_text(std::string(ZT_DATA) + "/chat_templates/qwen3.jinja");
  entry.AddMember("name", "default", config.GetAllocator());
  entry.AddMember("template", rapidjson::Value(text.c_str(), config.GetAllocator()),
                  config.GetAllocator());
  entries.PushBack(entry, config.GetAllocator());
  config.AddMember("chat_template", entries, config.GetAllocator());
  files::write_atomic(listed + "/tokenizer_config.json", json::dump(config));
  CHECK(data::detect_chat_template(listed) == "qwen3");
}

TEST_CASE("model formats train the replies and their end-of-turn markers, encoded as one text",
          "[data][templates]") {
  // With the byte-level tokenizer every character is its own token, so the trained tokens
  // decode to exactly the trained text (special markers included, as bytes).
  const std::string line =
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},)"
      R"( {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},)"
      R"( {"role": "assistant", "content": "Goodbye."}]})";
  // GLM-4's and ChatGLM3's templates write no end of turn: each reply's "\n" (ChatGLM3: "\n ")
  // + content trains, then one eos after the conversation (as their own fine-tuning scripts do).
  const struct {
    const char* name;
    const char* trained;
    bool final_eos;  ///< one trained eos after the rendered conversation
  } cases[] = {
      {"qwen2.5", "Hello!<|im_end|>Goodbye.<|im_end|>", false},
      {"llama3", "Hello!<|eot_id|>Goodbye.<|eot_id|>", false},
      {"llama2", "Hello! </s>Goodbye. </s>", false},
      {"mistral_v0.3", "Hello! </s>Goodbye. </s>", false},
      {"chatglm3", "\n Hello!\n Goodbye.", true},
      {"glm4", "\nHello!\nGoodbye.", true},
  };
  const std::string dir = test::temp_dir("labels");
  files::write_atomic(dir + "/d.jsonl", line + "\n");
  for (const auto& c : cases) {
    INFO(c.name);
    DataOptions o;
    o.template_name = c.name;
    Dataset d = tokenize_jsonl(dir + "/d.jsonl", *byte_tokenizer(), o);
    REQUIRE(d.size() == 1);
    std::vector<int32_t> trained;
    for (int64_t i = 0; i < d.length(0); ++i) {
      if (d.labels(0)[i] != kIgnoreLabel) trained.push_back(d.labels(0)[i]);
    }
    if (c.final_eos) {
      REQUIRE_FALSE(trained.empty());
      CHECK(trained.back() == byte_tokenizer()->eos_id());
      trained.pop_back();
    }
    CHECK(byte_tokenizer()->decode(trained) == c.trained);
    // The ids are the whole rendering's, and no bos is added beside the template's own.
    data::Chat chat;
    chat.system = "S";
    chat.messages = {{"user", "Hi", ""},
                     {"assistant", "Hello!", ""},
                     {"user", "Bye", ""},
                     {"assistant", "Goodbye.", ""}};
    std::vector<int32_t> want =
        byte_tokenizer()->encode(joined(data::chat_template(c.name).render(chat)));
    if (c.final_eos) want.push_back(byte_tokenizer()->eos_id());
    CHECK(d.ids(0).to_vector() == want);
  }
  // A format whose special tokens the tokenizer lacks is refused when the run picks it.
  CHECK_THROWS_WITH(resolve_template("qwen3", "", *byte_tokenizer()), Contains("<|im_start|>"));
  CHECK(resolve_template("alpaca", "", *byte_tokenizer()) == "alpaca");
  CHECK(resolve_template("auto", "", *byte_tokenizer()) == "alpaca_zh");
}

// Run by ctest's real_tokenizer_templates with ZT_REAL_TOKENIZERS: folders of the models'
// published tokenizer.json + tokenizer_config.json (tests/tools/fetch_real_tokenizers.sh).
TEST_CASE("real tokenizer folders: auto picks the model's format and trains its replies",
          "[.real]") {
  const char* root = std::getenv("ZT_REAL_TOKENIZERS");
  REQUIRE(root != nullptr);
  const struct {
    const char* package;
    const char* format;
    const char* trained;  // the replies with their end-of-turn markers, as decoded with specials
  } cases[] = {
      {"qwen3", "qwen3", "Hello!<|im_end|>Goodbye.<|im_end|>"},
      {"llama3", "llama3_original", "Hello!<|eot_id|>Goodbye.<|eot_id|>"},
      {"qwen2_5", "qwen2.5", "Hello!<|im_end|>Goodbye.<|im_end|>"},
      {"llama3_2", "llama3.2", "Hello!<|eot_id|>Goodbye.<|eot_id|>"},
  };
  const std::string dir = test::temp_dir("real");
  files::write_atomic(
      dir + "/d.jsonl",
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},)"
      R"( {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]})"
      "\n");
  for (const auto& c : cases) {
    INFO(c.package);
    const std::string folder = std::string(root) + "/" + c.package;
    REQUIRE(fs::exists(folder + "/tokenizer_config.json"));
    auto tok = load_tokenizer(folder, 1 << 30);
    std::string source;
    const std::string name = resolve_template("auto", folder, *tok, &source);
    CHECK(name == c.format);
    CHECK_THAT(source, Contains("tokenizer_config.json"));
    DataOptions o;
    o.template_name = name;
    Dataset d = tokenize_jsonl(dir + "/d.jsonl", *tok, o);
    std::vector<int32_t> trained;
    for (int64_t i = 0; i < d.length(0); ++i) {
      if (d.labels(0)[i] != kIgnoreLabel) trained.push_back(d.labels(0)[i]);
    }
    auto* hf = dynamic_cast<const HfTokenizer*>(tok.get());
    REQUIRE(hf != nullptr);
    CHECK(hf->decode(trained, /*skip_special_tokens=*/false) == c.trained);
  }
}

TEST_CASE("hostile chat templates are refused naming the file and line, never a crash",
          "[data][templates][jinja][hostile]") {
  const auto refused = [](const std::string& text, const char* expected) {
    INFO(text.substr(0, 120));
    try {
      const jinja::Template t(text, "hostile.jinja");
      t.render({{"messages", jinja::Value(jinja::List{})}});
    } catch (const ConfigError& e) {
      CHECK_THAT(e.what(), Contains("hostile.jinja") && Contains(expected));
      return;
    }
    FAIL("accepted");
  };
  // Nesting past any template's: brackets, signs, blocks.
  refused("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}", "nested");
  refused("{{ " + std::string(100000, '-') + "1 }}", "nested");
  std::string blocks;
  for (int i = 0; i < 50000; ++i) blocks += "{% if true %}";
  refused(blocks, "nested");
  // What grows without bound: repetition, recursion, ranges, integers.
  refused("{{ 'x' * 100000000000 }}", "larger");
  refused("{% set s = 'x' * 1000000 %}{% for i in range(200) %}{{ s }}{% endfor %}", "larger");
  refused("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nested more than");
  refused("{{ range(100000000000) | length }}", "range");
  refused("{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}",
          "loop steps");
  refused(
      "{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}"
      "{{ f(0) }}",
      "loop steps");
  refused(
      "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
      "{% endfor %}",
      "larger");
  refused("{{ 9223372036854775807 + 1 }}", "overflow");
  refused("{{ range(1e30) }}", "range");
  refused("{{ 'a'|indent(1000000000000) }}", "indent");
  // What escaping, replacing, joining and indenting multiply is bounded where it is built.
  refused("{% set s = 'x' * 10000000 %}{{ s.replace('x', 'yyyyyyyyyy') }}", "larger");
  refused("{% set s = 'x' * 10000000 %}{{ s.replace('', 'yyyyyyyyyy') }}", "larger");
  refused("{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|join }}", "larger");
  refused("{% set s = '\\n' * 1000000 %}{{ s|indent(100, blank=true) }}", "larger");
  refused("{% set s = '\"' * 20000000 %}{{ 'x'|safe + s + s }}", "larger");
  // Long chains build trees evaluation would recurse down; values that hold themselves.
  std::string chain = "{{ 1";
  for (int i = 0; i < 100000; ++i) chain += " + 1";
  refused(chain + " }}", "nested");
  std::string nots = "{{ ";
  for (int i = 0; i < 100000; ++i) nots += "not ";
  refused(nots + "x }}", "nested");
  std::string filters = "{{ 'x'";
  for (int i = 0; i < 100000; ++i) filters += "|trim";
  refused(filters + " }}", "nested");
  std::string conditions = "{{ 1";
  for (int i = 0; i < 100000; ++i) conditions += " if x else 1";
  refused(conditions + " }}", "nested");
  refused("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns|tojson }}", "nested");
  refused(
      "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}"
      "{% endfor %}{{ ns.l }}",
      "nested");
  // Subscripts with nothing, or two things, between the brackets (the fuzzer's find).
  refused("{{ x[] }}", "empty subscript");
  refused("{%- if too[].0 %}{% endif %}", "empty subscript");
  refused("{{ x[1 2] }}", "expected ':' or ']'");
  refused("{{ x[1:2 3] }}", "expected ':' or ']'");
  refused("{{ 2 ** 64 }}", "overflow");
  refused("{{ 1 // 0 }}", "division by zero");
  refused("{{ 99999999999999999999999 }}", "64 bits");
  refused("{{ '\\xZZ' }}", "non-hex");
  // Unclosed or unknown constructs, wrong types.
  refused("{% if x %}", "endif");
  refused("{{ 'abc }}", "not closed");
  refused("{% include 'x.jinja' %}", "include");
  refused("{{ x | no_such_filter }}", "no_such_filter");
  refused("{{ 1 is no_such_test }}", "no_such_test");
  refused("{{ undefined_name.attribute }}", "undefined_name");
  refused("{{ 'a' < 1 }}", "not supported");
  refused("{{ raise_exception('stop here') }}", "stop here");
}

TEST_CASE("template kwargs render the folder's own template as written, as apply_chat_template",
          "[data][templates]") {
  // Qwen3's template, whose generation prompt enable_thinking false closes an empty think block:
  // --template auto with kwargs renders the text itself (not the built-in qwen3 format, which
  // takes none), the kwargs riding in the template's name.
  const Format qwen3{"qwen3", nullptr, "<|im_end|>"};
  const std::string file = std::string(ZT_DATA) + "/chat_templates/qwen3.jinja";
  const std::string dir = folder_with(qwen3, file);
  std::shared_ptr<Tokenizer> tok = HfTokenizer::load(ZT_FIXTURES "/tokenizers/qwen2");
  CHECK(resolve_template("auto", dir, *tok) == "qwen3");
  const std::string name =
      resolve_template("auto", dir, *tok, nullptr, R"({"enable_thinking": false})");
  CHECK_THAT(name, Contains("jinja:") && Contains("?{\"enable_thinking\":false}"));
  const data::ChatTemplate& t = data::chat_template(name);
  // jinja2's rendering with the same kwarg, of a conversation and of its prompt.
  rapidjson::Document job(rapidjson::kArrayType);
  auto& a = job.GetAllocator();
  const Turns turns = conversations().front();
  for (const bool generation : {false, true}) {
    rapidjson::Value messages(rapidjson::kArrayType);
    const size_t n = generation ? turns.size() - 1 : turns.size();
    for (size_t i = 0; i < n; ++i) {
      rapidjson::Value m(rapidjson::kObjectType);
      m.AddMember("role", rapidjson::Value(turns[i].first.c_str(), a), a);
      m.AddMember("content", rapidjson::Value(turns[i].second.c_str(), a), a);
      messages.PushBack(m, a);
    }
    rapidjson::Value c(rapidjson::kObjectType);
    c.AddMember("messages", messages, a);
    c.AddMember("add_generation_prompt", generation, a);
    rapidjson::Value kwargs(rapidjson::kObjectType);
    kwargs.AddMember("enable_thinking", false, a);
    c.AddMember("kwargs", kwargs, a);
    job.PushBack(c, a);
  }
  const std::vector<Jinja2Rendering> want = jinja2_render(qwen3, file, job);
  REQUIRE(want.size() == 2);
  REQUIRE(want[0].text);
  REQUIRE(want[1].text);
  CHECK(joined(t.render(chat_of(turns))) == *want[0].text);
  CHECK(t.prompt(chat_of(Turns(turns.begin(), turns.end() - 1))) == *want[1].text);
  // The built-in format's prompt differs there: the kwarg reached the template.
  CHECK(data::chat_template("qwen3").prompt(chat_of(Turns(turns.begin(), turns.end() - 1))) !=
        *want[1].text);
  // Kwargs for a format that takes none, or that are not an object, are refused naming the option.
  CHECK_THROWS_WITH(resolve_template("qwen3", dir, *tok, nullptr, R"({"enable_thinking": false})",
                                     "enable_thinking"),
                    Contains("enable_thinking") && Contains("qwen3"));
  CHECK_THROWS_WITH(resolve_template("auto", dir, *tok, nullptr, "[1]", "chat_template_kwargs"),
                    Contains("chat_template_kwargs") && Contains("JSON object"));
  // Malformed or deeply nested kwargs: an error naming the option, never a deep recursion.
  for (const std::string& bad : {std::string("{\"a\": "), std::string(100000, '[')}) {
    CHECK_THROWS_WITH(resolve_template("auto", dir, *tok, nullptr, bad, "chat_template_kwargs"),
                      Contains("chat_template_kwargs"));
  }
}
