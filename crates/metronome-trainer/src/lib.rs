//! The tri-model GRPO trainer of Metronome (work in progress).

mod error;
pub mod loss;
pub mod optim;
pub mod schedule;

pub use error::{Result, TrainerError};
