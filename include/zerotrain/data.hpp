// Training data: JSONL files tokenized through prompt templates with label masking, a token
// cache, collation into padded or packed batches, and a sampler whose order does not depend on
// the number of ranks. docs/data.md describes the formats, templates and orders exactly.
//
// Thread-safety: a Dataset is a value; its const methods may be called from several threads at
// once. The free functions are pure apart from the files they name and the log sink. Nothing
// here is collective: in a multi-rank job the caller lets one rank build the cache
// (load_or_tokenize) and the others read it after a barrier.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "zerotrain/config.hpp"
#include "zerotrain/tokenizer.hpp"

namespace zt {

/// The label of a token that does not count in the loss (PyTorch's cross-entropy ignore_index).
constexpr int32_t kIgnoreLabel = -100;

/// Where a tokenization stands (DataOptions::on_progress): records taken so far and the bytes
/// of the data file read for them, of `total_bytes`.
struct TokenizeProgress {
  int64_t records = 0;
  int64_t bytes = 0, total_bytes = 0;
};

struct DataOptions {
  std::string template_name = "alpaca_zh";  ///< a template name (resolve_template resolves "auto")
  int64_t max_length = 1024;                ///< tokens per example; longer ones lose their end
  bool train_on_prompt = false;             ///< prompt tokens are trained too
  bool skip_bad_lines = false;              ///< skip (and count) malformed lines, do not fail
  /// TRL's SFT options (docs/data.md). `completion_only_loss`: prompt-completion records train
  /// the completion only (false: every token). `assistant_only_loss`: messages and
  /// conversations records train the assistant replies only (false: every token). With
  /// `train_on_prompt` every token trains whatever these say.
  bool completion_only_loss = true;
  bool assistant_only_loss = true;
  /// TRL's dataset_text_field: the key of plain-text records (trained on every token).
  std::string text_field = "text";
  /// Pre-tokenized lines' ids must be below this: the model's vocab_size (its embedding rows,
  /// often more than the tokenizer's tokens). 0: the tokenizer's vocab_size.
  int64_t token_id_limit = 0;
  /// ChatGLM-Finetuning's data_set.py layout for instruction records (its --mode): "" (off),
  /// "glm2" (GLM2PromptDataSet) or "glm3" (GLM3PromptDataSet) — its prompt, its token-level
  /// truncation to max_source_length and max_length, [gMASK] sop first and eos last, labels
  /// -100 on the source. Needs ChatGLM's tokenizer; docs/data.md gives the layouts.
  std::string glm_prompt_layout;
  int64_t max_source_length = 256;  ///< data_set.py's max_src_len
  bool skip_truncated = false;      ///< data_set.py's is_skip: drop examples truncation cut
  /// Preference pairs (tokenize_preference_jsonl) instead of examples; with TRL's truncation of
  /// each sequence (`truncation_mode` keep_start | keep_end) and of prompts to their last
  /// `max_prompt_length` tokens (0: no limit).
  bool preference = false;
  /// With `preference`: KTO's unpaired examples (a prompt, one completion, desirable or not)
  /// instead of pairs; each example is stored with its KL sequence (docs/preference.md).
  bool kto = false;
  std::string truncation_mode = "keep_start";
  int64_t max_prompt_length = 0;
  /// Called by tokenize_jsonl / tokenize_preference_jsonl (and load_or_tokenize when it
  /// tokenizes) on the calling thread after each batch of records — a few thousand, or a few
  /// MiB of text, whichever comes first — with where the file stands. It may throw (the
  /// Trainer throws CancelledError when a stop is asked): tokenizing stops there, that error
  /// propagates and nothing is cached. May be empty. Not part of the cache key (it does not
  /// change the tokens).
  std::function<void(const TokenizeProgress&)> on_progress;
};

/// The data options among the training arguments (template, max_length, train_on_prompt,
/// skip_bad_lines, TRL's completion_only_loss, assistant_only_loss and dataset_text_field,
/// glm_prompt_layout, max_source_length, skip_truncated).
DataOptions data_options_for(const TrainingArguments& args);

/// What tokenization saw. Kept in the cache, so a dataset read back reports the same numbers.
/// What tokenizing a file kept and dropped. `examples` and `dropped_examples` count Dataset
/// rows: examples, or with preference data sequences (a pair's two; a KTO example's own and its
/// KL sequence), so pairs and KTO examples are half of them. The causes count records (lines),
/// each dropped record under the first cause found (docs/data.md, docs/preference.md).
struct DatasetStats {
  int64_t lines = 0;             ///< non-blank lines
  int64_t examples = 0;          ///< rows kept
  int64_t skipped_lines = 0;     ///< malformed lines skipped (skip_bad_lines)
  int64_t dropped_examples = 0;  ///< rows the dropped records would have made
  int64_t tokens = 0;            ///< tokens of the kept rows
  /// Kept rows whose records the chat template formatted (messages, conversations, instructions,
  /// conversational prompts, ChatGLM-Finetuning's layout); the others are plain text or ids.
  int64_t templated_examples = 0;
  // Examples dropped, by cause.
  int64_t untrained_examples = 0;  ///< no trained label at all (e.g. pre-tokenized labels all -100)
  int64_t truncated_examples = 0;  ///< cut to max_length, no trained label left (prompt fills it)
  int64_t skipped_truncated = 0;   ///< cut by ChatGLM-Finetuning's layout, with skip_truncated
  // Preference records dropped, by cause (each warned about, never trained on).
  int64_t identical_pairs = 0;      ///< chosen and rejected the same, as text or as tokens
  int64_t empty_answers = 0;        ///< an answer (a completion) empty, or encoded to no token
  int64_t long_prompts = 0;         ///< the prompt alone fills max_length (keep_start)
  int64_t cut_answers = 0;          ///< keep_end: no answer token in the last max_length
  int64_t cut_identical_pairs = 0;  ///< answers that differ, the same once cut to max_length
};

/// A read-only view of contiguous tokens (C++17 has no std::span). Valid while the Dataset it
/// came from is alive and not modified.
struct TokenView {
  const int32_t* data = nullptr;
  int64_t size = 0;

