/* A C host program fine-tunes the tiny model through zerotrain's C API, on every rank of the
 * job: each rank feeds its own rows of each global batch with zt_trainer_train_step, then the
 * ranks save a checkpoint and export the model.
 *
 *   zerotrain launch --nproc_per_node 2 -- ./zt_example_c OUT_DIR
 *   torchrun --no-python --nproc_per_node 2 ./zt_example_c OUT_DIR     (the same)
 */
#include <stdio.h>
#include <stdlib.h>

#include "zerotrain/zerotrain.h"

#define SEQ 16
#define ROWS 2  /* per rank and micro-step */

static int fail(const char *what, zt_status status) {
  fprintf(stderr, "error: %s: %s: %s\n", what, zt_status_name(status), zt_last_error());
  return 1;
}

/* A task with a rule to learn: each row counts up from a start value (mod 200). */
static void make_rows(int64_t *ids, int64_t step, int rank, int micro) {
  for (int r = 0; r < ROWS; ++r) {
    const int64_t start = (step * 7919 + rank * 104729 + micro * 31 + r * 17) % 200;
    for (int t = 0; t < SEQ; ++t) ids[r * SEQ + t] = 3 + (start + t) % 200;
  }
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  char options[1024];
  snprintf(options, sizeof options,
           "{\"model_config\": {\"model_type\": \"llama\", \"vocab_size\": 259, \"hidden_size\": 64,"
           " \"intermediate_size\": 128, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
           " \"max_position_embeddings\": 64},"
           " \"output_dir\": \"%s\", \"max_steps\": 30, \"learning_rate\": 0.003,"
           " \"per_device_train_batch_size\": %d, \"gradient_accumulation_steps\": 2,"
           " \"deepspeed\": {\"zero_optimization\": {\"stage\": 2}}, \"seed\": 7}",
           argv[1], ROWS);
  zt_trainer *t = NULL;
  zt_status s = zt_trainer_create(options, &t);
  if (s != ZT_OK) return fail("create", s);
  const int rank = zt_trainer_rank(t), world = zt_trainer_world_size(t);

  int64_t ids[ROWS * SEQ];
  zt_step_stats stats;
  double first = 0.0;
  for (int64_t step = 0; step < 30; ++step) {
    for (int micro = 0; micro < 2; ++micro) {
      make_rows(ids, step, rank, micro);
      s = zt_trainer_train_step(t, ids, NULL, ROWS, SEQ, &stats);
      if (s != ZT_OK) return fail("train_step", s);
    }
    if (step == 0) first = stats.loss;
    if (rank == 0 && (step + 1) % 10 == 0) {
      printf("step %lld: loss %.4f grad_norm %.3f lr %.2e\n", (long long)stats.global_step, stats.loss,
             stats.grad_norm, stats.learning_rate);
    }
  }
  char dir[1024];
  snprintf(dir, sizeof dir, "%s/checkpoint-c", argv[1]);
  if ((s = zt_trainer_save_checkpoint(t, dir)) != ZT_OK) return fail("save_checkpoint", s);
  snprintf(dir, sizeof dir, "%s/model", argv[1]);
  if ((s = zt_trainer_export(t, dir)) != ZT_OK) return fail("export", s);
  if (rank == 0) {
    printf("%d ranks: loss %.4f -> %.4f; saved %s/checkpoint-c and exported %s\n", world, first, stats.loss,
           argv[1], dir);
    if (!(stats.loss < first)) {
      fprintf(stderr, "error: the loss did not fall\n");
      zt_trainer_free(t);
      return 1;
    }
    printf("C example: OK\n");
  }
  zt_trainer_free(t);
  return 0;
}
