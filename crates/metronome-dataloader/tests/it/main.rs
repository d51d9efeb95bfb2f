//! Integration tests of the data loader: one binary, one module per concern.

mod chat;
mod code;
mod common;
mod files;
mod metrics;
mod overlong;
mod parquet_files;
mod release;
mod tasks;
mod word_problems;
