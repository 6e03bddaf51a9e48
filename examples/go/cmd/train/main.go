// Trains the tiny model a few steps through the Go package and exports it.
//
//	zerotrain launch --nproc_per_node 2 -- ./train OUT_DIR
package main

import (
	"fmt"
	"os"

	"zerotrain.example/zerotrain"
)

func run(out string) error {
	t, err := zerotrain.New(fmt.Sprintf(`{"model_config": {"model_type": "llama", "vocab_size": 259,
		"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
		"max_position_embeddings": 64}, "output_dir": %q, "max_steps": 20, "learning_rate": 0.003,
		"per_device_train_batch_size": 2, "deepspeed": {"zero_optimization": {"stage": 2}}}`, out))
	if err != nil {
		return err
	}
	defer t.Close()
	rank := int64(t.Rank())
	var first, last zerotrain.StepStats
	for step := int64(0); step < 20; step++ {
		ids := make([]int64, 2*16) // each rank its own rows, counting up from a start value
		for i := range ids {
			ids[i] = 3 + (step*7919+rank*104729+int64(i/16)*17+int64(i%16))%200
		}
		if last, err = t.TrainStep(ids, nil, 2); err != nil {
			return err
		}
		if step == 0 {
			first = last
		}
	}
	if err := t.Export(out + "/model"); err != nil {
		return err
	}
	if rank == 0 {
		fmt.Printf("%d ranks, %d steps: loss %.4f -> %.4f\n", t.WorldSize(), last.GlobalStep, first.Loss, last.Loss)
		if last.Loss >= first.Loss {
			return fmt.Errorf("the loss did not fall")
		}
		fmt.Println("Go example: OK")
	}
	return nil
}

func main() {
	out := "go_example_out"
	if len(os.Args) > 1 {
		out = os.Args[1]
	}
	if err := run(out); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
