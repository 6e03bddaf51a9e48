/* zerotrain.h — the stable C API of libzerotrain.
 *
 * Fine-tune decoder LLMs with DeepSpeed's ZeRO from any language with a C FFI: create a trainer
 * from the same JSON options `zerotrain train` takes, then either run the configured job
 * (zt_trainer_train) or feed it your own batches (zt_trainer_train_step), save and load
 * checkpoints, and export the model as an HF folder or a PEFT adapter.
 *
 * Conventions
 * - Every fallible call returns a zt_status; nothing else escapes (no exception, abort or exit).
 *   On failure, zt_last_error() describes the cause on the calling thread.
 * - Collective calls (create, train_step, train, evaluate, save_checkpoint, load_checkpoint,
 *   export) must be made by every rank of the job in the same order; a rank that fails inside
 *   one returns an error, and the others return ZT_ERR_DISTRIBUTED (or the same error) instead
 *   of waiting forever.
 * - A zt_trainer is used by one thread at a time. Different trainers are independent, but one
 *   process normally holds one (one rank of a job).
 * - Ranks come from torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
 *   MASTER_ADDR, MASTER_PORT; also mpirun's and srun's), or from a "distributed" object in the
 *   options.
 *
 * ABI: the library's SONAME carries ZT_API_VERSION (libzerotrain.so.1). Enumerator values never
 * change and new ones are appended; the layout of zt_step_stats is frozen for version 1.
 */
#ifndef ZEROTRAIN_H
#define ZEROTRAIN_H

#include <stdint.h>

#if defined(__GNUC__)
#define ZT_EXPORT __attribute__((visibility("default")))
#else
#define ZT_EXPORT
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define ZT_API_VERSION 1

typedef enum zt_status {
  ZT_OK = 0,
  ZT_ERR_INVALID_ARGUMENT =
      1,             /* a NULL pointer, a non-positive size, an id outside the vocabulary */
  ZT_ERR_CONFIG = 2, /* malformed JSON, an unknown or ill-typed option, inconsistent settings */
  ZT_ERR_IO = 3,     /* a missing, unreadable or corrupt file; a failed write */
  ZT_ERR_DISTRIBUTED = 4, /* rendezvous or a collective failed, timed out, or another rank failed */
  ZT_ERR_OUT_OF_MEMORY = 5,
  ZT_ERR_NUMERIC = 6,   /* non-finite loss or gradients; fp16 loss scale at its minimum */
  ZT_ERR_CANCELLED = 7, /* a progress callback asked to stop */
  ZT_ERR_INTERNAL = 8
} zt_status; /* values never change; new ones are appended */

typedef struct zt_trainer zt_trainer; /* opaque */

typedef struct zt_step_stats { /* layout frozen for ZT_API_VERSION 1 */
  int64_t global_step;         /* optimizer steps completed so far */
  int32_t stepped;             /* 1 if this call ended an accumulation window and stepped */
  int32_t skipped;             /* 1 if that step was skipped (fp16 overflow) */
  double loss;                 /* this micro-batch's loss, averaged over all ranks */
  double grad_norm;            /* global norm before clipping; valid when stepped */
  double learning_rate;        /* learning rate of the last step */
  double loss_scale;           /* 1.0 unless fp16 */
} zt_step_stats;

/* Called after each optimizer step of zt_trainer_train, on every rank, with the same stats.
 * Return nonzero to stop: every rank then stops at the next step boundary with ZT_ERR_CANCELLED.
 * `stats` is valid only during the call. */
typedef int (*zt_progress_fn)(const zt_step_stats* stats, void* user_data);

/* Receives each log message (level: 0 debug, 1 info, 2 warning, 3 error), without a trailing
 * newline. May be called from any thread that runs zerotrain code; calls are serialized.
 * `message` is valid only during the call. */
typedef void (*zt_log_fn)(int level, const char* message, void* user_data);

/* ZT_API_VERSION of the library loaded at run time. Never fails; does not touch the error state. */
ZT_EXPORT int zt_api_version(void);
/* The library version, e.g. "0.1.0". Static storage. Does not touch the error state. */
ZT_EXPORT const char* zt_version(void);
/* The enumerator's name ("ZT_ERR_CONFIG"), or "ZT_UNKNOWN_STATUS". Static storage. Does not
 * touch the error state. */
