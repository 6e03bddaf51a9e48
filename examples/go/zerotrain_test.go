package zerotrain

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const tiny = `"model_config": {"model_type": "llama", "vocab_size": 259, "hidden_size": 32,
  "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64},
  "device": "cpu", "distributed": {"rank": 0, "world_size": 1}`

func TestVersions(t *testing.T) {
	if APIVersion() != 1 || Version() == "" {
		t.Fatalf("api %d version %q", APIVersion(), Version())
	}
	if ConfigError.String() != "ZT_ERR_CONFIG" {
		t.Fatal(ConfigError.String())
	}
}

func TestBadOptions(t *testing.T) {
	_, err := New(`{"lerning_rate": 1}`)
	var e *Error
	if !errors.As(err, &e) || e.Status != ConfigError || !strings.Contains(e.Message, "lerning_rate") {
		t.Fatalf("got %v", err)
	}
}

func TestStepsAndCheckpoints(t *testing.T) {
	dir := t.TempDir()
	tr, err := New(fmt.Sprintf(`{%s, "output_dir": %q, "max_steps": 20, "learning_rate": 0.01}`, tiny, dir))
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	if tr.Rank() != 0 || tr.WorldSize() != 1 {
		t.Fatal(tr.Rank(), tr.WorldSize())
	}
	ids := make([]int64, 32)
	for i := range ids {
		ids[i] = 3 + int64(i*7)%200
	}
	first, err := tr.TrainStep(ids, nil, 2)
	if err != nil {
		t.Fatal(err)
	}
	last := first
	for i := 0; i < 10; i++ {
		if last, err = tr.TrainStep(ids, nil, 2); err != nil {
			t.Fatal(err)
		}
	}
	if !(last.Loss < first.Loss) || last.GlobalStep != 11 {
		t.Fatalf("loss %v -> %v at step %d", first.Loss, last.Loss, last.GlobalStep)
	}
	_, err = tr.TrainStep([]int64{3, 4, 999}, nil, 1)
	var e *Error
	if !errors.As(err, &e) || e.Status != InvalidArgument || !strings.Contains(e.Message, "999") {
		t.Fatalf("got %v", err)
	}
	before, err := tr.Evaluate(ids, nil, 1, 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := tr.SaveCheckpoint(filepath.Join(dir, "ckpt")); err != nil {
		t.Fatal(err)
	}
	if _, err := tr.TrainStep(ids, nil, 2); err != nil {
		t.Fatal(err)
	}
	if err := tr.LoadCheckpoint(filepath.Join(dir, "ckpt")); err != nil {
		t.Fatal(err)
	}
	if after, _ := tr.Evaluate(ids, nil, 1, 2); after-before > 1e-6 || before-after > 1e-6 {
		t.Fatalf("evaluation %v after load, %v before", after, before)
	}
	if err := tr.Export(filepath.Join(dir, "model")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "model", "config.json")); err != nil {
		t.Fatal(err)
	}
}

func TestPreferencePairs(t *testing.T) {
	tr, err := New(fmt.Sprintf(`{%s, "output_dir": %q, "max_steps": 6, "learning_rate": 0.01,
		"stage": "dpo", "finetuning_type": "lora", "beta": 0.5}`, tiny, t.TempDir()))
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	chosen, rejected := make([]int64, 16), make([]int64, 16)
	cl, rl := make([]int64, 16), make([]int64, 16)
	for i := range chosen {
		chosen[i] = 3 + int64(i*7)%200
		rejected[i] = chosen[i]
		if i%8 >= 3 {
			rejected[i] = 5 + int64(i*11)%200
		}
		cl[i], rl[i] = chosen[i], rejected[i]
		if i%8 < 3 {
			cl[i], rl[i] = -100, -100
		}
	}
	// At the start the policy is the reference (LoRA's B is zero): each pair's loss is log 2.
	first, err := tr.TrainPairsStep(chosen, cl, rejected, rl, 2)
	if err != nil || first.Loss < 0.693147 || first.Loss > 0.693148 {
		t.Fatalf("first pairs step: %v %v", first.Loss, err)
	}
	last := first
	for i := 0; i < 5; i++ {
		if last, err = tr.TrainPairsStep(chosen, cl, rejected, rl, 2); err != nil {
			t.Fatal(err)
		}
	}
	if !(last.Loss < first.Loss) {
		t.Fatalf("loss %v -> %v", first.Loss, last.Loss)
	}
	var e *Error
	if _, err = tr.TrainPairsStep(chosen, cl, rejected[:8], rl[:8], 2); !errors.As(err, &e) || e.Status != InvalidArgument {
		t.Fatalf("got %v", err)
	}
}

