//! Safe Rust bindings to libzerotrain's C API: fine-tune decoder LLMs with DeepSpeed-style ZeRO
//! sharding from Rust.
//!
//! ```no_run
//! let mut t = zerotrain::Trainer::new(r#"{"model_name_or_path": "/models/Qwen2.5-7B",
//!     "train_file": "data.jsonl", "output_dir": "out", "finetuning_type": "lora"}"#)?;
//! t.train(|stats| { println!("step {} loss {:.4}", stats.global_step, stats.loss); true })?;
//! # Ok::<(), zerotrain::Error>(())
//! ```
//!
//! Collective calls (`Trainer::new`, `train_step`, `evaluate`, `train`, `save_checkpoint`,
//! `load_checkpoint`, `export`) must be made by every rank of the job in the same order; ranks
//! come from torchrun's environment variables or a `"distributed"` object in the options.
#![allow(non_camel_case_types)]
mod ffi;

use std::ffi::{CStr, CString};
use std::fmt;
use std::os::raw::{c_char, c_int, c_void};
use std::path::Path;
use std::ptr;
use std::sync::Mutex;

/// Why a call failed: the C API's status code and the message it gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    /// `ZT_ERR_*` as a number (1 invalid argument, 2 config, 3 I/O, 4 distributed, 5 out of
    /// memory, 6 numeric, 7 cancelled, 8 internal).
    pub status: i32,
    pub message: String,
}

impl Error {
    /// The status's name, e.g. `"ZT_ERR_CONFIG"`.
    pub fn status_name(&self) -> String {
        status_name(self.status)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status_name(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

fn status_name(status: i32) -> String {
    unsafe { CStr::from_ptr(ffi::zt_status_name(status)) }.to_string_lossy().into_owned()
}

fn check(status: c_int) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    let message = unsafe { CStr::from_ptr(ffi::zt_last_error()) }.to_string_lossy().into_owned();
    Err(Error { status, message })
}

fn c_string(s: &str, what: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error { status: 1, message: format!("{what} contains a NUL byte") })
}

fn c_path(p: &Path) -> Result<CString> {
    c_string(&p.to_string_lossy(), "path")
}

/// The C API version of the loaded library (1).
pub fn api_version() -> i32 {
    unsafe { ffi::zt_api_version() }
}

/// The library's version, e.g. "0.1.0".
pub fn version() -> String {
    unsafe { CStr::from_ptr(ffi::zt_version()) }.to_string_lossy().into_owned()
}

/// What one step did (the same on every rank).
pub type StepStats = ffi::zt_step_stats;

/// What a GRPO reward function sees of one completion.
#[derive(Clone, Debug)]
pub struct RewardInput {
    /// The prompt's tokens as text (a template's special tokens dropped).
    pub prompt: String,
    /// The completion's text, special tokens dropped (invalid UTF-8 replaced).
    pub completion: String,
    /// Its tokens, with the stop token where it stopped.
    pub completion_ids: Vec<i32>,
    /// The prompt row's other columns (`answer`, `solution`, ...) as one JSON object of strings.
    pub columns_json: String,
}

type RewardFn = Box<dyn FnMut(&[RewardInput]) -> Vec<Option<f64>>>;

unsafe extern "C" fn reward_trampoline(
    inputs: *const ffi::zt_reward_input,
    n: i64,
    rewards: *mut f64,
    data: *mut c_void,
) -> c_int {
    let f = &mut *(data as *mut RewardFn);
    let text = |p: *const c_char, len: i64| {
        String::from_utf8_lossy(std::slice::from_raw_parts(p as *const u8, len as usize)).into_owned()
    };
    let batch: Vec<RewardInput> = std::slice::from_raw_parts(inputs, n as usize)
        .iter()
        .map(|r| RewardInput {
            prompt: text(r.prompt, r.prompt_len),
            completion: text(r.completion, r.completion_len),
            completion_ids: std::slice::from_raw_parts(r.completion_ids, r.n_completion_ids as usize).to_vec(),
            columns_json: CStr::from_ptr(r.columns_json).to_string_lossy().into_owned(),
        })
        .collect();
    // A panic must not unwind into C: it stops the run, as a wrong number of rewards does.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&batch))) {
        Ok(scores) if scores.len() == batch.len() => {
            for (i, r) in scores.iter().enumerate() {
                *rewards.add(i) = r.unwrap_or(f64::NAN);
            }
            0
        }
        Ok(scores) => {
            eprintln!("zerotrain: a reward function returned {} rewards for {} completions", scores.len(), batch.len());
            1
        }
        Err(_) => 1,
    }
}