ZT_EXPORT const char* zt_status_name(zt_status status);
/* This thread's last error message: "" (never NULL) after a success. Valid until the next
 * fallible call on this thread. Does not touch the error state. */
ZT_EXPORT const char* zt_last_error(void);
/* Routes every log message to `fn` (NULL restores the default: lines on stderr). Process-wide;
 * thread-safe. `user_data` is passed back untouched and must outlive the registration. */
ZT_EXPORT void zt_set_log_callback(zt_log_fn fn, void* user_data);

/* Creates a trainer — joins the job (rendezvous), loads the model, tokenizer and data, applies
 * the fine-tuning method and builds the ZeRO engine. `options_json` is one JSON object with the
 * options of `zerotrain train` (`zerotrain train --help`): training-argument names, "deepspeed"
 * (an object or a file path), "model_name_or_path" or an inline "model_config" (HF config.json
 * keys with "model_type") for a seeded random model, "finetuning_type" and the adapter options,
 * "device" ("cpu" / "cuda"; default: cuda when available), and optionally "distributed":
 * {"rank", "world_size", "local_rank", "master_addr", "master_port", "rendezvous_timeout",
 * "ddp_timeout"} instead of the launcher's environment variables. A host that feeds its own
 * batches needs no "train_file"; schedules that decay need "max_steps" then.
 * On success *out owns the trainer (free it with zt_trainer_free); on failure *out is NULL.
 * Errors: NULL arguments → ZT_ERR_INVALID_ARGUMENT; text that is not a JSON object, an unknown
 * or ill-typed option → ZT_ERR_CONFIG; missing files → ZT_ERR_IO. Collective. */
ZT_EXPORT zt_status zt_trainer_create(const char* options_json, zt_trainer** out);

/* This process's rank and the job's world size. Never fail for a valid trainer (a NULL trainer
 * gives -1 and sets ZT_ERR_INVALID_ARGUMENT). */
ZT_EXPORT int32_t zt_trainer_rank(const zt_trainer* t);
ZT_EXPORT int32_t zt_trainer_world_size(const zt_trainer* t);

/* Runs one micro-batch on this rank: `input_ids` and `labels` are row-major
 * [batch_size, seq_len]; `labels` may be NULL (a copy of input_ids); -100 labels are ignored;
 * the loss predicts token t+1 from position t (HF's shift). Steps the optimizer at the
 * accumulation boundary (gradient_accumulation_steps calls per step). Gradients are normalized
 * by the whole window's counted tokens over all ranks, so the same seed and the same global
 * batches give the same losses and gradient norms whatever the ZeRO stage or world size.
 * The arrays are only read during the call. `stats` may be NULL. Collective. */
ZT_EXPORT zt_status zt_trainer_train_step(zt_trainer* t, const int64_t* input_ids,
                                          const int64_t* labels, int64_t batch_size,
                                          int64_t seq_len, zt_step_stats* stats);

/* zt_trainer_train_step with int32 token ids — what zt_tokenizer_encode writes — so a host
 * passes the encoder's output as it is. Sizes whose product overflows (or exceeds what the
 * arrays can hold: 2^40 tokens) are ZT_ERR_INVALID_ARGUMENT naming them. Collective. */
ZT_EXPORT zt_status zt_trainer_train_step_i32(zt_trainer* t, const int32_t* input_ids,
                                              const int32_t* labels, int64_t batch_size,
                                              int64_t seq_len, zt_step_stats* stats);

/* One micro-batch of preference pairs on this rank, for a run with "stage": "dpo" (see
 * docs/preference.md): `chosen_ids` / `rejected_ids` are row-major [pairs, seq_len], each row a
 * prompt and an answer, right-padded; `chosen_labels` / `rejected_labels` the same with -100 on
 * the prompt and the padding. The loss is the run's pref_loss against the model with its adapters
 * off (a run with a precomputed reference, rpo_alpha or "stage": "kto", whose examples come from
 * train_file: ZT_ERR_INVALID_ARGUMENT). Steps at the
 * accumulation boundary; normalized by the window's pairs over all ranks. `stats->loss` is the
 * micro-batch's mean pair loss over all ranks. The arrays are only read during the call;
 * `stats` may be NULL. Collective. */
ZT_EXPORT zt_status zt_trainer_train_pairs_step(zt_trainer* t, const int64_t* chosen_ids,
                                                const int64_t* chosen_labels,
                                                const int64_t* rejected_ids,
                                                const int64_t* rejected_labels, int64_t pairs,
                                                int64_t seq_len, zt_step_stats* stats);

