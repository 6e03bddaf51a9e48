//! Trains the tiny model a few steps through the safe wrapper and exports it.
//!     zerotrain launch --nproc_per_node 2 -- target/debug/train OUT_DIR
use std::process::ExitCode;

fn run(out: &str) -> zerotrain::Result<()> {
    let mut t = zerotrain::Trainer::new(&format!(
        r#"{{"model_config": {{"model_type": "llama", "vocab_size": 259, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 64}},
           "output_dir": "{out}", "max_steps": 20, "learning_rate": 0.003,
           "per_device_train_batch_size": 2, "deepspeed": {{"zero_optimization": {{"stage": 2}}}}}}"#
    ))?;
    let (rank, world) = (t.rank() as i64, t.world_size());
    let mut first = None;
    let mut stats = None;
    for step in 0..20i64 {
        // Each rank its own rows: sequences counting up from a start value.
        let ids: Vec<i64> = (0..2 * 16)
            .map(|i| 3 + ((step * 7919 + rank * 104729 + (i / 16) * 17) + i % 16) % 200)
            .collect();
        let s = t.train_step(&ids, None, 2)?;
        first.get_or_insert(s.loss);
        stats = Some(s);
    }
    let s = stats.unwrap();
    t.export(format!("{out}/model"))?;
    if rank == 0 {
        println!("{world} ranks, {} steps: loss {:.4} -> {:.4}", s.global_step, first.unwrap(), s.loss);
        if s.loss >= first.unwrap() {
            return Err(zerotrain::Error { status: 8, message: "the loss did not fall".into() });
        }
        println!("Rust example: OK");
    }
    Ok(())
}

fn main() -> ExitCode {
    let out = std::env::args().nth(1).unwrap_or_else(|| "rust_example_out".into());
    match run(&out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(if e.status == 2 || e.status == 1 { 2 } else { 1 })
        }
    }
}