/// One rank's trainer. Owns the C handle; dropping it frees the trainer.
pub struct Trainer {
    raw: *mut ffi::zt_trainer,
    // The reward functions the C side calls, boxed twice for one thin pointer each; freed after
    // the trainer (Drop frees it first).
    rewards: Vec<Box<RewardFn>>,
}

impl Trainer {
    /// Creates a trainer from the options of `zerotrain train` as one JSON object. Collective.
    pub fn new(options_json: &str) -> Result<Trainer> {
        let options = c_string(options_json, "options")?;
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::zt_trainer_create(options.as_ptr(), &mut raw) })?;
        Ok(Trainer { raw, rewards: Vec::new() })
    }

    pub fn rank(&self) -> i32 {
        unsafe { ffi::zt_trainer_rank(self.raw) }
    }

    pub fn world_size(&self) -> i32 {
        unsafe { ffi::zt_trainer_world_size(self.raw) }
    }

    fn shape(ids: &[i64], labels: Option<&[i64]>, rows: usize) -> Result<(i64, i64)> {
        if rows == 0 || ids.is_empty() || ids.len() % rows != 0 {
            return Err(Error {
                status: 1,
                message: format!("{} token ids do not make {} rows of a positive length", ids.len(), rows),
            });
        }
        if let Some(l) = labels {
            if l.len() != ids.len() {
                return Err(Error { status: 1, message: format!("{} labels for {} ids", l.len(), ids.len()) });
            }
        }
        Ok((rows as i64, (ids.len() / rows) as i64))
    }

    /// One micro-batch of `batch_size` rows (row-major `ids`, and `labels` or a copy of the ids;
    /// -100 labels are ignored); steps the optimizer at the accumulation boundary. Collective.
    pub fn train_step(&mut self, ids: &[i64], labels: Option<&[i64]>, batch_size: usize) -> Result<StepStats> {
        let (b, s) = Self::shape(ids, labels, batch_size)?;
        let mut stats = StepStats::default();
        let l = labels.map_or(ptr::null(), |l| l.as_ptr());
        check(unsafe { ffi::zt_trainer_train_step(self.raw, ids.as_ptr(), l, b, s, &mut stats) })?;
        Ok(stats)
    }

    /// One micro-batch of `pairs` preference pairs in a run with stage dpo: row-major chosen and
    /// rejected sequences of one length, each with its labels (-100 on the prompt and padding);
    /// steps the optimizer at the accumulation boundary. Collective.
    pub fn train_pairs_step(
        &mut self,
        chosen: &[i64],
        chosen_labels: &[i64],
        rejected: &[i64],
        rejected_labels: &[i64],
        pairs: usize,
    ) -> Result<StepStats> {
        let (p, s) = Self::shape(chosen, Some(chosen_labels), pairs)?;
        Self::shape(rejected, Some(rejected_labels), pairs)?;
        if rejected.len() != chosen.len() {
            return Err(Error {
                status: 1,
                message: format!("{} rejected ids for {} chosen ids", rejected.len(), chosen.len()),
            });
        }
        let mut stats = StepStats::default();
        check(unsafe {
            ffi::zt_trainer_train_pairs_step(
                self.raw,
                chosen.as_ptr(),
                chosen_labels.as_ptr(),
                rejected.as_ptr(),
                rejected_labels.as_ptr(),
                p,
                s,
                &mut stats,
            )
        })?;
        Ok(stats)
    }

    /// The token-weighted mean loss over `num_batches` batches of `batch_size` rows laid out back
    /// to back. Collective.
    pub fn evaluate(&mut self, ids: &[i64], labels: Option<&[i64]>, num_batches: usize, batch_size: usize) -> Result<f64> {
        let (rows, s) = Self::shape(ids, labels, num_batches * batch_size)?;
        let mut loss = 0.0;
        let l = labels.map_or(ptr::null(), |l| l.as_ptr());
        check(unsafe {
            ffi::zt_trainer_evaluate(self.raw, ids.as_ptr(), l, num_batches as i64, rows / num_batches as i64, s, &mut loss)
        })?;
        Ok(loss)
    }

    /// Runs the configured job; `progress` sees every optimizer step and returns false to stop
    /// (every rank then stops with a `ZT_ERR_CANCELLED` error). Collective.
    pub fn train<F: FnMut(&StepStats) -> bool>(&mut self, mut progress: F) -> Result<()> {
        unsafe extern "C" fn trampoline<F: FnMut(&StepStats) -> bool>(stats: *const StepStats, data: *mut c_void) -> c_int {
            let f = &mut *(data as *mut F);
            // A panic must not unwind into C: treat it as a request to stop.
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&*stats))) {
                Ok(true) => 0,
                _ => 1,
            }
        }
        let data = &mut progress as *mut F as *mut c_void;
        check(unsafe { ffi::zt_trainer_train(self.raw, Some(trampoline::<F>), data) })
    }

    /// Adds a reward function `name` to a run with stage grpo (after its reward_funcs and
    /// reward_command, in the order added). `f` scores a batch of this rank's completions (whole
    /// groups of num_generations): one reward each, `None` where it does not score one. It is
    /// called inside `train`, on its thread; a panic or a wrong number of rewards stops the run
    /// (a `ZT_ERR_CANCELLED` error naming the function). Every rank adds the same functions.
    pub fn add_reward<F>(&mut self, name: &str, f: F) -> Result<()>
    where
        F: FnMut(&[RewardInput]) -> Vec<Option<f64>> + 'static,
    {
        let n = c_string(name, "reward name")?;
        let mut boxed: Box<RewardFn> = Box::new(Box::new(f));
        let data = &mut *boxed as *mut RewardFn as *mut c_void;
        check(unsafe { ffi::zt_trainer_add_reward(self.raw, n.as_ptr(), Some(reward_trampoline), data) })?;
        self.rewards.push(boxed);
        Ok(())
    }

    /// Writes one complete checkpoint folder at `dir`. Collective.
    pub fn save_checkpoint(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let d = c_path(dir.as_ref())?;
        check(unsafe { ffi::zt_trainer_save_checkpoint(self.raw, d.as_ptr()) })
    }

    /// Restores a checkpoint folder (also one saved at another world size). Collective.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let d = c_path(dir.as_ref())?;
        check(unsafe { ffi::zt_trainer_load_checkpoint(self.raw, d.as_ptr()) })
    }

    /// Writes the model: an HF folder, or PEFT adapter files. Collective.
    pub fn export(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let d = c_path(dir.as_ref())?;
        check(unsafe { ffi::zt_trainer_export(self.raw, d.as_ptr()) })
    }
}