  const int32_t* begin() const { return data; }
  const int32_t* end() const { return data + size; }
  int32_t operator[](int64_t i) const { return data[i]; }
  std::vector<int32_t> to_vector() const { return {begin(), end()}; }
};

/// Tokenized examples stored flat: all ids, all labels, and where each example starts. A packed
/// dataset (made by `pack`) also records where each of its documents starts.
/// Example indices outside [0, size()) are an InvalidArgument.
class Dataset {
 public:
  Dataset() = default;

  /// Rebuilds a dataset from its flat storage (the accessors below), checking it: `offsets`
  /// starts at 0, increases strictly and ends at ids.size(); labels has ids' size; ids are >= 0,
  /// labels >= 0 or kIgnoreLabel; `document_offsets`, when not empty (a packed dataset), increases
  /// strictly, holds every entry of `offsets` and ends with it. InvalidArgument otherwise.
  static Dataset from_flat(std::vector<int32_t> ids, std::vector<int32_t> labels,
                           std::vector<int64_t> offsets,
                           std::vector<int64_t> document_offsets = {});

  /// Appends one example: `ids` and `labels` of the same nonzero length (InvalidArgument
  /// otherwise); labels are token ids or kIgnoreLabel. Not allowed on a packed dataset.
  void add(const std::vector<int32_t>& ids, const std::vector<int32_t>& labels);

  int64_t size() const { return static_cast<int64_t>(offsets_.size()) - 1; }
  bool empty() const { return size() == 0; }
  int64_t length(int64_t i) const;
  TokenView ids(int64_t i) const;
  TokenView labels(int64_t i) const;
  int64_t total_tokens() const { return static_cast<int64_t>(ids_.size()); }
  /// length(i) for every example, for length grouping.
  std::vector<int64_t> lengths() const;

  /// KTO's labels (tokenize_preference_jsonl with DataOptions::kto): per example, 1 where its
  /// completion is desirable, 0 where it is not; empty for other data.
  const std::vector<uint8_t>& desirable() const { return desirable_; }
  /// Sets them: one 0 or 1 per example, or none (InvalidArgument otherwise). Examples are not
  /// added after.
  void set_desirable(std::vector<uint8_t> flags);

  /// True when made by `pack`: each example is a sequence of whole documents.
  bool packed() const { return !doc_offsets_.empty(); }
  /// The lengths of the documents in example i, in order (one document when not packed).
  std::vector<int64_t> document_lengths(int64_t i) const;

