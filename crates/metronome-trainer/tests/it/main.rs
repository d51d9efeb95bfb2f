//! Integration tests of the trainer: closed-form losses, order invariance, the
//! deferred normaliser, resume, guards and learning checks on the tiny model.

mod common;
mod devices;
mod guards;
mod layouts;
mod learning;
mod lora;
mod loss_closed_form;
mod order;
mod precision;
mod resume;
mod variants;
