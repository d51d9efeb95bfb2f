//! Integration tests of the trainer: closed-form losses, order invariance, the
//! deferred normaliser, resume, guards, the train–rollout mismatch, on-policy
//! distillation and learning checks on the tiny model.

mod common;
mod devices;
mod distill;
mod guards;
mod layouts;
mod learning;
mod lora;
mod loss_closed_form;
mod mismatch;
mod order;
mod precision;
mod resume;
mod variants;
