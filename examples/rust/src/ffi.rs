//! The C declarations of include/zerotrain/zerotrain.h (ZT_API_VERSION 1), by hand.
use std::os::raw::{c_char, c_int, c_void};

pub const ZT_API_VERSION: c_int = 1;

#[repr(C)]
pub struct zt_trainer {
    _private: [u8; 0],
}

#[repr(C)]
pub struct zt_tokenizer {
    _private: [u8; 0],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct zt_step_stats {
    pub global_step: i64,
    pub stepped: i32,
    pub skipped: i32,
    pub loss: f64,
    pub grad_norm: f64,
    pub learning_rate: f64,
    pub loss_scale: f64,
}

#[repr(C)]
pub struct zt_reward_input {
    pub prompt: *const c_char,
    pub prompt_len: i64,
    pub completion: *const c_char,
    pub completion_len: i64,
    pub completion_ids: *const i32,
    pub n_completion_ids: i64,
    pub columns_json: *const c_char,
}

pub type zt_reward_fn = Option<
    unsafe extern "C" fn(inputs: *const zt_reward_input, n: i64, rewards: *mut f64, user_data: *mut c_void) -> c_int,
>;

pub type zt_progress_fn = Option<unsafe extern "C" fn(stats: *const zt_step_stats, user_data: *mut c_void) -> c_int>;
pub type zt_log_fn = Option<unsafe extern "C" fn(level: c_int, message: *const c_char, user_data: *mut c_void)>;

extern "C" {
    pub fn zt_api_version() -> c_int;
    pub fn zt_version() -> *const c_char;
    pub fn zt_status_name(status: c_int) -> *const c_char;
    pub fn zt_last_error() -> *const c_char;
    pub fn zt_set_log_callback(f: zt_log_fn, user_data: *mut c_void);
    pub fn zt_trainer_create(options_json: *const c_char, out: *mut *mut zt_trainer) -> c_int;
    pub fn zt_trainer_rank(t: *const zt_trainer) -> i32;
    pub fn zt_trainer_world_size(t: *const zt_trainer) -> i32;
    pub fn zt_trainer_train_step(
        t: *mut zt_trainer,
        input_ids: *const i64,
        labels: *const i64,
        batch_size: i64,
        seq_len: i64,
        stats: *mut zt_step_stats,
    ) -> c_int;
    pub fn zt_trainer_train_pairs_step(
        t: *mut zt_trainer,
        chosen_ids: *const i64,
        chosen_labels: *const i64,
        rejected_ids: *const i64,
        rejected_labels: *const i64,
        pairs: i64,
        seq_len: i64,
        stats: *mut zt_step_stats,
    ) -> c_int;
    pub fn zt_trainer_evaluate(
        t: *mut zt_trainer,
        input_ids: *const i64,
        labels: *const i64,
        num_batches: i64,
        batch_size: i64,
        seq_len: i64,
        mean_loss: *mut f64,
    ) -> c_int;
    pub fn zt_trainer_train(t: *mut zt_trainer, progress: zt_progress_fn, user_data: *mut c_void) -> c_int;
    pub fn zt_trainer_save_checkpoint(t: *mut zt_trainer, dir: *const c_char) -> c_int;
    pub fn zt_trainer_load_checkpoint(t: *mut zt_trainer, dir: *const c_char) -> c_int;
    pub fn zt_trainer_export(t: *mut zt_trainer, dir: *const c_char) -> c_int;
    pub fn zt_trainer_add_reward(t: *mut zt_trainer, name: *const c_char, f: zt_reward_fn, user_data: *mut c_void) -> c_int;
    pub fn zt_trainer_free(t: *mut zt_trainer);
    pub fn zt_tokenizer_load(model_dir: *const c_char, out: *mut *mut zt_tokenizer) -> c_int;
    pub fn zt_tokenizer_encode(
        tok: *const zt_tokenizer,
        text: *const c_char,
        text_len: i64,
        add_bos: i32,
        ids: *mut i32,
        capacity: i64,
        n_ids: *mut i64,
    ) -> c_int;
    pub fn zt_tokenizer_decode(
        tok: *const zt_tokenizer,
        ids: *const i32,
        n_ids: i64,
        text: *mut c_char,
        capacity: i64,
        n_bytes: *mut i64,
    ) -> c_int;
    pub fn zt_tokenizer_vocab_size(tok: *const zt_tokenizer) -> i64;
    pub fn zt_tokenizer_bos_id(tok: *const zt_tokenizer) -> i32;
    pub fn zt_tokenizer_eos_id(tok: *const zt_tokenizer) -> i32;
    pub fn zt_tokenizer_pad_id(tok: *const zt_tokenizer) -> i32;
    pub fn zt_tokenizer_free(tok: *mut zt_tokenizer);
}