impl Drop for Trainer {
    fn drop(&mut self) {
        unsafe { ffi::zt_trainer_free(self.raw) }
    }
}

/// A log message's level (0 debug, 1 info, 2 warning, 3 error).
pub type LogLevel = i32;

type LogFn = Box<dyn Fn(LogLevel, &str) + Send + Sync>;

// The registered callback: boxed twice so the C side holds one thin pointer; replaced only
// under the lock, and the old one is freed after the library stopped using it.
static LOG_CALLBACK: Mutex<Option<Box<LogFn>>> = Mutex::new(None);

unsafe extern "C" fn log_trampoline(level: c_int, message: *const c_char, data: *mut c_void) {
    let f = &*(data as *const LogFn);
    let text = CStr::from_ptr(message).to_string_lossy();
    // A panic must not unwind into C.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(level, &text)));
}

/// Routes every log message of the library to `f` (`None` restores the default: lines on
/// stderr). Process-wide; `f` may be called from any thread that runs zerotrain code, one call
/// at a time.
pub fn set_log_callback(f: Option<LogFn>) {
    let mut slot = LOG_CALLBACK.lock().unwrap();
    match f {
        Some(f) => {
            let boxed: Box<LogFn> = Box::new(f);
            let data = &*boxed as *const LogFn as *mut c_void;
            unsafe { ffi::zt_set_log_callback(Some(log_trampoline), data) };
            *slot = Some(boxed);
        }
        None => {
            unsafe { ffi::zt_set_log_callback(None, ptr::null_mut()) };
            *slot = None;
        }
    }
}

