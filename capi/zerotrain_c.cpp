// The C API (include/zerotrain/zerotrain.h) over zt::Trainer. One boundary, `guarded`, maps the
// library's exceptions to status codes and keeps the message for zt_last_error(); nothing
// escapes into the host.
#include "zerotrain/zerotrain.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include "status.hpp"
#include "util/json.hpp"
#include "zerotrain/build_config.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/grpo.hpp"
#include "zerotrain/log.hpp"
#include "zerotrain/tokenizer.hpp"
#include "zerotrain/trainer.hpp"

struct zt_trainer {
  std::shared_ptr<zt::Communicator> comm;
  std::unique_ptr<zt::Trainer> trainer;
};

struct zt_tokenizer {
  std::shared_ptr<zt::Tokenizer> tok;
};

namespace {

thread_local std::string t_last_error;

zt_status fail(zt_status status, const std::string& message) {
  t_last_error = message;
  return status;
}

// Runs `fn`, mapping what it throws to a status (capi/status.hpp); "" in zt_last_error() after
// a success.
template <typename Fn>
zt_status guarded(Fn&& fn) {
  try {
    fn();
    t_last_error.clear();
    return ZT_OK;
  } catch (...) {
    std::string message;
    const zt_status status = zt::capi::status_of(std::current_exception(), message);
    return fail(status, message);
  }
}

void require(bool ok, const char* message) {
  if (!ok) throw zt::InvalidArgument(message);
}

void require(bool ok, const std::string& message) {
  if (!ok) throw zt::InvalidArgument(message);
}

// `distributed` of the options, in place of the launcher's variables.
zt::LaunchEnv launch_env_of(const rapidjson::Value& value, zt::TrainingArguments& args) {
  zt::json::ObjectReader r(value, "distributed", "options");
  zt::LaunchEnv env;
  env.origin = "options";
  // Ranks are C ints: a larger number is an error here, not a truncation later.
  env.rank = static_cast<int>(r.integer("rank", 0, INT32_MAX).value_or(0));
  env.world_size = static_cast<int>(r.integer("world_size", 1, INT32_MAX).value_or(1));
  env.local_rank = static_cast<int>(r.integer("local_rank", 0, INT32_MAX).value_or(env.rank));
  env.local_world_size = env.world_size;
  env.master_addr = r.string("master_addr").value_or("127.0.0.1");
  env.master_port = static_cast<int>(r.integer("master_port", 1, 65535).value_or(29500));
  if (auto t = r.integer("rendezvous_timeout", 1, INT32_MAX)) args.rendezvous_timeout = *t;
  if (auto t = r.integer("ddp_timeout", 1, INT32_MAX)) args.ddp_timeout = *t;
  if (!r.unknown_paths().empty()) {
    throw zt::ConfigError(
        fmt::format("options: unknown key {} (known: rank, world_size, local_rank, master_addr, "
                    "master_port, rendezvous_timeout, ddp_timeout)",
                    r.unknown_paths().front()));
  }
  if (env.rank >= env.world_size) {
    throw zt::ConfigError(fmt::format("options: distributed.rank {} is not below world_size {}",
                                      env.rank, env.world_size));
  }
  return env;
}

// [n, rows, cols] int64 host arrays as tensors (copied, so the caller's memory is read only now).
// n × rows × cols tokens, checked before anything is allocated: each positive, and the product
// no more than 2^40 (an overflow, or more tokens than any host array holds, is a caller's size
// mistake). `fn` and the names say which argument in the message.
void check_token_count(const char* fn,
                       std::initializer_list<std::pair<const char*, int64_t>> sizes) {
  constexpr int64_t kMaxTokens = int64_t{1} << 40;
  std::string product;
  for (const auto& [name, v] : sizes) {
    product += fmt::format("{}{} {}", product.empty() ? "" : " × ", name, v);
  }
  int64_t total = 1;
  for (const auto& [name, v] : sizes) {
    if (v < 1)
      throw zt::InvalidArgument(fmt::format("{}: {} must be positive ({})", fn, name, product));
    if (total > kMaxTokens / v) {
      throw zt::InvalidArgument(
          fmt::format("{}: {} is more than 2^40 tokens (or overflows); pass the sizes of the "
                      "arrays you hold",
                      fn, product));
    }
    total *= v;
  }
}

template <typename T>
at::Tensor tokens_of(const T* data, int64_t n, int64_t rows, int64_t cols) {
  const at::ScalarType type = std::is_same<T, int32_t>::value ? at::kInt : at::kLong;
  return at::from_blob(const_cast<T*>(data), {n * rows, cols}, type).to(at::kLong);
}

void copy_stats(const zt::StepStats& s, zt_step_stats* stats) {
  if (stats == nullptr) return;
  stats->global_step = s.global_step;
  stats->stepped = s.stepped ? 1 : 0;
  stats->skipped = s.skipped ? 1 : 0;
  stats->loss = s.loss;
  stats->grad_norm = s.grad_norm;
  stats->learning_rate = s.learning_rate;
  stats->loss_scale = s.loss_scale;
}

template <typename T>
zt_status train_step_of(const char* fn, zt_trainer* t, const T* input_ids, const T* labels,
                        int64_t batch_size, int64_t seq_len, zt_step_stats* stats) {
  return guarded([&] {
    require(t != nullptr, fmt::format("{}: trainer is NULL", fn));
    require(input_ids != nullptr, fmt::format("{}: input_ids is NULL", fn));
    check_token_count(fn, {{"batch_size", batch_size}, {"seq_len", seq_len}});
    at::Tensor ids = tokens_of(input_ids, 1, batch_size, seq_len);
    at::Tensor y = labels != nullptr ? tokens_of(labels, 1, batch_size, seq_len) : at::Tensor();
    copy_stats(t->trainer->train_step(ids, y), stats);
  });
}

}  // namespace