  /// Flat storage: every example's ids and labels back to back; example i is
  /// [offsets()[i], offsets()[i + 1]); a packed dataset's document starts, then the end (empty
  /// when not packed).
  const std::vector<int32_t>& flat_ids() const { return ids_; }
  const std::vector<int32_t>& flat_labels() const { return labels_; }
  const std::vector<int64_t>& offsets() const { return offsets_; }
  const std::vector<int64_t>& document_offsets() const { return doc_offsets_; }

 private:
  void check_index(int64_t i) const;

  std::vector<int32_t> ids_;
  std::vector<int32_t> labels_;
  std::vector<int64_t> offsets_{0};
  std::vector<int64_t> doc_offsets_;
  std::vector<uint8_t> desirable_;
};

// ---- JSONL ---------------------------------------------------------------------------------

/// Tokenizes a JSONL file: one JSON object per line, blank lines ignored, the format detected
/// per line (text, instruction/input/output, messages, TRL's prompt/completion, pre-tokenized
/// input_ids/labels; see docs/data.md). Instruction and chat data go through the template
/// `o.template_name`; prompt labels are kIgnoreLabel unless `o.train_on_prompt` (or TRL's
/// completion_only_loss / assistant_only_loss false). Examples are cut to `o.max_length`
/// tokens (the end is lost); one left without a trained label is dropped, counted and warned
/// about.
/// Errors: a missing or unreadable file is an IoError naming it. A malformed line is a
/// ConfigError "<file>:<line>: <key>: <what is wrong>" — or, with `o.skip_bad_lines`, skipped
/// and counted with a warning. A file with no usable example and an unknown template are
/// ConfigErrors. `stats`, when given, receives the counts.
Dataset tokenize_jsonl(const std::string& path, const Tokenizer& tok, const DataOptions& o,
                       DatasetStats* stats = nullptr);

/// Tokenizes a file of preference pairs (docs/preference.md): TRL's {"prompt", "chosen",
/// "rejected"} (text, or lists of messages through the template), its implicit-prompt form (only
/// "chosen" and "rejected", the prompt their common start), LLaMA-Factory's alpaca
/// (instruction / input / chosen / rejected) and sharegpt (conversations + chosen / rejected
/// messages) layouts. Pair i is examples 2i (prompt + chosen) and 2i + 1 (prompt + rejected),
/// labels kIgnoreLabel on the prompt (and on earlier turns). Each sequence is cut to
/// `o.max_length` as `o.truncation_mode` says; a pair whose answers are identical, one of whose
/// answers is empty, whose prompt alone fills max_length, or that the cut leaves without an
/// answer token or with identical answers is dropped, counted under that cause in `stats` and
/// warned about. With `o.kto`, KTO's unpaired examples instead: TRL's {"prompt", "completion",
/// "label"}, LLaMA-Factory's messages / conversations (the last reply the completion) and alpaca
/// (its output) records with a boolean "label" or "kto_tag", and pair records as two examples
/// (chosen desirable); example i is rows 2i (prompt + completion) and 2i + 1 (its KL sequence:
/// the prompt with the completion of the example before it, the first taking the last's), both
/// with its label in Dataset::desirable(). Errors as tokenize_jsonl.
Dataset tokenize_preference_jsonl(const std::string& path, const Tokenizer& tok,
                                  const DataOptions& o, DatasetStats* stats = nullptr);

/// The prompt `template_name` makes of an instruction (and optional input), exactly as
/// training renders it, up to where the model's answer begins — for asking a trained model.
/// An unknown template is a ConfigError.
std::string render_prompt(const std::string& template_name, const std::string& instruction,
                          const std::string& input = "");

/// The ids of that prompt as training encodes them: bos first where the tokenizer adds one to
/// an instruction template's text (a model's chat format writes its own).
std::vector<int32_t> encode_prompt(const std::string& template_name, const Tokenizer& tok,
                                   const std::string& instruction, const std::string& input = "");

/// Every template name: the instruction templates (alpaca_zh, alpaca, chatml, plain, chatglm2),
/// then the models' chat formats (docs/data.md).
std::vector<std::string> template_names();

/// The template a run uses for `name`: "auto" is the model folder's own chat format
/// (recognized from its chat template), else alpaca_zh when it has none. LLaMA-Factory's names
/// of formats that are the model's own (gemma, gemma2, gemma3, mistral_small, phi4, phi4_mini,
/// gpt_oss, glm4_moe, deepseek3) read the folder's chat template as auto does, a ConfigError
/// when it has none. Any other name must be a template. The chosen format's special tokens must
/// each be one token of `tok` (ConfigError naming the token otherwise). `source`, when given,
/// receives why it was chosen. `template_kwargs` (a JSON object, as apply_chat_template's **kwargs:
/// enable_thinking, ...) render the folder's template as written with them, recorded in the
/// returned name; a built-in or instruction format takes none (ConfigError naming `kwargs_option`).
std::string resolve_template(const std::string& name, const std::string& model_dir,
                             const Tokenizer& tok, std::string* source = nullptr,
                             const std::string& template_kwargs = "",
                             const std::string& kwargs_option = "chat_template_kwargs");

/// What a run records as its template when the template formatted none of its training records
/// (plain text, TRL's text prompt + completion, token ids): prompts are then sent as they are.
inline constexpr const char* kRawTemplate = "raw";

/// The template recorded in `dir`/zerotrain_template.json (written with every checkpoint and
/// exported model by the trainer), if there is one: a template's name, or kRawTemplate. A
/// record naming neither is a ConfigError.
std::optional<std::string> recorded_template(const std::string& dir);
/// Writes `dir`/zerotrain_template.json naming `name` (atomically).
void record_template(const std::string& dir, const std::string& name);

// ---- LLaMA-Factory's datasets --------------------------------------------------------------

/// LLaMA-Factory's data options (docs/data.md, "LLaMA-Factory's datasets"): `dataset` and
/// `eval_dataset` (comma lists of `dataset_dir`/dataset_info.json entries, or of data files),
/// `max_samples` (the first N records of each) and `val_size` (training records held out for
/// evaluation, chosen with `seed`; also over a train_file). The records are read through each
/// entry's formatting (alpaca, sharegpt, openai), columns and tags into zerotrain's layouts,
/// concatenated in order, written — when `write` — as JSONL files named by their content under
/// the cache folder (cache_dir, else output_dir/.cache), and train_file / eval_file point at
/// them. Does nothing when none of those options is given; returns a line per step for the log.
/// Errors: ConfigError for a dataset on a hub (saying how to download it), an entry or record
/// that does not fit the run's stage or its columns (naming the file and record; skipped and
/// counted with skip_bad_lines), conflicting options; IoError for a missing file.
std::vector<std::string> prepare_datasets(TrainingArguments& args, bool write = true);

// ---- cache ---------------------------------------------------------------------------------

/// `<cache_dir>/<file stem>-<16 hex digits>.safetensors`, the digits a hash of everything the
/// tokenized result depends on: the data file's content (hashed in full, with its size), the
/// tokenizer's fingerprint, every DataOptions field but on_progress and the cache format
/// version. A missing or
/// special (FIFO, device) data file is an IoError.
std::string dataset_cache_path(const std::string& cache_dir, const std::string& jsonl_path,
                               const Tokenizer& tok, const DataOptions& o);

/// Writes a dataset (and the stats of its tokenization) as safetensors, atomically.
void save_dataset(const Dataset& dataset, const std::string& path, const DatasetStats& stats = {});

/// Reads a dataset save_dataset wrote, checking it completely (tensors, dtypes, offsets, label
/// values; with `id_limit` > 0 every input id and label in [0, id_limit), labels also -100):
/// a missing, truncated or inconsistent file is an IoError naming it. `stats`, when given,
/// receives the stats saved with it.
Dataset load_dataset(const std::string& path, DatasetStats* stats = nullptr, int64_t id_limit = 0);

/// tokenize_jsonl (tokenize_preference_jsonl with `o.preference`) through the cache: reuses
/// `dataset_cache_path(...)` when it holds a valid dataset for the same key, otherwise tokenizes
/// and writes it (creating `cache_dir`). A cache file that fails to load is replaced, with a
/// warning. An empty `cache_dir` means no cache.
Dataset load_or_tokenize(const std::string& jsonl_path, const Tokenizer& tok, const DataOptions& o,
                         const std::string& cache_dir, DatasetStats* stats = nullptr);

// ---- batches -------------------------------------------------------------------------------

/// One micro-batch, on the CPU. All tensors are [B, T] int64 with T the longest example of the
/// batch; rows are right-padded.
struct Batch {
  at::Tensor input_ids;       ///< pad_id on padding
  at::Tensor labels;          ///< kIgnoreLabel on padding
  at::Tensor attention_mask;  ///< 1 on real tokens, 0 on padding
  /// Packed batches only (undefined otherwise): the position of each token in its document
  /// (restarting at 0 per document; 0 on padding).
  at::Tensor position_ids;
  /// Packed batches only: the document each token belongs to, numbered 0, 1, ... within its row
  /// (-1 on padding). Attention must not cross documents.
  at::Tensor document_ids;
  /// labels != kIgnoreLabel, unshifted: a causal-LM loss never uses a row's first label, so for
  /// rows whose first label is trained (text examples: bos) it counts one token more than the
  /// loss does. Packed rows start every document with kIgnoreLabel, so there the counts agree.
  int64_t target_tokens = 0;
};

/// The examples `indices` of `dataset` as a batch padded with `pad_id` (which must be >= 0: pass
/// the tokenizer's pad_id, or its eos_id when it has none). An empty `indices` gives an empty
/// batch: every tensor [0, 0], target_tokens 0 (a rank with nothing left in the last eval batch
/// still takes part in collective forwards).
Batch collate(const Dataset& dataset, const std::vector<int64_t>& indices, int32_t pad_id);

/// Packs whole examples of `examples`, taken in `order`, into sequences of at most `max_length`
/// tokens: each example joins the current sequence if it fits, else starts a new one (examples
/// are never split or reordered). The first label of every document becomes kIgnoreLabel, so no
/// token is trained on a prediction made from another document. An example longer than
/// `max_length`, an index out of range or a packed input is an InvalidArgument.
Dataset pack(const Dataset& examples, int64_t max_length, const std::vector<int64_t>& order);

// ---- sampling ------------------------------------------------------------------------------

/// The order in which epoch `epoch` visits examples [0, n): [0, n) itself, or with `shuffle` a
/// Fisher–Yates permutation driven by splitmix64 seeded with `seed + epoch` (the same on every
/// platform and LibTorch version). With `lengths` (group_by_length), the order is then cut into
/// consecutive megabatches of `megabatch` indices, each sorted by length, longest first (stable),
/// and the first element of the first megabatch swapped with the first of the megabatch holding
/// the longest example — HF's LengthGroupedSampler rule, so the first batch is the longest.
std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch, bool shuffle,
                                 const std::vector<int64_t>* lengths = nullptr,
                                 int64_t megabatch = 0);