/* The token-weighted mean loss over `num_batches` batches of [batch_size, seq_len] laid out back
 * to back in `input_ids` (and `labels`, which may be NULL), without changing the model. Every
 * rank passes its own batches, the same number of them. Collective. */
ZT_EXPORT zt_status zt_trainer_evaluate(zt_trainer* t, const int64_t* input_ids,
                                        const int64_t* labels, int64_t num_batches,
                                        int64_t batch_size, int64_t seq_len, double* mean_loss);

/* Runs the configured job — train_file, epochs or max_steps, evaluation, checkpoints in
 * output_dir, the final model — as `zerotrain train` does. `progress` may be NULL. Collective. */
ZT_EXPORT zt_status zt_trainer_train(zt_trainer* t, zt_progress_fn progress, void* user_data);

/* Asks this rank's zt_trainer_train to stop (appended in 0.2: the ABI of version 1 is kept).
 * `signal` 0 stops at the next optimizer step boundary without saving, as a nonzero return of
 * the progress callback does; a signal number (SIGTERM, SIGUSR1: a scheduler's warning before
 * preemption) saves a checkpoint there first. Before the first step — while the reference
 * log-probs are precomputed — either stops within one batch. zt_trainer_train then returns
 * ZT_ERR_CANCELLED on every rank (the ranks agree on a stop asked on any of them), its message
 * naming the checkpoint, or saying that none was saved. The request stays: a later
 * zt_trainer_train stops at once. Async-signal-safe, and callable from any thread while another
 * is inside zt_trainer_train (the one exception to "one thread at a time"). NULL is ignored.
 * Not collective; does not touch the error state. */
ZT_EXPORT void zt_trainer_request_stop(zt_trainer* t, int32_t signal);

/* Writes one complete checkpoint folder at `dir` (atomically: a failure leaves nothing there;
 * an existing `dir` is ZT_ERR_IO). Collective. */
ZT_EXPORT zt_status zt_trainer_save_checkpoint(zt_trainer* t, const char* dir);
/* Restores a checkpoint folder (optimizer state, counters, random state), also one saved with
 * another world size or ZeRO stage. Collective. */
ZT_EXPORT zt_status zt_trainer_load_checkpoint(zt_trainer* t, const char* dir);
/* Writes the model at `dir`: an HF folder (config.json + safetensors) for full and Freeze
 * fine-tuning, PEFT adapter files for LoRA / P-Tuning / prefix tuning. Collective. */
ZT_EXPORT zt_status zt_trainer_export(zt_trainer* t,
                                      const char* dir); /* HF folder, or PEFT adapter */

/* ---- GRPO rewards from the host (appended in 0.2) ------------------------------------------
 * A run with "stage": "grpo" samples num_generations completions of each prompt of its
 * train_file and scores them with reward functions: the built-ins of "reward_funcs", a
 * "reward_command" program, and the host's own callbacks (docs/grpo.md). */
typedef struct zt_reward_input {
  const char* prompt;     /* the prompt's tokens as text (special tokens such as a template's
                             markers dropped, as zt_tokenizer_decode gives it) */
  int64_t prompt_len;     /* bytes, without the NUL that follows them (the text may hold NULs) */
  const char* completion; /* the completion's text, special tokens dropped; NUL-terminated */
  int64_t completion_len;
  const int32_t* completion_ids; /* its tokens, with the stop token where it stopped */
  int64_t n_completion_ids;
  /* The prompt row's other columns ("answer", "solution", ...) as one JSON object of strings
   * (a column that is not a string in train_file is its JSON text), NUL-terminated. */
  const char* columns_json;
} zt_reward_input;

/* Scores `n` completions: writes rewards[i] for inputs[i], a finite number, or NaN where this
 * function does not score that completion (TRL's None: it counts in no mean). Completions come
 * in groups of num_generations, each group one prompt's. Called on the thread inside
 * zt_trainer_train, once per step with this rank's completions; `inputs` and `rewards` are valid
 * only during the call. Return 0, or nonzero to stop: zt_trainer_train then returns
 * ZT_ERR_CANCELLED on this rank, the message naming the function, and ZT_ERR_DISTRIBUTED naming
 * this rank on the others, at once (the ranks agree after scoring). An infinite reward is
 * ZT_ERR_INVALID_ARGUMENT naming the function, the completion and its prompt. */
