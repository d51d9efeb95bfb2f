//! Layout construction benchmarks (work in progress).
fn main() {}