func TestLogCallback(t *testing.T) {
	var lines []string
	SetLogCallback(func(level LogLevel, message string) {
		if level == LogWarning {
			lines = append(lines, message)
		}
	})
	defer SetLogCallback(nil)
	// An HF flag without effect in zerotrain: accepted, with one warning through the callback.
	tr, err := New(fmt.Sprintf(`{%s, "output_dir": %q, "max_steps": 2, "dataloader_num_workers": 4}`, tiny, t.TempDir()))
	if err != nil {
		t.Fatal(err)
	}
	tr.Close()
	found := false
	for _, l := range lines {
		found = found || strings.Contains(l, "dataloader_num_workers has no effect")
	}
	if !found {
		t.Fatalf("no warning about dataloader_num_workers among %q", lines)
	}
}

func TestTokenizer(t *testing.T) {
	tok, err := LoadTokenizer("")
	if err != nil {
		t.Fatal(err)
	}
	defer tok.Close()
	ids, err := tok.Encode("héllo", true)
	if err != nil {
		t.Fatal(err)
	}
	// The byte-level tokenizer: bos 256, then the UTF-8 bytes.
	want := []int32{256, 'h', 0xc3, 0xa9, 'l', 'l', 'o'}
	if fmt.Sprint(ids) != fmt.Sprint(want) {
		t.Fatalf("ids %v, want %v", ids, want)
	}
	text, err := tok.Decode(ids)
	if err != nil || text != "héllo" {
		t.Fatalf("decoded %q (%v)", text, err)
	}
	if tok.VocabSize() != 259 || tok.BOS() != 256 || tok.EOS() != 257 {
		t.Fatal(tok.VocabSize(), tok.BOS(), tok.EOS())
	}
	if _, err := LoadTokenizer(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Fatal("a missing folder loaded")
	}
}

func TestGRPOWithAGoReward(t *testing.T) {
	dir := t.TempDir()
	prompts := filepath.Join(dir, "prompts.jsonl")
	var rows strings.Builder
	for i := 0; i < 8; i++ {
		fmt.Fprintf(&rows, "{\"prompt\": \"Say a %d:\", \"answer\": \"aaa\"}\n", i)
	}
	if err := os.WriteFile(prompts, []byte(rows.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	options := func(out string, steps int) string {
		return fmt.Sprintf(`{%s, "output_dir": %q, "train_file": %q, "stage": "grpo", "num_generations": 4,
			"max_completion_length": 6, "per_device_train_batch_size": 4, "max_steps": %d, "save_steps": 100,
			"finetuning_type": "lora"}`, tiny, filepath.Join(dir, out), prompts, steps)
	}
	tr, err := New(options("out", 2))
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	var sizes []int
	err = tr.AddReward("share_of_a", func(batch []RewardInput) []float64 {
		sizes = append(sizes, len(batch))
		out := make([]float64, len(batch))
		for i, r := range batch {
			if !strings.HasPrefix(r.Prompt, "Say a ") || r.Columns["answer"] != "aaa" || len(r.CompletionIDs) == 0 {
				t.Errorf("input %+v", r)
			}
			out[i] = float64(strings.Count(r.Completion, "a")) / float64(len(r.Completion)+1)
		}
		return out
	})
	if err != nil {
		t.Fatal(err)
	}
	var e *Error
	if err := tr.AddReward("share_of_a", func(b []RewardInput) []float64 { return nil }); !errors.As(err, &e) || e.Status != InvalidArgument {
		t.Fatalf("a second function of the same name: %v", err)
	}
	if err := tr.Train(nil); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(sizes) != "[4 4]" {
		t.Fatalf("the reward saw batches %v", sizes)
	}
	// A function that panics stops the run with a Cancelled error naming it.
	short, err := New(options("short", 1))
	if err != nil {
		t.Fatal(err)
	}
	defer short.Close()
	if err := short.AddReward("panics", func([]RewardInput) []float64 { panic("no") }); err != nil {
		t.Fatal(err)
	}
	if err := short.Train(nil); !errors.As(err, &e) || e.Status != Cancelled || !strings.Contains(e.Message, "reward function 'panics'") {
		t.Fatalf("got %v", err)
	}
}
