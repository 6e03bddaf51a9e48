# Writes OUT: a C++ source holding every data/chat_templates/<name>.jinja as
# zt::data::kReferenceChatTemplates (name, text), for `--template auto` to compare against.
#   cmake -DDIR=<data/chat_templates> -DOUT=<file.cpp> -P embed_chat_templates.cmake
file(GLOB templates "${DIR}/*.jinja")
list(SORT templates)
set(body "")
foreach(path IN LISTS templates)
  get_filename_component(name "${path}" NAME_WLE)
  file(READ "${path}" text)
  string(FIND "${text}" ")zt_template\"" clash)
  if(NOT clash EQUAL -1)
    message(FATAL_ERROR "${path} contains the raw-string delimiter )zt_template\"")
  endif()
  string(APPEND body "    {\"${name}\", R\"zt_template(${text})zt_template\"},\n")
endforeach()
file(WRITE "${OUT}.tmp" "// Generated from data/chat_templates/ by cmake/embed_chat_templates.cmake; do not edit.
#include <string>
#include <utility>
#include <vector>

namespace zt::data {
extern const std::vector<std::pair<std::string, std::string>> kReferenceChatTemplates;
const std::vector<std::pair<std::string, std::string>> kReferenceChatTemplates = {
${body}};
}  // namespace zt::data
")
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different "${OUT}.tmp" "${OUT}")
file(REMOVE "${OUT}.tmp")
