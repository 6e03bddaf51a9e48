// Reading DeepSpeed values that may be written as "auto".
#pragma once

#include <fmt/format.h>

#include "util/json.hpp"
#include "zerotrain/config.hpp"

namespace zt::config {

// True (and the key marked as read) when the member is the string "auto".
inline bool take_auto(json::ObjectReader& r, const char* key) {
  if (!r.is_auto(key)) return false;
  r.find(key);
  return true;
}

inline void read_auto_int(json::ObjectReader& r, const char* key, Auto<int64_t>& out, int64_t min) {
  if (take_auto(r, key)) return out.set_auto();
  const rapidjson::Value* v = r.find(key);
  if (v == nullptr) return;
  std::optional<int64_t> i = v->IsNumber() ? json::as_integer(*v) : std::nullopt;
  if (!i || *i < min) r.fail(key, fmt::format("an integer >= {} or \"auto\"", min));
  out.set(*i);
}

inline void read_auto_number(json::ObjectReader& r, const char* key, Auto<double>& out,
                             double min) {
  if (take_auto(r, key)) return out.set_auto();
  const rapidjson::Value* v = r.find(key);
  if (v == nullptr) return;
  if (!v->IsNumber() || !(v->GetDouble() >= min)) {
    r.fail(key, fmt::format("a number >= {} or \"auto\"", min));
  }
  out.set(v->GetDouble());
}

inline void read_auto_bool(json::ObjectReader& r, const char* key, Auto<bool>& out) {
  if (take_auto(r, key)) return out.set_auto();
  const rapidjson::Value* v = r.find(key);
  if (v == nullptr) return;
  if (!v->IsBool()) r.fail(key, "true, false or \"auto\"");
  out.set(v->GetBool());
}

inline void read_auto_betas(json::ObjectReader& r, const char* key,
                            Auto<std::array<double, 2>>& out) {
  if (take_auto(r, key)) return out.set_auto();
  const rapidjson::Value* v = r.find(key);
  if (v == nullptr) return;
  if (!v->IsArray() || v->Size() != 2 || !(*v)[0].IsNumber() || !(*v)[1].IsNumber()) {
    r.fail(key, "[beta1, beta2] or \"auto\"");
  }
  std::array<double, 2> b{(*v)[0].GetDouble(), (*v)[1].GetDouble()};
  for (double x : b) {
    if (!(x >= 0.0 && x < 1.0)) r.fail(key, "two betas in [0, 1)");
  }
  out.set(b);
}

}  // namespace zt::config