typedef int (*zt_reward_fn)(const zt_reward_input* inputs, int64_t n, double* rewards,
                            void* user_data);

/* Adds a reward function `name` (metrics: rewards/<name>/mean and /std) to a grpo run, after
 * "reward_funcs" and "reward_command", in the order added; "reward_weights", when given, has
 * one weight per function in that order. Every rank adds the same functions in the same order
 * before zt_trainer_train (which checks the count). `name` is copied; `user_data` is passed
 * back untouched and must outlive the trainer's training calls. Errors: NULL arguments, a name
 * already taken or not 1 to 64 letters, digits, '_', '-', '.' or ':', a run of another stage →
 * ZT_ERR_INVALID_ARGUMENT. Not collective. */
ZT_EXPORT zt_status zt_trainer_add_reward(zt_trainer* t, const char* name, zt_reward_fn fn,
                                          void* user_data);

/* Frees the trainer and leaves the job. NULL is fine. Not collective, but every rank should
 * free its trainer; using `t` afterwards is undefined. */
ZT_EXPORT void zt_trainer_free(zt_trainer* t);

/* ---- Tokenizers (appended in 0.2) ----------------------------------------------------------
 * A host that tokenizes its own data gets the ids the trainer's data pipeline makes. A
 * zt_tokenizer is immutable: its functions may be called from several threads at once. */
typedef struct zt_tokenizer zt_tokenizer; /* opaque */

/* Loads the tokenizer of an HF model folder (tokenizer.json + tokenizer_config.json), as
 * zt_trainer_create does for "model_name_or_path"; NULL or "" gives the built-in byte-level
 * tokenizer (ids 0-255 bytes, 256 bos, 257 eos, 258 pad), as does a folder without tokenizer
 * files. On success *out owns the tokenizer (free it with zt_tokenizer_free); on failure *out
 * is NULL. Errors: a folder that does not exist → ZT_ERR_IO; an unsupported tokenizer.json →
 * ZT_ERR_CONFIG. Not collective. */
ZT_EXPORT zt_status zt_tokenizer_load(const char* model_dir, zt_tokenizer** out);

/* The ids of `text_len` bytes of UTF-8 `text` (special-token strings such as "<|im_end|>" become
 * their ids, as HF tokenizers do). With `add_bos` nonzero, the ids HF's tokenizer(text) puts in
 * front come first: bos where the tokenizer adds one (LLaMA: yes, Qwen: no), ChatGLM's
 * [gMASK] sop. *n_ids receives the number of ids; they are written to `ids`
 * when `capacity` holds them all. `ids` may be NULL with `capacity` 0 to ask for the count;
 * a smaller nonzero capacity is ZT_ERR_INVALID_ARGUMENT (with *n_ids set: call again). */
ZT_EXPORT zt_status zt_tokenizer_encode(const zt_tokenizer* tok, const char* text, int64_t text_len,
                                        int32_t add_bos, int32_t* ids, int64_t capacity,
                                        int64_t* n_ids);

/* The text of `n_ids` ids (special ids and -100 skipped), NUL-terminated into `text` of
 * `capacity` bytes; *n_bytes receives its length without the NUL. The same sizing rule as
 * zt_tokenizer_encode (capacity 0 asks; the text needs *n_bytes + 1 bytes). */
ZT_EXPORT zt_status zt_tokenizer_decode(const zt_tokenizer* tok, const int32_t* ids, int64_t n_ids,
                                        char* text, int64_t capacity, int64_t* n_bytes);

/* Ids are in [0, vocab size). bos / eos / pad are -1 where the tokenizer has none (pad: batches
 * are padded with eos then, as HF does). A NULL tokenizer gives -1 and sets
 * ZT_ERR_INVALID_ARGUMENT. */
ZT_EXPORT int64_t zt_tokenizer_vocab_size(const zt_tokenizer* tok);
ZT_EXPORT int32_t zt_tokenizer_bos_id(const zt_tokenizer* tok);
ZT_EXPORT int32_t zt_tokenizer_eos_id(const zt_tokenizer* tok);
ZT_EXPORT int32_t zt_tokenizer_pad_id(const zt_tokenizer* tok);

/* Frees the tokenizer. NULL is fine. */
ZT_EXPORT void zt_tokenizer_free(zt_tokenizer* tok);

#ifdef __cplusplus
}
#endif

#endif /* ZEROTRAIN_H */