extern "C" {

int zt_api_version(void) {
  return ZT_API_VERSION;
}

const char* zt_version(void) {
  return ZT_VERSION_STRING;
}

const char* zt_status_name(zt_status status) {
  // A C caller may pass any int here (a C enum is an int); reading a value outside the
  // enumerators as the C++ enum is undefined, so the switch reads the argument's bytes.
  int code = 0;
  static_assert(sizeof(status) == sizeof(code), "zt_status is an int-sized C enum");
  std::memcpy(&code, &status, sizeof code);
  switch (code) {
    case ZT_OK:
      return "ZT_OK";
    case ZT_ERR_INVALID_ARGUMENT:
      return "ZT_ERR_INVALID_ARGUMENT";
    case ZT_ERR_CONFIG:
      return "ZT_ERR_CONFIG";
    case ZT_ERR_IO:
      return "ZT_ERR_IO";
    case ZT_ERR_DISTRIBUTED:
      return "ZT_ERR_DISTRIBUTED";
    case ZT_ERR_OUT_OF_MEMORY:
      return "ZT_ERR_OUT_OF_MEMORY";
    case ZT_ERR_NUMERIC:
      return "ZT_ERR_NUMERIC";
    case ZT_ERR_CANCELLED:
      return "ZT_ERR_CANCELLED";
    case ZT_ERR_INTERNAL:
      return "ZT_ERR_INTERNAL";
  }
  return "ZT_UNKNOWN_STATUS";
}

const char* zt_last_error(void) {
  return t_last_error.c_str();
}

void zt_set_log_callback(zt_log_fn fn, void* user_data) {
  if (fn == nullptr) {
    zt::set_log_sink(nullptr);
    return;
  }
  zt::set_log_sink([fn, user_data](zt::LogLevel level, const std::string& message) {
    fn(static_cast<int>(level), message.c_str(), user_data);
  });
}

zt_status zt_trainer_create(const char* options_json, zt_trainer** out) {
  if (out != nullptr) *out = nullptr;
  return guarded([&] {
    require(options_json != nullptr, "zt_trainer_create: options_json is NULL");
    require(out != nullptr, "zt_trainer_create: out is NULL");
    rapidjson::Document doc = zt::json::parse(options_json, "options");
    if (!doc.IsObject()) {
      throw zt::ConfigError(
          fmt::format("options: expected a JSON object, found {}", zt::json::type_name(doc)));
    }
    zt::TrainingArguments args;
    std::optional<zt::LaunchEnv> env;
    rapidjson::Value distributed;
    if (doc.HasMember("distributed")) {
      distributed.CopyFrom(doc["distributed"], doc.GetAllocator());
      doc.RemoveMember("distributed");
    }
    zt::apply_training_json(args, zt::json::dump(doc), "options");
    if (!distributed.IsNull()) env = launch_env_of(distributed, args);
    auto handle = std::make_unique<zt_trainer>();
    handle->comm = env ? zt::join_training_job(args, *env) : zt::join_training_job(args);
    handle->trainer = std::make_unique<zt::Trainer>(args, handle->comm);
    *out = handle.release();
  });
}

int32_t zt_trainer_rank(const zt_trainer* t) {
  if (t == nullptr) {
    fail(ZT_ERR_INVALID_ARGUMENT, "zt_trainer_rank: trainer is NULL");
    return -1;
  }
  return t->trainer->rank();
}

int32_t zt_trainer_world_size(const zt_trainer* t) {
  if (t == nullptr) {
    fail(ZT_ERR_INVALID_ARGUMENT, "zt_trainer_world_size: trainer is NULL");
    return -1;
  }
  return t->trainer->world_size();
}

zt_status zt_trainer_train_step(zt_trainer* t, const int64_t* input_ids, const int64_t* labels,
                                int64_t batch_size, int64_t seq_len, zt_step_stats* stats) {
  return train_step_of("zt_trainer_train_step", t, input_ids, labels, batch_size, seq_len, stats);
}

zt_status zt_trainer_train_pairs_step(zt_trainer* t, const int64_t* chosen_ids,
                                      const int64_t* chosen_labels, const int64_t* rejected_ids,
                                      const int64_t* rejected_labels, int64_t pairs,
                                      int64_t seq_len, zt_step_stats* stats) {
  const char* fn = "zt_trainer_train_pairs_step";
  return guarded([&] {
    require(t != nullptr, fmt::format("{}: trainer is NULL", fn));
    require(chosen_ids != nullptr && chosen_labels != nullptr && rejected_ids != nullptr &&
                rejected_labels != nullptr,
            fmt::format("{}: chosen_ids, chosen_labels, rejected_ids and rejected_labels must all "
                        "be given",
                        fn));
    check_token_count(fn, {{"pairs", pairs}, {"seq_len", seq_len}});
    copy_stats(t->trainer->train_preference_step(tokens_of(chosen_ids, 1, pairs, seq_len),
                                                 tokens_of(chosen_labels, 1, pairs, seq_len),
                                                 tokens_of(rejected_ids, 1, pairs, seq_len),
                                                 tokens_of(rejected_labels, 1, pairs, seq_len)),
               stats);
  });
}

zt_status zt_trainer_train_step_i32(zt_trainer* t, const int32_t* input_ids, const int32_t* labels,
                                    int64_t batch_size, int64_t seq_len, zt_step_stats* stats) {
  return train_step_of("zt_trainer_train_step_i32", t, input_ids, labels, batch_size, seq_len,
                       stats);
}

zt_status zt_trainer_evaluate(zt_trainer* t, const int64_t* input_ids, const int64_t* labels,
                              int64_t num_batches, int64_t batch_size, int64_t seq_len,
                              double* mean_loss) {
  return guarded([&] {
    require(t != nullptr, "zt_trainer_evaluate: trainer is NULL");
    require(input_ids != nullptr, "zt_trainer_evaluate: input_ids is NULL");
    require(mean_loss != nullptr, "zt_trainer_evaluate: mean_loss is NULL");
    check_token_count(
        "zt_trainer_evaluate",
        {{"num_batches", num_batches}, {"batch_size", batch_size}, {"seq_len", seq_len}});
    at::Tensor ids = tokens_of(input_ids, num_batches, batch_size, seq_len);
    at::Tensor y =
        labels != nullptr ? tokens_of(labels, num_batches, batch_size, seq_len) : at::Tensor();
    std::vector<std::pair<at::Tensor, at::Tensor>> batches;
    for (int64_t b = 0; b < num_batches; ++b) {
      batches.emplace_back(ids.narrow(0, b * batch_size, batch_size),
                           y.defined() ? y.narrow(0, b * batch_size, batch_size) : at::Tensor());
    }
    *mean_loss = t->trainer->evaluate_batches(batches);
  });
}

zt_status zt_trainer_train(zt_trainer* t, zt_progress_fn progress, void* user_data) {
  return guarded([&] {
    require(t != nullptr, "zt_trainer_train: trainer is NULL");
    zt::Trainer& trainer = *t->trainer;
    zt::TrainerCallbacks callbacks;
    if (progress != nullptr) {
      callbacks.on_step = [&](const zt::StepStats& s) {
        zt_step_stats c{s.global_step, s.stepped ? 1 : 0, s.skipped ? 1 : 0, s.loss,
                        s.grad_norm,   s.learning_rate,   s.loss_scale};
        if (progress(&c, user_data) != 0) trainer.cancel();
      };
    }
    trainer.set_callbacks(std::move(callbacks));
    trainer.train();
  });
}

void zt_trainer_request_stop(zt_trainer* t, int32_t signal) {
  // Lock-free atomics only (StopRequest): safe in a signal handler.
  if (t == nullptr) return;
  if (signal > 0) {
    t->trainer->preempt(signal);
  } else {
    t->trainer->cancel();
  }
}

zt_status zt_trainer_save_checkpoint(zt_trainer* t, const char* dir) {
  return guarded([&] {
    require(t != nullptr, "zt_trainer_save_checkpoint: trainer is NULL");
    require(dir != nullptr && *dir != '\0', "zt_trainer_save_checkpoint: dir is NULL or empty");
    t->trainer->save_checkpoint(dir);
  });
}

zt_status zt_trainer_load_checkpoint(zt_trainer* t, const char* dir) {
  return guarded([&] {
    require(t != nullptr, "zt_trainer_load_checkpoint: trainer is NULL");
    require(dir != nullptr && *dir != '\0', "zt_trainer_load_checkpoint: dir is NULL or empty");
    t->trainer->load_checkpoint(dir);
  });
}

zt_status zt_trainer_export(zt_trainer* t, const char* dir) {
  return guarded([&] {
    require(t != nullptr, "zt_trainer_export: trainer is NULL");
    require(dir != nullptr && *dir != '\0', "zt_trainer_export: dir is NULL or empty");
    t->trainer->export_model(dir);
  });
}

zt_status zt_tokenizer_load(const char* model_dir, zt_tokenizer** out) {
  if (out != nullptr) *out = nullptr;
  return guarded([&] {
    require(out != nullptr, "zt_tokenizer_load: out is NULL");
    auto handle = std::make_unique<zt_tokenizer>();
    // The model's size is not known here: any HF tokenizer (its own check is against a model).
    handle->tok = zt::load_tokenizer(model_dir == nullptr ? "" : model_dir, INT64_MAX);
    *out = handle.release();
  });
}

zt_status zt_tokenizer_encode(const zt_tokenizer* tok, const char* text, int64_t text_len,
                              int32_t add_bos, int32_t* ids, int64_t capacity, int64_t* n_ids) {
  return guarded([&] {
    require(tok != nullptr, "zt_tokenizer_encode: tokenizer is NULL");
    require(n_ids != nullptr, "zt_tokenizer_encode: n_ids is NULL");
    require(text != nullptr || text_len == 0, "zt_tokenizer_encode: text is NULL");
    require(text_len >= 0, "zt_tokenizer_encode: text_len is negative");
    require(capacity >= 0 && (ids != nullptr || capacity == 0),
            "zt_tokenizer_encode: ids is NULL with capacity > 0");
    std::vector<int32_t> out;
    if (add_bos != 0) out = tok->tok->prefix_ids();
    const std::vector<int32_t> body =
        tok->tok->encode(std::string_view(text, static_cast<size_t>(text_len)));
    out.insert(out.end(), body.begin(), body.end());
    *n_ids = static_cast<int64_t>(out.size());
    if (capacity == 0) return;
    if (capacity < *n_ids) {
      throw zt::InvalidArgument(
          fmt::format("zt_tokenizer_encode: capacity {} is below the {} ids; call again with "
                      "room for them",
                      capacity, *n_ids));
    }
    std::copy(out.begin(), out.end(), ids);
  });
}

zt_status zt_tokenizer_decode(const zt_tokenizer* tok, const int32_t* ids, int64_t n_ids,
                              char* text, int64_t capacity, int64_t* n_bytes) {
  return guarded([&] {
    require(tok != nullptr, "zt_tokenizer_decode: tokenizer is NULL");
    require(n_bytes != nullptr, "zt_tokenizer_decode: n_bytes is NULL");
    require(n_ids >= 0 && (ids != nullptr || n_ids == 0),
            "zt_tokenizer_decode: ids is NULL or n_ids negative");
    require(capacity >= 0 && (text != nullptr || capacity == 0),
            "zt_tokenizer_decode: text is NULL with capacity > 0");
    const std::string out = tok->tok->decode(std::vector<int32_t>(ids, ids + n_ids));
    *n_bytes = static_cast<int64_t>(out.size());
    if (capacity == 0) return;
    if (capacity < *n_bytes + 1) {
      throw zt::InvalidArgument(
          fmt::format("zt_tokenizer_decode: capacity {} is below the {} bytes (with the NUL); "
                      "call again with room for them",
                      capacity, *n_bytes + 1));
    }
    std::copy(out.begin(), out.end(), text);
    text[out.size()] = '\0';
  });
}

#define ZT_TOKENIZER_GETTER(type, name, expr)                                     \
  type zt_tokenizer_##name(const zt_tokenizer* tok) {                             \
    if (tok == nullptr) {                                                         \
      fail(ZT_ERR_INVALID_ARGUMENT, "zt_tokenizer_" #name ": tokenizer is NULL"); \
      return -1;                                                                  \
    }                                                                             \
    return tok->tok->expr;                                                        \
  }
ZT_TOKENIZER_GETTER(int64_t, vocab_size, vocab_size())
ZT_TOKENIZER_GETTER(int32_t, bos_id, bos_id())
ZT_TOKENIZER_GETTER(int32_t, eos_id, eos_id())
ZT_TOKENIZER_GETTER(int32_t, pad_id, pad_id())
#undef ZT_TOKENIZER_GETTER

void zt_tokenizer_free(zt_tokenizer* tok) {
  delete tok;
}

zt_status zt_trainer_add_reward(zt_trainer* t, const char* name, zt_reward_fn fn, void* user_data) {
  return guarded([&] {
    require(t != nullptr, "zt_trainer_add_reward: trainer is NULL");
    require(name != nullptr, "zt_trainer_add_reward: name is NULL");
    require(fn != nullptr,
            fmt::format("zt_trainer_add_reward: the function of '{}' is NULL", name));
    zt::RewardFunction reward;
    reward.name = name;
    reward.fn = [fn, user_data](const std::vector<zt::RewardInput>& batch) {
      // The C view of the batch: lengths beside the texts, int32 ids, the columns as JSON.
      const size_t n = batch.size();
      std::vector<std::vector<int32_t>> ids(n);
      std::vector<std::string> columns(n);
      std::vector<zt_reward_input> inputs(n);
      for (size_t i = 0; i < n; ++i) {
        const zt::RewardInput& b = batch[i];
        ids[i].assign(b.completion_ids.begin(), b.completion_ids.end());
        rapidjson::StringBuffer text;
        rapidjson::Writer<rapidjson::StringBuffer> w(text);
        w.StartObject();
        for (const auto& [key, value] : b.columns) {
          w.Key(key.data(), static_cast<rapidjson::SizeType>(key.size()));
          w.String(value.data(), static_cast<rapidjson::SizeType>(value.size()));
        }
        w.EndObject();
        columns[i].assign(text.GetString(), text.GetSize());
        inputs[i] = zt_reward_input{b.prompt.c_str(),     static_cast<int64_t>(b.prompt.size()),
                                    b.completion.c_str(), static_cast<int64_t>(b.completion.size()),
                                    ids[i].data(),        static_cast<int64_t>(ids[i].size()),
                                    columns[i].c_str()};
      }
      std::vector<double> rewards(n, std::nan(""));
      const int rc = fn(inputs.data(), static_cast<int64_t>(n), rewards.data(), user_data);
      if (rc != 0) {
        throw zt::CancelledError(
            fmt::format("the host's callback returned {} (nonzero: stop the run)", rc));
      }
      std::vector<std::optional<double>> out(n);
      for (size_t i = 0; i < n; ++i) {
        if (!std::isnan(rewards[i])) out[i] = rewards[i];
      }
      return out;
    };
    t->trainer->add_reward(std::move(reward));
  });
}

void zt_trainer_free(zt_trainer* t) {
  try {
    delete t;
  } catch (...) {
    // A destructor that throws has nowhere to report; the handle is gone either way.
  }
}

}  // extern "C"
