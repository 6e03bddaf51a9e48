// libFuzzer: a model folder's chat template (chat_template.jinja / tokenizer_config.json), parsed
// and rendered by the Jinja interpreter over a small conversation, with and without the
// generation prompt — a ConfigError or text, in bounded time and memory, whatever the template.
#include <cstdint>
#include <string>

#include "data/jinja.hpp"
#include "zerotrain/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace j = zt::jinja;
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const j::Template t(text, "fuzz.jinja");
    const auto message = [](const char* role, const char* content) {
      return j::Value(j::Dict{{"role", j::Value(role)}, {"content", j::Value(content)}});
    };
    const j::List messages{message("system", "Be brief."),
                           message("user", "Hi \xE4\xBD\xA0\xE5\xA5\xBD"),
                           message("assistant", "<think>x</think>\n\nHello")};
    for (bool generation : {false, true}) {
      (void)t.render({{"messages", j::Value(messages)},
                      {"add_generation_prompt", j::Value(generation)},
                      {"bos_token", j::Value("<s>")},
                      {"eos_token", j::Value("</s>")},
                      {"tools", j::Value::none()}});
    }
  } catch (const zt::Error&) {
  }
  return 0;
}