/// Text ↔ token ids as the trainer's data pipeline makes them. Immutable; may be shared across
/// threads.
pub struct Tokenizer {
    raw: *mut ffi::zt_tokenizer,
}

unsafe impl Send for Tokenizer {}
unsafe impl Sync for Tokenizer {}

impl Tokenizer {
    /// The tokenizer of an HF model folder; `None` (or a folder without tokenizer files) gives
    /// the byte-level tokenizer.
    pub fn load(model_dir: Option<&Path>) -> Result<Tokenizer> {
        let dir = model_dir.map(c_path).transpose()?;
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::zt_tokenizer_load(dir.as_ref().map_or(ptr::null(), |d| d.as_ptr()), &mut raw) })?;
        Ok(Tokenizer { raw })
    }

    /// The ids of `text`; with `add_bos`, bos first where the tokenizer adds one.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<i32>> {
        let mut n = 0i64;
        let p = text.as_ptr() as *const c_char;
        let len = text.len() as i64;
        check(unsafe { ffi::zt_tokenizer_encode(self.raw, p, len, add_bos as i32, ptr::null_mut(), 0, &mut n) })?;
        let mut ids = vec![0i32; n as usize];
        if n > 0 {
            check(unsafe { ffi::zt_tokenizer_encode(self.raw, p, len, add_bos as i32, ids.as_mut_ptr(), n, &mut n) })?;
        }
        Ok(ids)
    }

    /// The text of `ids` (special ids and -100 skipped).
    pub fn decode(&self, ids: &[i32]) -> Result<String> {
        let mut n = 0i64;
        check(unsafe {
            ffi::zt_tokenizer_decode(self.raw, ids.as_ptr(), ids.len() as i64, ptr::null_mut(), 0, &mut n)
        })?;
        let mut buf = vec![0u8; n as usize + 1];
        check(unsafe {
            ffi::zt_tokenizer_decode(self.raw, ids.as_ptr(), ids.len() as i64, buf.as_mut_ptr() as *mut c_char,
                                     buf.len() as i64, &mut n)
        })?;
        buf.truncate(n as usize);
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    pub fn vocab_size(&self) -> i64 {
        unsafe { ffi::zt_tokenizer_vocab_size(self.raw) }
    }
    /// -1 when the tokenizer has none.
    pub fn bos_id(&self) -> i32 {
        unsafe { ffi::zt_tokenizer_bos_id(self.raw) }
    }
    pub fn eos_id(&self) -> i32 {
        unsafe { ffi::zt_tokenizer_eos_id(self.raw) }
    }
    pub fn pad_id(&self) -> i32 {
        unsafe { ffi::zt_tokenizer_pad_id(self.raw) }
    }
}