/// HF's megabatch size for length grouping with global batch size `global_batch`:
/// min(n / (4 · global_batch), 50) · global_batch, at least global_batch.
int64_t length_megabatch(int64_t n, int64_t global_batch);

/// The samples of one optimizer step: micro_batch × accumulation × world.
struct GlobalBatch {
  int64_t micro_batch = 1;   ///< per rank and micro-step
  int64_t accumulation = 1;  ///< micro-steps per optimizer step
  int64_t world = 1;         ///< ranks
  int64_t size() const { return micro_batch * accumulation * world; }
};

/// Optimizer steps in an epoch of n examples: n / global_batch with `drop_last` (the last,
/// incomplete global batch dropped), else rounded up (it is completed from the start of the
/// epoch order).
int64_t steps_per_epoch(int64_t n, int64_t global_batch, bool drop_last);

/// The examples rank `rank` uses in micro-step `micro_step` of optimizer step `step`: positions
/// step·G + (micro_step·world + rank)·micro_batch + [0, micro_batch) of `order` (G = g.size()),
/// wrapping around to the start of `order` past its end. The union over ranks and micro-steps is
/// order positions [step·G, (step + 1)·G) whatever the world size. Steps run from 0 to
/// steps_per_epoch(n, G, drop_last) - 1 (the caller stops there: with drop_last the incomplete
/// last step is never asked for). A step with step·G >= order.size(), or a micro-step / rank out
/// of range, is an InvalidArgument.
std::vector<int64_t> micro_batch_indices(const std::vector<int64_t>& order, const GlobalBatch& g,
                                         int64_t step, int64_t micro_step, int64_t rank);

/// Evaluation batches of rank `rank` over examples [0, n): global batch j holds examples
/// [j·world·batch_size, (j + 1)·world·batch_size), rank r its slice r. Every rank gets the same
/// number of batches, ceil(n / (world·batch_size)) (forwards may be collective), some of them
/// short or empty at the end; every example is evaluated exactly once across ranks.
std::vector<std::vector<int64_t>> eval_batches(int64_t n, int64_t world, int64_t rank,
                                               int64_t batch_size);

}  // namespace zt
