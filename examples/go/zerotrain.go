// Package zerotrain wraps libzerotrain's C API (include/zerotrain/zerotrain.h): fine-tune
// decoder LLMs with DeepSpeed-style ZeRO sharding from Go.
//
// It finds the library through pkg-config (`#cgo pkg-config: zerotrain`): with zerotrain
// installed under PREFIX,
//
//	PKG_CONFIG_PATH=PREFIX/lib/pkgconfig go build ./...
//
// Collective methods (New, TrainStep, Evaluate, Train, SaveCheckpoint, LoadCheckpoint, Export)
// must be called by every rank of the job in the same order. A Trainer is used by one
// goroutine at a time.
package zerotrain

/*
#cgo pkg-config: zerotrain
#include <stdlib.h>
#include "zerotrain/zerotrain.h"

extern int goProgress(zt_step_stats *stats, void *user_data);
static int zt_go_progress(const zt_step_stats *stats, void *user_data) {
  return goProgress((zt_step_stats *)stats, user_data);
}
static zt_status zt_go_train(zt_trainer *t, uintptr_t handle) {
  return zt_trainer_train(t, zt_go_progress, (void *)handle);
}
extern void goLog(int level, char *message, void *user_data);
static void zt_go_log(int level, const char *message, void *user_data) {
  goLog(level, (char *)message, user_data);
}
static void zt_go_set_log(uintptr_t handle) { zt_set_log_callback(zt_go_log, (void *)handle); }
extern int goReward(zt_reward_input *inputs, int64_t n, double *rewards, void *user_data);
static int zt_go_reward(const zt_reward_input *inputs, int64_t n, double *rewards, void *user_data) {
  return goReward((zt_reward_input *)inputs, n, rewards, user_data);
}
static zt_status zt_go_add_reward(zt_trainer *t, const char *name, uintptr_t handle) {
  return zt_trainer_add_reward(t, name, zt_go_reward, (void *)handle);
}
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"runtime/cgo"
	"sync"
	"unsafe"
)

// Status is a zt_status code.
type Status int

const (
	InvalidArgument Status = 1
	ConfigError     Status = 2
	IOError         Status = 3
	Distributed     Status = 4
	OutOfMemory     Status = 5
	Numeric         Status = 6
	Cancelled       Status = 7
	Internal        Status = 8
)

// String is the enumerator's name, e.g. "ZT_ERR_CONFIG".
func (s Status) String() string { return C.GoString(C.zt_status_name(C.zt_status(s))) }

// Error carries the status of a failed call and the library's message.
type Error struct {
	Status  Status
	Message string
}

func (e *Error) Error() string { return e.Status.String() + ": " + e.Message }

func check(status C.zt_status) error {
	if status == C.ZT_OK {
		return nil
	}
	return &Error{Status: Status(status), Message: C.GoString(C.zt_last_error())}
}

// APIVersion is the loaded library's ZT_API_VERSION.
func APIVersion() int { return int(C.zt_api_version()) }

// Version is the library's version, e.g. "0.1.0".
func Version() string { return C.GoString(C.zt_version()) }

// StepStats is what one step did (the same on every rank).
type StepStats struct {
	GlobalStep   int64
	Stepped      bool
	Skipped      bool
	Loss         float64
	GradNorm     float64
	LearningRate float64
	LossScale    float64
}

func statsOf(s *C.zt_step_stats) StepStats {
	return StepStats{int64(s.global_step), s.stepped != 0, s.skipped != 0, float64(s.loss),
		float64(s.grad_norm), float64(s.learning_rate), float64(s.loss_scale)}
}

// Trainer is one rank's trainer; Close frees it.
type Trainer struct {
	raw     *C.zt_trainer
	rewards []cgo.Handle // the reward functions the C side calls, released by Close
}

// New creates a trainer from the options of `zerotrain train` as one JSON object. Collective.
// The C calls of one trainer must stay on one OS thread (the error message is thread-local),
// so each method locks the goroutine to its thread for the call.
func New(optionsJSON string) (*Trainer, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	opts := C.CString(optionsJSON)
	defer C.free(unsafe.Pointer(opts))
	var raw *C.zt_trainer
	if err := check(C.zt_trainer_create(opts, &raw)); err != nil {
		return nil, err
	}
	t := &Trainer{raw: raw}
	runtime.SetFinalizer(t, (*Trainer).Close)
	return t, nil
}

// Close frees the trainer; calling it twice is fine.
func (t *Trainer) Close() {
	if t.raw != nil {
		C.zt_trainer_free(t.raw)
		t.raw = nil
	}
	for _, h := range t.rewards {
		h.Delete()
	}
	t.rewards = nil
}

// Rank is this process's rank; WorldSize the job's number of ranks.
func (t *Trainer) Rank() int      { return int(C.zt_trainer_rank(t.raw)) }
func (t *Trainer) WorldSize() int { return int(C.zt_trainer_world_size(t.raw)) }

func shape(ids, labels []int64, rows int) (C.int64_t, C.int64_t, *C.int64_t, error) {
	if rows <= 0 || len(ids) == 0 || len(ids)%rows != 0 {
		return 0, 0, nil, &Error{InvalidArgument, fmt.Sprintf("%d token ids do not make %d rows of a positive length", len(ids), rows)}
	}
	var l *C.int64_t
	if labels != nil {
		if len(labels) != len(ids) {
			return 0, 0, nil, &Error{InvalidArgument, fmt.Sprintf("%d labels for %d ids", len(labels), len(ids))}
		}
		l = (*C.int64_t)(unsafe.Pointer(&labels[0]))
	}
	return C.int64_t(rows), C.int64_t(len(ids) / rows), l, nil
}

// TrainStep runs one micro-batch of batchSize rows (row-major ids; labels nil means a copy of
// the ids; -100 labels are ignored) and steps at the accumulation boundary. Collective.
func (t *Trainer) TrainStep(ids, labels []int64, batchSize int) (StepStats, error) {
	b, s, l, err := shape(ids, labels, batchSize)
	if err != nil {
		return StepStats{}, err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var st C.zt_step_stats
	if err := check(C.zt_trainer_train_step(t.raw, (*C.int64_t)(unsafe.Pointer(&ids[0])), l, b, s, &st)); err != nil {
		return StepStats{}, err
	}
	return statsOf(&st), nil
}

// TrainPairsStep runs one micro-batch of `pairs` preference pairs in a run with stage dpo:
// row-major chosen and rejected sequences of one length, each with its labels (-100 on the
// prompt and padding); it steps at the accumulation boundary. Collective.
func (t *Trainer) TrainPairsStep(chosen, chosenLabels, rejected, rejectedLabels []int64, pairs int) (StepStats, error) {
	p, s, cl, err := shape(chosen, chosenLabels, pairs)
	if err != nil {
		return StepStats{}, err
	}
	if chosenLabels == nil || rejectedLabels == nil || len(rejected) != len(chosen) {
		return StepStats{}, &Error{InvalidArgument, fmt.Sprintf("pairs need labels for both sides and as many rejected ids (%d) as chosen ones (%d)", len(rejected), len(chosen))}
	}
	_, _, rl, err := shape(rejected, rejectedLabels, pairs)
	if err != nil {
		return StepStats{}, err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var st C.zt_step_stats
	if err := check(C.zt_trainer_train_pairs_step(t.raw, (*C.int64_t)(unsafe.Pointer(&chosen[0])), cl,
		(*C.int64_t)(unsafe.Pointer(&rejected[0])), rl, p, s, &st)); err != nil {
		return StepStats{}, err
	}
	return statsOf(&st), nil
}

// Evaluate is the token-weighted mean loss over numBatches batches of batchSize rows laid out
// back to back. Collective.
func (t *Trainer) Evaluate(ids, labels []int64, numBatches, batchSize int) (float64, error) {
	rows, s, l, err := shape(ids, labels, numBatches*batchSize)
	if err != nil {
		return 0, err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var loss C.double
	err = check(C.zt_trainer_evaluate(t.raw, (*C.int64_t)(unsafe.Pointer(&ids[0])), l, C.int64_t(numBatches),
		rows/C.int64_t(numBatches), s, &loss))
	return float64(loss), err
}

//export goProgress
func goProgress(stats *C.zt_step_stats, userData unsafe.Pointer) C.int {
	progress := cgo.Handle(uintptr(userData)).Value().(func(StepStats) bool)
	if progress(statsOf(stats)) {
		return 0
	}
	return 1
}

// Train runs the configured job; progress sees every optimizer step and returns false to stop
// (every rank then stops with a Cancelled error). Collective.
func (t *Trainer) Train(progress func(StepStats) bool) error {
	if progress == nil {
		progress = func(StepStats) bool { return true }
	}
	h := cgo.NewHandle(progress)
	defer h.Delete()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return check(C.zt_go_train(t.raw, C.uintptr_t(h)))
}

// RewardInput is what a GRPO reward function sees of one completion.
type RewardInput struct {
	Prompt        string            // the prompt's tokens as text (a template's special tokens dropped)
	Completion    string            // the completion's text, special tokens dropped
	CompletionIDs []int32           // its tokens, with the stop token where it stopped
	Columns       map[string]string // the prompt row's other columns ("answer", "solution", ...)
}

// RewardFunc scores a batch of one rank's completions (whole groups of num_generations): one
// reward each, math.NaN() where it does not score a completion.
type RewardFunc func(batch []RewardInput) []float64

//export goReward
func goReward(inputs *C.zt_reward_input, n C.int64_t, rewards *C.double, userData unsafe.Pointer) (status C.int) {
	fn := cgo.Handle(uintptr(userData)).Value().(RewardFunc)
	in := unsafe.Slice(inputs, int(n))
	batch := make([]RewardInput, len(in))
	for i, r := range in {
		batch[i].Prompt = C.GoStringN(r.prompt, C.int(r.prompt_len))
		batch[i].Completion = C.GoStringN(r.completion, C.int(r.completion_len))
		ids := unsafe.Slice((*int32)(unsafe.Pointer(r.completion_ids)), int(r.n_completion_ids))
		batch[i].CompletionIDs = append([]int32(nil), ids...)
		if err := json.Unmarshal([]byte(C.GoString(r.columns_json)), &batch[i].Columns); err != nil {
			fmt.Fprintln(os.Stderr, "zerotrain: a prompt's columns:", err)
			return 1
		}
	}
	// A panic must not unwind into C: it stops the run, as a wrong number of rewards does.
	defer func() {
		if p := recover(); p != nil {
			fmt.Fprintln(os.Stderr, "zerotrain: a reward function panicked:", p)
			status = 1
		}
	}()
	out := fn(batch)
	if len(out) != len(batch) {
		fmt.Fprintf(os.Stderr, "zerotrain: a reward function returned %d rewards for %d completions\n", len(out), len(batch))
		return 1
	}
	copy(unsafe.Slice((*float64)(unsafe.Pointer(rewards)), len(out)), out)
	return 0
}

// AddReward adds a reward function name to a run with stage grpo (after its reward_funcs and
// reward_command, in the order added). fn is called inside Train, on its thread; a panic or a
// wrong number of rewards stops the run (a Cancelled error naming the function). Every rank adds
// the same functions.
func (t *Trainer) AddReward(name string, fn RewardFunc) error {
	if fn == nil {
		return &Error{InvalidArgument, fmt.Sprintf("reward function %q is nil", name)}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	h := cgo.NewHandle(fn)
	if err := check(C.zt_go_add_reward(t.raw, cname, C.uintptr_t(h))); err != nil {
		h.Delete()
		return err
	}
	t.rewards = append(t.rewards, h)
	return nil
}

func (t *Trainer) withPath(dir string, call func(*C.char) C.zt_status) error {
	p := C.CString(dir)
	defer C.free(unsafe.Pointer(p))
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return check(call(p))
}

// SaveCheckpoint writes one complete checkpoint folder at dir. Collective.
func (t *Trainer) SaveCheckpoint(dir string) error {
	return t.withPath(dir, func(p *C.char) C.zt_status { return C.zt_trainer_save_checkpoint(t.raw, p) })
}

// LoadCheckpoint restores a checkpoint folder (also from another world size). Collective.
func (t *Trainer) LoadCheckpoint(dir string) error {
	return t.withPath(dir, func(p *C.char) C.zt_status { return C.zt_trainer_load_checkpoint(t.raw, p) })
}

// Export writes the model: an HF folder, or PEFT adapter files. Collective.
func (t *Trainer) Export(dir string) error {
	return t.withPath(dir, func(p *C.char) C.zt_status { return C.zt_trainer_export(t.raw, p) })
}

// LogLevel is a log message's level.
type LogLevel int

const (
	LogDebug   LogLevel = 0
	LogInfo    LogLevel = 1
	LogWarning LogLevel = 2
	LogError   LogLevel = 3
)

var (
	logMu     sync.Mutex
	logHandle cgo.Handle
)

//export goLog
func goLog(level C.int, message *C.char, userData unsafe.Pointer) {
	cgo.Handle(uintptr(userData)).Value().(func(LogLevel, string))(LogLevel(level), C.GoString(message))
}

// SetLogCallback routes every log message of the library to fn (nil restores the default:
// lines on stderr). Process-wide. fn may be called from any thread that runs zerotrain code,
// one call at a time.
func SetLogCallback(fn func(level LogLevel, message string)) {
	logMu.Lock()
	defer logMu.Unlock()
	old := logHandle
	if fn == nil {
		C.zt_set_log_callback(nil, nil)
		logHandle = 0
	} else {
		logHandle = cgo.NewHandle(fn)
		C.zt_go_set_log(C.uintptr_t(logHandle))
	}
	if old != 0 {
		old.Delete()
	}
}

// Tokenizer encodes and decodes text as the trainer's data pipeline does; safe for concurrent
// use. Close frees it.
type Tokenizer struct{ raw *C.zt_tokenizer }

// LoadTokenizer loads the tokenizer of an HF model folder ("" for the byte-level tokenizer).
func LoadTokenizer(modelDir string) (*Tokenizer, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var dir *C.char
	if modelDir != "" {
		dir = C.CString(modelDir)
		defer C.free(unsafe.Pointer(dir))
	}
	var raw *C.zt_tokenizer
	if err := check(C.zt_tokenizer_load(dir, &raw)); err != nil {
		return nil, err
	}
	t := &Tokenizer{raw}
	runtime.SetFinalizer(t, (*Tokenizer).Close)
	return t, nil
}

// Close frees the tokenizer; calling it twice is fine.
func (t *Tokenizer) Close() {
	if t.raw != nil {
		C.zt_tokenizer_free(t.raw)
		t.raw = nil
	}
}

// Encode gives the ids of text; with addBOS, bos first where the tokenizer adds one.
func (t *Tokenizer) Encode(text string, addBOS bool) ([]int32, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ctext := C.CString(text)
	defer C.free(unsafe.Pointer(ctext))
	bos := C.int32_t(0)
	if addBOS {
		bos = 1
	}
	var n C.int64_t
	if err := check(C.zt_tokenizer_encode(t.raw, ctext, C.int64_t(len(text)), bos, nil, 0, &n)); err != nil {
		return nil, err
	}
	ids := make([]int32, int(n)+1) // +1: never a zero-length slice to take the address of
	if err := check(C.zt_tokenizer_encode(t.raw, ctext, C.int64_t(len(text)), bos,
		(*C.int32_t)(unsafe.Pointer(&ids[0])), C.int64_t(len(ids)), &n)); err != nil {
		return nil, err
	}
	return ids[:n], nil
}

// Decode gives the text of ids (special ids and -100 skipped).
func (t *Tokenizer) Decode(ids []int32) (string, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var p *C.int32_t
	if len(ids) > 0 {
		p = (*C.int32_t)(unsafe.Pointer(&ids[0]))
	}
	var n C.int64_t
	if err := check(C.zt_tokenizer_decode(t.raw, p, C.int64_t(len(ids)), nil, 0, &n)); err != nil {
		return "", err
	}
	buf := make([]byte, int(n)+1)
	if err := check(C.zt_tokenizer_decode(t.raw, p, C.int64_t(len(ids)), (*C.char)(unsafe.Pointer(&buf[0])),
		C.int64_t(len(buf)), &n)); err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// VocabSize, BOS, EOS and Pad describe the tokenizer's ids (-1: none).
func (t *Tokenizer) VocabSize() int64 { return int64(C.zt_tokenizer_vocab_size(t.raw)) }
func (t *Tokenizer) BOS() int32       { return int32(C.zt_tokenizer_bos_id(t.raw)) }
func (t *Tokenizer) EOS() int32       { return int32(C.zt_tokenizer_eos_id(t.raw)) }
func (t *Tokenizer) Pad() int32       { return int32(C.zt_tokenizer_pad_id(t.raw)) }