impl Drop for Tokenizer {
    fn drop(&mut self) {
        unsafe { ffi::zt_tokenizer_free(self.raw) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = r#""model_config": {"model_type": "llama", "vocab_size": 259, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64},
        "device": "cpu", "distributed": {"rank": 0, "world_size": 1}"#;

    fn temp_dir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("zt-rust-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn preference_pairs_train_a_dpo_run() {
        let dir = temp_dir("pairs");
        let mut t = Trainer::new(&format!(
            r#"{{{TINY}, "output_dir": "{}", "max_steps": 6, "learning_rate": 0.01,
                "stage": "dpo", "finetuning_type": "lora", "beta": 0.5}}"#,
            dir.display()
        ))
        .unwrap();
        let chosen: Vec<i64> = (0..16).map(|i| 3 + (i * 7) % 200).collect();
        let rejected: Vec<i64> = (0..16).map(|i| if i % 8 < 3 { chosen[i as usize] } else { 5 + (i * 11) % 200 }).collect();
        let labels = |ids: &[i64]| -> Vec<i64> { ids.iter().enumerate().map(|(i, &x)| if i % 8 < 3 { -100 } else { x }).collect() };
        let (cl, rl) = (labels(&chosen), labels(&rejected));
        // At the start the policy is the reference (LoRA's B is zero): each pair's loss is log 2.
        let first = t.train_pairs_step(&chosen, &cl, &rejected, &rl, 2).unwrap();
        assert!((first.loss - 2f64.ln()).abs() < 1e-6, "{}", first.loss);
        let mut last = first;
        for _ in 0..5 {
            last = t.train_pairs_step(&chosen, &cl, &rejected, &rl, 2).unwrap();
        }
        assert!(last.loss < first.loss, "{} -> {}", first.loss, last.loss);
        let e = t.train_pairs_step(&chosen, &cl, &rejected[..8], &rl[..8], 2).err().unwrap();
        assert_eq!(e.status, 1, "{}", e);
    }

