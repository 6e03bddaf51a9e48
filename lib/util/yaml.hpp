// YAML documents read as JSON values (yaml-cpp, Debian's libyaml-cpp-dev), so that a YAML
// options file goes through the same option table as a JSON one (docs/config.md).
#pragma once

#include <string>
#include <string_view>

#include <rapidjson/document.h>

namespace zt::yaml {

/// Values one document may expand to, aliases counted each time they are used: far beyond any
/// options file, and a stop for alias bombs (a few lines that expand to billions of values).
constexpr int kMaxValues = 1 << 16;

/// Parses `text`, one YAML document, into a JSON value. Mappings become objects (a key twice
/// is an error; `<<` merge keys are merged as PyYAML does), sequences arrays. Plain scalars are
/// resolved as LLaMA-Factory reads them (PyYAML's safe loader with OmegaConf's float rule):
/// `~`, `null`, `Null`, `NULL` and nothing are null; true / false / yes / no / on / off (each
/// lower case, capitalized or upper case) booleans; decimal integers without leading zeros
/// integers; decimals with a point or an exponent (`1e-4`, `1.0e-4`, `.5`) numbers; anything
/// else, and every quoted scalar, text. An empty document is an empty object.
/// Errors are ConfigError "<source>:<line>:<column>: ...": malformed YAML, more than one
/// document, nesting deeper than json::kMaxDepth, more than kMaxValues values, a tag other than
/// the core schema's (!!str, !!int, !!float, !!bool, !!null, !!map, !!seq), a key that is not a
/// scalar.
rapidjson::Document parse(std::string_view text, const std::string& source);

}  // namespace zt::yaml
