/* Every function of the C API, and every error path the contract names, from plain C99.
 * One process (world size 1); the multi-rank behaviour of the same calls is covered by the C++
 * trainer tests and by examples/c (run at 2 ranks by ctest). */
#define _XOPEN_SOURCE 700
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "zerotrain/zerotrain.h"

static int failures = 0;

#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                        \
    }                                                                    \
  } while (0)

/* A call that must fail with `code` and a message containing `needle`. */
#define CHECK_FAILS(call, code, needle)                                                  \
  do {                                                                                   \
    zt_status s_ = (call);                                                               \
    if (s_ != (code) || strstr(zt_last_error(), (needle)) == NULL) {                     \
      fprintf(stderr, "%s:%d: %s gave %s \"%s\", expected %s mentioning \"%s\"\n", __FILE__, \
              __LINE__, #call, zt_status_name(s_), zt_last_error(), zt_status_name(code), (needle)); \
      ++failures;                                                                        \
    }                                                                                    \
  } while (0)

#define CHECK_OK(call)                                                                   \
  do {                                                                                   \
    zt_status s_ = (call);                                                               \
    if (s_ != ZT_OK || zt_last_error()[0] != '\0') {                                     \
      fprintf(stderr, "%s:%d: %s gave %s \"%s\"\n", __FILE__, __LINE__, #call, zt_status_name(s_), \
              zt_last_error());                                                          \
      ++failures;                                                                        \
    }                                                                                    \
  } while (0)

static int log_calls = 0;
static void on_log(int level, const char *message, void *user_data) {
  (void)level;
  (void)message;
  ++*(int *)user_data;
}

static void count_past_max(int level, const char *message, void *user_data) {
  (void)level;
  if (strstr(message, "past max_steps") != NULL) ++*(int *)user_data;
}

static int stop_after = 0;
static int progress_calls = 0;
static int on_progress(const zt_step_stats *stats, void *user_data) {
  (void)user_data;
  ++progress_calls;
  CHECK(stats->stepped == 1);
  CHECK(isfinite(stats->loss) && stats->loss > 0.0);
  return stats->global_step >= stop_after;
}

/* A GRPO reward: the share of a completion's bytes that are 'a'; checks what it is given. */
static int reward_calls = 0;
static int64_t reward_completions = 0;
static int reward_stop_at = 0;    /* the call that returns nonzero (0: none) */
static int reward_infinite = 0;   /* gives an infinite reward */
static int reward_saw_answer = 1; /* every input had the row's answer column */
static int share_of_a(const zt_reward_input *in, int64_t n, double *rewards, void *user_data) {
  CHECK(user_data == &reward_calls);
  ++reward_calls;
  reward_completions += n;
  CHECK(n > 0 && n % 4 == 0); /* whole groups of num_generations */
  for (int64_t i = 0; i < n; ++i) {
    CHECK(in[i].prompt_len == (int64_t)strlen(in[i].prompt) && strstr(in[i].prompt, "Say a") != NULL);
    CHECK(in[i].completion_len >= (int64_t)strlen(in[i].completion)); /* NUL bytes may be in it */
    CHECK(in[i].n_completion_ids >= 1 && in[i].n_completion_ids <= 6);
    if (strstr(in[i].columns_json, "\"answer\": \"aaa\"") == NULL &&
        strstr(in[i].columns_json, "\"answer\":\"aaa\"") == NULL)
      reward_saw_answer = 0;
    int64_t a = 0;
    for (int64_t c = 0; c < in[i].completion_len; ++c) a += in[i].completion[c] == 'a';
    rewards[i] = in[i].completion_len > 0 ? (double)a / (double)in[i].completion_len : NAN;
  }
  if (reward_infinite) rewards[n - 1] = INFINITY;
  return reward_calls == reward_stop_at;
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static int exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

#define MODEL                                                                                \
  "\"model_config\": {\"model_type\": \"llama\", \"vocab_size\": 259, \"hidden_size\": 32,"  \
  " \"intermediate_size\": 64, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"         \
  " \"max_position_embeddings\": 64}"

int main(void) {
  char dir[] = "/tmp/zt-capi-XXXXXX";
  if (mkdtemp(dir) == NULL) return 2;
  char path[512], options[2048];

  /* Version, names, the error state. */
  CHECK(zt_api_version() == ZT_API_VERSION);
  CHECK(strlen(zt_version()) > 0);
  CHECK(strcmp(zt_last_error(), "") == 0);
  CHECK(strcmp(zt_status_name(ZT_OK), "ZT_OK") == 0);
  CHECK(strcmp(zt_status_name(ZT_ERR_INVALID_ARGUMENT), "ZT_ERR_INVALID_ARGUMENT") == 0);
  CHECK(strcmp(zt_status_name(ZT_ERR_CONFIG), "ZT_ERR_CONFIG") == 0);
  CHECK(strcmp(zt_status_name(ZT_ERR_IO), "ZT_ERR_IO") == 0);
  CHECK(strcmp(zt_status_name(ZT_ERR_DISTRIBUTED), "ZT_ERR_DISTRIBUTED") == 0);
  CHECK(strcmp(zt_status_name(ZT_ERR_OUT_OF_MEMORY), "ZT_ERR_OUT_OF_MEMORY") == 0);
  CHECK(strcmp(zt_status_name(ZT_ERR_NUMERIC), "ZT_ERR_NUMERIC") == 0);
  CHECK(strcmp(zt_status_name(ZT_ERR_CANCELLED), "ZT_ERR_CANCELLED") == 0);
  CHECK(strcmp(zt_status_name(ZT_ERR_INTERNAL), "ZT_ERR_INTERNAL") == 0);
  CHECK(strcmp(zt_status_name((zt_status)99), "ZT_UNKNOWN_STATUS") == 0);
  zt_set_log_callback(on_log, &log_calls);

  /* Creation errors. */
  zt_trainer *t = (zt_trainer *)&failures; /* must be reset to NULL on failure */
  CHECK_FAILS(zt_trainer_create(NULL, &t), ZT_ERR_INVALID_ARGUMENT, "options_json");
  CHECK(t == NULL);
  CHECK(zt_status_name(ZT_OK) && strstr(zt_last_error(), "options_json") != NULL); /* untouched */
  CHECK_FAILS(zt_trainer_create("{}", NULL), ZT_ERR_INVALID_ARGUMENT, "out");
  CHECK_FAILS(zt_trainer_create("{\"learning_rate\": ", &t), ZT_ERR_CONFIG, "options");
  CHECK_FAILS(zt_trainer_create("[1, 2]", &t), ZT_ERR_CONFIG, "JSON object");
  CHECK_FAILS(zt_trainer_create("{\"lerning_rate\": 1}", &t), ZT_ERR_CONFIG, "lerning_rate");
  CHECK_FAILS(zt_trainer_create("{\"max_steps\": \"many\"}", &t), ZT_ERR_CONFIG, "max_steps");
  CHECK_FAILS(zt_trainer_create("{\"device\": \"cpu\"}", &t), ZT_ERR_CONFIG, "model_name_or_path");
  snprintf(options, sizeof options, "{\"model_name_or_path\": \"%s/nowhere\", \"device\": \"cpu\"}", dir);
  CHECK_FAILS(zt_trainer_create(options, &t), ZT_ERR_IO, "nowhere");
  CHECK(t == NULL);

  /* A trainer for the host's own batches: 2 micro-batches per step. */
  snprintf(options, sizeof options,
           "{" MODEL ", \"device\": \"cpu\", \"output_dir\": \"%s/run\", \"max_steps\": 10,"
           " \"per_device_train_batch_size\": 2, \"gradient_accumulation_steps\": 2,"
           " \"learning_rate\": 0.01, \"deepspeed\": {\"zero_optimization\": {\"stage\": 2}},"
           " \"distributed\": {\"rank\": 0, \"world_size\": 1}}",
           dir);
  log_calls = 0;
  CHECK_OK(zt_trainer_create(options, &t));
  CHECK(t != NULL);
  CHECK(log_calls > 0);
  CHECK(zt_trainer_rank(t) == 0);
  CHECK(zt_trainer_world_size(t) == 1);
  CHECK(zt_trainer_rank(NULL) == -1);
  CHECK(strstr(zt_last_error(), "NULL") != NULL);
  CHECK(zt_trainer_world_size(NULL) == -1);

  int64_t ids[2 * 8], labels[2 * 8];
  for (int i = 0; i < 16; ++i) {
    ids[i] = (i * 37) % 250 + 3;
    labels[i] = i % 8 < 3 ? -100 : ids[i];
  }
  zt_step_stats st;
  CHECK_FAILS(zt_trainer_train_step(NULL, ids, NULL, 2, 8, &st), ZT_ERR_INVALID_ARGUMENT, "trainer");
  CHECK_FAILS(zt_trainer_train_step(t, NULL, NULL, 2, 8, &st), ZT_ERR_INVALID_ARGUMENT, "input_ids");
  CHECK_FAILS(zt_trainer_train_step(t, ids, NULL, 0, 8, &st), ZT_ERR_INVALID_ARGUMENT, "batch_size");
  CHECK_FAILS(zt_trainer_train_step(t, ids, NULL, 2, -1, &st), ZT_ERR_INVALID_ARGUMENT, "seq_len");
  ids[5] = 259;
  CHECK_FAILS(zt_trainer_train_step(t, ids, NULL, 2, 8, &st), ZT_ERR_INVALID_ARGUMENT, "259");
  ids[5] = 7;
  labels[9] = 1000;
  CHECK_FAILS(zt_trainer_train_step(t, ids, labels, 2, 8, &st), ZT_ERR_INVALID_ARGUMENT, "1000");
  labels[9] = ids[9];

  double first = 0.0, last = 0.0;
  for (int call = 0; call < 8; ++call) {
    CHECK_OK(zt_trainer_train_step(t, ids, call % 2 ? labels : NULL, 2, 8, &st));
    CHECK(st.stepped == (call % 2 == 1)); /* every second call ends the window */
    CHECK(st.global_step == (call + 1) / 2);
    CHECK(st.skipped == 0);
    CHECK(st.loss_scale == 1.0);
    CHECK(isfinite(st.loss));
    if (st.stepped) CHECK(st.grad_norm > 0.0 && st.learning_rate > 0.0);
    if (call == 1) first = st.loss;
    last = st.loss;
  }
  CHECK(last < first); /* the same batch, eight times: it is learned */
  CHECK_OK(zt_trainer_train_step(t, ids, NULL, 2, 8, NULL)); /* stats may be NULL */
  CHECK_OK(zt_trainer_train_step(t, ids, NULL, 2, 8, NULL));
  double loss0 = 0.0;
  /* Sizes whose product overflows, or exceeds any array a host holds: an argument error naming
   * them, before anything is allocated. */
  CHECK_FAILS(zt_trainer_train_step(t, ids, NULL, INT64_C(1) << 62, 8, &st),
              ZT_ERR_INVALID_ARGUMENT, "batch_size 4611686018427387904 × seq_len 8");
  CHECK_FAILS(zt_trainer_evaluate(t, ids, NULL, INT64_C(1) << 30, INT64_C(1) << 30, 8, &loss0),
              ZT_ERR_INVALID_ARGUMENT, "num_batches");
  /* int32 ids, as zt_tokenizer_encode writes them: the same window as the int64 call. */
  {
    int32_t ids32[2 * 8], labels32[2 * 8];
    for (int i = 0; i < 16; ++i) {
      ids32[i] = (int32_t)ids[i];
      labels32[i] = (int32_t)labels[i];
    }
    double l64 = 0.0, l32 = 0.0;
    CHECK_OK(zt_trainer_evaluate(t, ids, labels, 1, 2, 8, &l64));
    CHECK_OK(zt_trainer_train_step_i32(t, ids32, labels32, 2, 8, &st));
    CHECK(st.stepped == 0 && isfinite(st.loss) && fabs(st.loss - l64) < 1e-5);
    CHECK_OK(zt_trainer_train_step_i32(t, ids32, NULL, 2, 8, &st));
    CHECK(st.stepped == 1);
    CHECK_FAILS(zt_trainer_train_step_i32(t, NULL, NULL, 2, 8, &st), ZT_ERR_INVALID_ARGUMENT,
                "zt_trainer_train_step_i32: input_ids");
    (void)l32;
  }
  /* Preference pairs: refused by a next-token run, trained by a stage dpo one. */
  CHECK_FAILS(zt_trainer_train_pairs_step(t, ids, labels, ids, labels, 2, 8, &st),
              ZT_ERR_INVALID_ARGUMENT, "stage dpo");
  {
    zt_trainer *dpo = NULL;
    char dpo_options[1024];
    snprintf(dpo_options, sizeof dpo_options,
             "{" MODEL ", \"device\": \"cpu\", \"output_dir\": \"%s/run-dpo\", \"max_steps\": 4,"
             " \"stage\": \"dpo\", \"finetuning_type\": \"lora\", \"beta\": 0.5,"
             " \"per_device_train_batch_size\": 2, \"gradient_accumulation_steps\": 2,"
             " \"learning_rate\": 0.01, \"distributed\": {\"rank\": 0, \"world_size\": 1}}",
             dir);
    CHECK_OK(zt_trainer_create(dpo_options, &dpo));
    int64_t rejected[2 * 8], rejected_labels[2 * 8];
    for (int i = 0; i < 16; ++i) {
      rejected[i] = i % 8 < 3 ? ids[i] : (ids[i] + 11) % 250 + 3; /* the same prompt */
      rejected_labels[i] = i % 8 < 3 ? -100 : rejected[i];
    }
    CHECK_FAILS(zt_trainer_train_pairs_step(dpo, ids, NULL, rejected, rejected_labels, 2, 8, &st),
                ZT_ERR_INVALID_ARGUMENT, "chosen_labels");
    CHECK_FAILS(zt_trainer_train_step(dpo, ids, labels, 2, 8, &st), ZT_ERR_INVALID_ARGUMENT,
                "train_preference_step");
    /* The first window: the policy is the reference (LoRA's B starts at zero), so each pair's
     * DPO loss is log 2 exactly. */
    CHECK_OK(zt_trainer_train_pairs_step(dpo, ids, labels, rejected, rejected_labels, 2, 8, &st));
    CHECK(st.stepped == 0 && fabs(st.loss - log(2.0)) < 1e-6);
    CHECK_OK(zt_trainer_train_pairs_step(dpo, ids, labels, rejected, rejected_labels, 2, 8, &st));
    CHECK(st.stepped == 1 && st.global_step == 1 && st.grad_norm > 0.0);
    for (int call = 0; call < 6; ++call) {
      CHECK_OK(zt_trainer_train_pairs_step(dpo, ids, labels, rejected, rejected_labels, 2, 8, &st));
    }
    CHECK(st.loss < log(2.0)); /* the chosen answers are preferred now */
    zt_trainer_free(dpo);
  }

  double loss = 0.0, again = 0.0;
  CHECK_FAILS(zt_trainer_evaluate(t, ids, NULL, 0, 2, 8, &loss), ZT_ERR_INVALID_ARGUMENT, "num_batches");
  CHECK_FAILS(zt_trainer_evaluate(t, ids, NULL, 1, 2, 8, NULL), ZT_ERR_INVALID_ARGUMENT, "mean_loss");
  CHECK_OK(zt_trainer_evaluate(t, ids, labels, 1, 2, 8, &loss));
  CHECK_OK(zt_trainer_evaluate(t, ids, labels, 1, 2, 8, &again));
  CHECK(isfinite(loss) && loss == again); /* evaluation leaves the model alone */
  CHECK_OK(zt_trainer_evaluate(t, ids, NULL, 2, 1, 8, &again)); /* two batches of one row */

  /* Checkpoints: save, refuse to overwrite, load back to the same evaluation. */
  snprintf(path, sizeof path, "%s/ckpt", dir);
  CHECK_FAILS(zt_trainer_save_checkpoint(t, NULL), ZT_ERR_INVALID_ARGUMENT, "dir");
  CHECK_OK(zt_trainer_save_checkpoint(t, path));
  CHECK_FAILS(zt_trainer_save_checkpoint(t, path), ZT_ERR_IO, "ckpt");
  CHECK_OK(zt_trainer_train_step(t, ids, NULL, 2, 8, &st));
  CHECK_OK(zt_trainer_train_step(t, ids, NULL, 2, 8, &st));
  CHECK_OK(zt_trainer_evaluate(t, ids, labels, 1, 2, 8, &again));
  CHECK(again != loss);
  snprintf(options, sizeof options, "%s/not_a_checkpoint", dir);
  CHECK_FAILS(zt_trainer_load_checkpoint(t, options), ZT_ERR_IO, "not_a_checkpoint");
  CHECK_OK(zt_trainer_load_checkpoint(t, path));
  CHECK_OK(zt_trainer_evaluate(t, ids, labels, 1, 2, 8, &again));
  CHECK(fabs(again - loss) < 1e-6);
  /* Past max_steps (10): training goes on at the schedule's end, and says so once. */
  {
    int past = 0;
    zt_set_log_callback(count_past_max, &past);
    for (int call = 0; call < 12; ++call) CHECK_OK(zt_trainer_train_step(t, ids, NULL, 2, 8, &st));
    CHECK(st.global_step > 10);
    CHECK(past == 1);
    zt_set_log_callback(on_log, &log_calls);
  }

  /* Export: an HF folder for full fine-tuning. */
  snprintf(path, sizeof path, "%s/exported", dir);
  CHECK_FAILS(zt_trainer_export(NULL, path), ZT_ERR_INVALID_ARGUMENT, "trainer");
  CHECK_OK(zt_trainer_export(t, path));
  snprintf(path, sizeof path, "%s/exported/config.json", dir);
  CHECK(exists(path));
  snprintf(path, sizeof path, "%s/exported/model.safetensors", dir);
  CHECK(exists(path));
  CHECK_FAILS(zt_trainer_train(t, NULL, NULL), ZT_ERR_CONFIG, "train_file");
  zt_trainer_free(t);

  /* The configured job with a progress callback that stops it; a LoRA adapter export. */
  snprintf(path, sizeof path, "%s/train.jsonl", dir);
  FILE *f = fopen(path, "w");
  if (f == NULL) return 2;
  for (int i = 0; i < 32; ++i) fprintf(f, "{\"instruction\": \"Is %d odd?\", \"output\": \"%s\"}\n", i, i % 2 ? "yes" : "no");
  fclose(f);
  snprintf(options, sizeof options,
           "{" MODEL ", \"device\": \"cpu\", \"output_dir\": \"%s/job\", \"train_file\": \"%s\","
           " \"max_steps\": 6, \"save_steps\": 100, \"per_device_train_batch_size\": 4,"
           " \"finetuning_type\": \"lora\", \"template\": \"alpaca\"}",
           dir, path);
  CHECK_OK(zt_trainer_create(options, &t));
  stop_after = 2;
  CHECK_FAILS(zt_trainer_train(t, on_progress, NULL), ZT_ERR_CANCELLED, "cancelled");
  CHECK(progress_calls == 2);
  snprintf(path, sizeof path, "%s/adapter", dir);
  CHECK_OK(zt_trainer_export(t, path));
  snprintf(path, sizeof path, "%s/adapter/adapter_config.json", dir);
  CHECK(exists(path));
  zt_trainer_free(t);
  zt_trainer_free(NULL);

  /* GRPO with the host's reward: 2 prompts × 4 completions a step, scored by share_of_a. */
  char prompts[512], grpo[2048];
  snprintf(prompts, sizeof prompts, "%s/prompts.jsonl", dir);
  f = fopen(prompts, "w");
  if (f == NULL) return 2;
  for (int i = 0; i < 8; ++i) fprintf(f, "{\"prompt\": \"Say a %d:\", \"answer\": \"aaa\"}\n", i);
  fclose(f);
#define GRPO_OPTIONS(extra)                                                                        \
  snprintf(grpo, sizeof grpo,                                                                      \
           "{" MODEL ", \"device\": \"cpu\", \"output_dir\": \"%s/grpo\", \"train_file\": \"%s\","   \
           " \"stage\": \"grpo\", \"num_generations\": 4, \"max_completion_length\": 6,"           \
           " \"per_device_train_batch_size\": 4, \"gradient_accumulation_steps\": 2,"              \
           " \"max_steps\": 3, \"save_steps\": 100, \"finetuning_type\": \"lora\"," extra           \
           " \"distributed\": {\"rank\": 0, \"world_size\": 1}}",                                 \
           dir, prompts);                                                                          \
  snprintf(path, sizeof path, "%s/grpo", dir);                                                     \
  nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS)
  GRPO_OPTIONS(" \"reward_funcs\": \"accuracy\", \"reward_weights\": \"0.5,1\",");
  CHECK_OK(zt_trainer_create(grpo, &t));
  CHECK_FAILS(zt_trainer_add_reward(NULL, "a", share_of_a, NULL), ZT_ERR_INVALID_ARGUMENT, "NULL");
  CHECK_FAILS(zt_trainer_add_reward(t, NULL, share_of_a, NULL), ZT_ERR_INVALID_ARGUMENT, "name");
  CHECK_FAILS(zt_trainer_add_reward(t, "a", NULL, NULL), ZT_ERR_INVALID_ARGUMENT, "'a'");
  CHECK_FAILS(zt_trainer_add_reward(t, "", share_of_a, NULL), ZT_ERR_INVALID_ARGUMENT, "name");
  CHECK_FAILS(zt_trainer_add_reward(t, "a/b", share_of_a, NULL), ZT_ERR_INVALID_ARGUMENT,
              "name 'a/b' is not 1 to 64 letters");
  CHECK_FAILS(zt_trainer_add_reward(t, "\x01\xff", share_of_a, NULL), ZT_ERR_INVALID_ARGUMENT,
              "name of 2 bytes");
  CHECK_FAILS(zt_trainer_add_reward(t, "accuracy", share_of_a, NULL), ZT_ERR_INVALID_ARGUMENT,
              "'accuracy' is already there");
  CHECK_OK(zt_trainer_add_reward(t, "share_of_a", share_of_a, &reward_calls));
  CHECK_OK(zt_trainer_train(t, NULL, NULL));
  CHECK(reward_calls == 3 && reward_completions == 3 * 8);
  CHECK(reward_saw_answer);
  snprintf(path, sizeof path, "%s/grpo/trainer_state.json", dir);
  CHECK(exists(path));
  zt_trainer_free(t);
  /* A callback that asks to stop, at its second call: the run stops there, naming it. */
  reward_calls = 0;
  reward_stop_at = 2;
  GRPO_OPTIONS("");
  CHECK_OK(zt_trainer_create(grpo, &t));
  CHECK_OK(zt_trainer_add_reward(t, "share_of_a", share_of_a, &reward_calls));
  CHECK_FAILS(zt_trainer_train(t, NULL, NULL), ZT_ERR_CANCELLED, "reward function 'share_of_a'");
  CHECK(reward_calls == 2);
  zt_trainer_free(t);
  /* An infinite reward: an argument error naming the function, the completion and its prompt. */
  reward_calls = 0;
  reward_stop_at = 0;
  reward_infinite = 1;
  GRPO_OPTIONS("");
  CHECK_OK(zt_trainer_create(grpo, &t));
  CHECK_OK(zt_trainer_add_reward(t, "share_of_a", share_of_a, &reward_calls));
  CHECK_FAILS(zt_trainer_train(t, NULL, NULL), ZT_ERR_INVALID_ARGUMENT,
              "reward function 'share_of_a' returned inf for completion 7 (prompt 1");
  zt_trainer_free(t);
  reward_infinite = 0;
  /* No reward function at all, or weights that do not fit the functions: refused at the start. */
  GRPO_OPTIONS("");
  CHECK_OK(zt_trainer_create(grpo, &t));
  CHECK_FAILS(zt_trainer_train(t, NULL, NULL), ZT_ERR_CONFIG, "zt_trainer_add_reward");
  zt_trainer_free(t);
  reward_calls = 0;
  GRPO_OPTIONS(" \"reward_weights\": \"1,2\",");
  CHECK_OK(zt_trainer_create(grpo, &t));
  CHECK_OK(zt_trainer_add_reward(t, "share_of_a", share_of_a, &reward_calls));
  CHECK_FAILS(zt_trainer_train(t, NULL, NULL), ZT_ERR_CONFIG, "2 weights for 1 reward functions");
  zt_trainer_free(t);
  CHECK(reward_calls == 0);
#undef GRPO_OPTIONS
  /* Rewards score a grpo run only. */
  snprintf(options, sizeof options, "{" MODEL ", \"device\": \"cpu\", \"max_steps\": 2}");
  CHECK_OK(zt_trainer_create(options, &t));
  CHECK_FAILS(zt_trainer_add_reward(t, "share_of_a", share_of_a, NULL), ZT_ERR_INVALID_ARGUMENT,
              "stage grpo");
  zt_trainer_free(t);

  /* A stop asked from outside (what a signal handler calls) before the first step: the job ends
   * saying that nothing was saved, never naming a checkpoint-0. */
  snprintf(options, sizeof options,
           "{" MODEL ", \"device\": \"cpu\", \"output_dir\": \"%s/stopped\", \"train_file\":"
           " \"%s/train.jsonl\", \"max_steps\": 2, \"template\": \"alpaca\"}",
           dir, dir);
  CHECK_OK(zt_trainer_create(options, &t));
  zt_trainer_request_stop(NULL, 15); /* ignored */
  zt_trainer_request_stop(t, 15);
  CHECK_FAILS(zt_trainer_train(t, NULL, NULL), ZT_ERR_CANCELLED,
              "stopped by signal 15 before the first step: no checkpoint was saved");
  zt_trainer_free(t);

  /* A host that feeds token ids needs no tokenizer: a model with 64 ids (fewer than the
   * byte-level tokenizer's 259) trains through train_step. */
  snprintf(options, sizeof options,
           "{\"model_config\": {\"model_type\": \"llama\", \"vocab_size\": 64, \"hidden_size\": 32,"
           " \"intermediate_size\": 64, \"num_hidden_layers\": 1, \"num_attention_heads\": 4},"
           " \"device\": \"cpu\", \"output_dir\": \"%s/small\", \"max_steps\": 4, \"learning_rate\": 0.01,"
           " \"distributed\": {\"rank\": 0, \"world_size\": 1}}",
           dir);
  CHECK_OK(zt_trainer_create(options, &t));
  for (int i = 0; i < 16; ++i) ids[i] = (i * 5) % 64;
  CHECK_OK(zt_trainer_train_step(t, ids, NULL, 2, 8, &st));
  CHECK(st.stepped == 1 && st.global_step == 1 && isfinite(st.loss));
  ids[3] = 64;
  CHECK_FAILS(zt_trainer_train_step(t, ids, NULL, 2, 8, &st), ZT_ERR_INVALID_ARGUMENT, "64");
  zt_trainer_free(t);
  /* A schedule that needs the run length names the option, not a C++ type. */
  snprintf(options, sizeof options, "{" MODEL ", \"device\": \"cpu\", \"output_dir\": \"%s/nolen\"}", dir);
  CHECK_FAILS(zt_trainer_create(options, &t), ZT_ERR_CONFIG, "max_steps");
  CHECK(strstr(zt_last_error(), "EngineOptions") == NULL);
  /* Ranks are C ints: a larger one is refused, not truncated. */
  snprintf(options, sizeof options,
           "{" MODEL ", \"device\": \"cpu\", \"distributed\": {\"rank\": 4294967296, \"world_size\": 4294967297}}");
  CHECK_FAILS(zt_trainer_create(options, &t), ZT_ERR_CONFIG, "rank");

  /* Tokenizers: the byte-level one (no folder), the sizing rules, errors. */
  zt_tokenizer *tok = (zt_tokenizer *)&failures;
  snprintf(path, sizeof path, "%s/no_such_model", dir);
  CHECK_FAILS(zt_tokenizer_load(path, &tok), ZT_ERR_IO, "no_such_model");
  CHECK(tok == NULL);
  CHECK_FAILS(zt_tokenizer_load(NULL, NULL), ZT_ERR_INVALID_ARGUMENT, "out");
  CHECK_OK(zt_tokenizer_load(NULL, &tok));
  CHECK(zt_tokenizer_vocab_size(tok) == 259);
  CHECK(zt_tokenizer_bos_id(tok) == 256 && zt_tokenizer_eos_id(tok) == 257 && zt_tokenizer_pad_id(tok) == 258);
  CHECK(zt_tokenizer_vocab_size(NULL) == -1);
  int64_t n = 0;
  CHECK_OK(zt_tokenizer_encode(tok, "Hi!", 3, 1, NULL, 0, &n));
  CHECK(n == 4);
  int32_t small[2], toks[8];
  CHECK_FAILS(zt_tokenizer_encode(tok, "Hi!", 3, 1, small, 2, &n), ZT_ERR_INVALID_ARGUMENT, "capacity");
  CHECK(n == 4);
  CHECK_OK(zt_tokenizer_encode(tok, "Hi!", 3, 1, toks, 8, &n));
  CHECK(n == 4 && toks[0] == 256 && toks[1] == 'H' && toks[2] == 'i' && toks[3] == '!');
  CHECK_OK(zt_tokenizer_encode(tok, "Hi!", 3, 0, toks, 8, &n));
  CHECK(n == 3 && toks[0] == 'H');
  char text[8];
  int64_t bytes = 0;
  const int32_t with_specials[] = {256, 'o', 'k', 257};
  CHECK_OK(zt_tokenizer_decode(tok, with_specials, 4, NULL, 0, &bytes));
  CHECK(bytes == 2);
  CHECK_FAILS(zt_tokenizer_decode(tok, with_specials, 4, text, 2, &bytes), ZT_ERR_INVALID_ARGUMENT, "capacity");
  CHECK_OK(zt_tokenizer_decode(tok, with_specials, 4, text, sizeof text, &bytes));
  CHECK(bytes == 2 && strcmp(text, "ok") == 0);
  CHECK_FAILS(zt_tokenizer_encode(NULL, "x", 1, 0, toks, 8, &n), ZT_ERR_INVALID_ARGUMENT, "tokenizer");
  zt_tokenizer_free(tok);
  zt_tokenizer_free(NULL);
  zt_set_log_callback(NULL, NULL);

  if (failures == 0) {
    nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS); /* kept after a failure, to look at */
    printf("C API: all checks passed\n");
  }
  return failures == 0 ? 0 : 1;
}