    #[test]
    fn a_grpo_run_is_scored_by_a_closure() {
        use std::cell::RefCell;
        use std::rc::Rc;
        let dir = temp_dir("grpo");
        let prompts = dir.join("prompts.jsonl");
        let rows: String = (0..8).map(|i| format!("{{\"prompt\": \"Say a {i}:\", \"answer\": \"aaa\"}}\n")).collect();
        std::fs::write(&prompts, rows).unwrap();
        let options = |out: &str, steps: i32| {
            format!(
                r#"{{{TINY}, "output_dir": "{}", "train_file": "{}", "stage": "grpo", "num_generations": 4,
                    "max_completion_length": 6, "per_device_train_batch_size": 4, "max_steps": {steps},
                    "save_steps": 100, "finetuning_type": "lora"}}"#,
                dir.join(out).display(),
                prompts.display()
            )
        };
        let mut t = Trainer::new(&options("out", 2)).unwrap();
        let seen = Rc::new(RefCell::new(Vec::<usize>::new()));
        let log = seen.clone();
        t.add_reward("share_of_a", move |batch| {
            log.borrow_mut().push(batch.len());
            batch
                .iter()
                .map(|r| {
                    assert!(r.prompt.starts_with("Say a ") && r.columns_json.contains("aaa"), "{r:?}");
                    assert!(!r.completion_ids.is_empty() && r.completion_ids.len() <= 6);
                    let a = r.completion.bytes().filter(|&b| b == b'a').count();
                    (!r.completion.is_empty()).then(|| a as f64 / r.completion.len() as f64)
                })
                .collect()
        })
        .unwrap();
        let e = t.add_reward("share_of_a", |b| vec![None; b.len()]).err().unwrap();
        assert_eq!(e.status, 1, "{}", e);
        t.train(|_| true).unwrap();
        assert_eq!(*seen.borrow(), vec![4, 4]);
        // A function that answers for the wrong number of completions stops the run, named.
        let mut t = Trainer::new(&options("short", 1)).unwrap();
        t.add_reward("short", |b| vec![Some(1.0); b.len() - 1]).unwrap();
        let e = t.train(|_| true).err().unwrap();
        assert_eq!(e.status_name(), "ZT_ERR_CANCELLED", "{}", e);
        assert!(e.message.contains("reward function 'short'"), "{}", e);
    }

    #[test]
    fn versions_and_names() {
        assert_eq!(api_version(), ffi::ZT_API_VERSION);
        assert!(!version().is_empty());
        assert_eq!(status_name(2), "ZT_ERR_CONFIG");
    }

    #[test]
    fn bad_options_are_config_errors_naming_the_option() {
        let e = Trainer::new(r#"{"lerning_rate": 1}"#).err().unwrap();
        assert_eq!(e.status, 2);
        assert!(e.message.contains("lerning_rate"), "{}", e);
        let e = Trainer::new("not json").err().unwrap();
        assert_eq!(e.status_name(), "ZT_ERR_CONFIG");
    }

    #[test]
    fn log_callback_receives_the_warnings() {
        use std::sync::{Arc, Mutex};
        let seen = Arc::new(Mutex::new(Vec::<String>::new()));
        let sink = seen.clone();
        set_log_callback(Some(Box::new(move |level, message| {
            if level == 2 {
                sink.lock().unwrap().push(message.to_owned());
            }
        })));
        let dir = temp_dir("log");
        // An HF flag without effect in zerotrain: accepted, with one warning through the callback.
        let t = Trainer::new(&format!(
            r#"{{{TINY}, "output_dir": "{}", "max_steps": 2, "dataloader_num_workers": 4}}"#,
            dir.display()
        ));
        set_log_callback(None);
        assert!(t.is_ok(), "{:?}", t.err());
        let lines = seen.lock().unwrap();
        assert!(lines.iter().any(|l| l.contains("dataloader_num_workers has no effect")), "{:?}", lines);
    }

    #[test]
    fn tokenizer_round_trips_text() {
        let tok = Tokenizer::load(None).unwrap();
        let ids = tok.encode("héllo", true).unwrap();
        // The byte-level tokenizer: bos 256, then the UTF-8 bytes.
        assert_eq!(ids, vec![256, 'h' as i32, 0xc3, 0xa9, 'l' as i32, 'l' as i32, 'o' as i32]);
        assert_eq!(tok.decode(&ids).unwrap(), "héllo");
        assert_eq!((tok.vocab_size(), tok.bos_id(), tok.eos_id()), (259, 256, 257));
        let e = Tokenizer::load(Some(Path::new("/nonexistent/zerotrain-model"))).err().unwrap();
        assert_eq!(e.status_name(), "ZT_ERR_IO");
    }

    #[test]
    fn steps_lower_the_loss_and_checkpoints_round_trip() {
        let dir = temp_dir("steps");
        let mut t = Trainer::new(&format!(
            r#"{{{TINY}, "output_dir": "{}", "max_steps": 20, "learning_rate": 0.01}}"#,
            dir.display()
        ))
        .unwrap();
        assert_eq!((t.rank(), t.world_size()), (0, 1));
        let ids: Vec<i64> = (0..32).map(|i| 3 + (i * 7) % 200).collect();
        let first = t.train_step(&ids, None, 2).unwrap();
        let mut last = first;
        for _ in 0..10 {
            last = t.train_step(&ids, None, 2).unwrap();
        }
        assert!(last.loss < first.loss);
        assert_eq!(last.global_step, 11);
        let err = t.train_step(&[3, 4, 999], None, 1).err().unwrap();
        assert_eq!(err.status, 1);
        assert!(err.message.contains("999"));
        let before = t.evaluate(&ids, None, 1, 2).unwrap();
        t.save_checkpoint(dir.join("ckpt")).unwrap();
        t.train_step(&ids, None, 2).unwrap();
        t.load_checkpoint(dir.join("ckpt")).unwrap();
        assert!((t.evaluate(&ids, None, 1, 2).unwrap() - before).abs() < 1e-6);
        t.export(dir.join("model")).unwrap();
        assert!(dir.join("model/config.json").exists());
        drop(t);
        let _ = std::fs::remove_dir_all(&dir); // kept when an assertion failed above
    }
}
