//! The seam between the two kernels: under [`Kernels::Portable`] no fused CPU op
//! runs, so CI's portable run on the CPU is the arithmetic a GPU runs. Its test needs
//! a whole model (training, adapters, a frozen copy's decoding) and the ops'
//! test-only counter, so it lives in this test-only module, which no file imports,
//! rather than beside `Kernels` in a file the model depends on.

use candle_core::Device;
use metronome_core::{PackedRow, Segment, Targets};

use crate::ops::fused_ops_run;
use crate::{Kernels, KvCache, LoraConfig, Model, ModelConfig};

/// A training forward and backward, plain, through LoRA adapters and through the chunked
/// head with checkpointed layers, and a frozen copy's prefill and decode steps run
/// under both kernels while this thread's fused
/// ops are counted: none may count under `Portable`; under `Fused` each counts some,
/// which shows that the count sees them.
#[test]
fn portable_kernels_run_no_fused_cpu_op() {
    let row = PackedRow {
        tokens: vec![5, 9, 2, 7, 11, 4],
        positions: (0..6).collect(),
        segments: vec![Segment { start: 0, len: 6, parent: None }],
    };
    let targets =
        Targets { row: vec![0; 3], position: vec![2, 3, 4], token: vec![7, 11, 4], ..Targets::default() };
    let train = |m: &Model| {
        let out = m.target_logprobs(std::slice::from_ref(&row), &targets).unwrap();
        (out.logprobs.sum_all().unwrap() + out.entropy.sum_all().unwrap()).unwrap().backward().unwrap();
    };
    let counted = |run: &dyn Fn()| {
        let before = fused_ops_run();
        run();
        fused_ops_run() - before
    };
    let base = Model::new(ModelConfig::tiny(), &Device::Cpu, 3).unwrap();
    for kernels in [Kernels::Fused, Kernels::Portable] {
        let model = base.clone().with_kernels(kernels).unwrap();
        let adapted = model.with_lora(&LoraConfig::default(), 1).unwrap();
        let levered = model.clone().with_chunked_head(Some(300)).with_gradient_checkpointing(true);
        let frozen = model.frozen_copy().unwrap();
        let decode = || {
            let mut cache = KvCache::new(&frozen, 2, 16).unwrap();
            frozen.prefill_many(&mut cache, &[(0, &[5, 9, 2][..]), (1, &[7, 1][..])]).unwrap();
            frozen.decode_step(&mut cache, &[(0, 4), (1, 8)]).unwrap();
            frozen.decode_step(&mut cache, &[(1, 3)]).unwrap();
        };
        for (what, n) in [
            ("training", counted(&|| train(&model))),
            ("training with LoRA", counted(&|| train(&adapted))),
            ("training with the chunked head and checkpointing", counted(&|| train(&levered))),
            ("a frozen copy's prefill and decode", counted(&decode)),
        ] {
            if kernels == Kernels::Portable {
                assert_eq!(n, 0, "{what} ran {n} fused CPU ops under Portable");
            } else {
                assert!(n > 0, "{what} counted no fused op under Fused");
            }
        }
    }
}

/// Every fused op counts itself: each `cpu_fwd` in `ops/` begins with
/// `fused_op_ran()`, so the test above also sees an op added later.
#[test]
fn every_fused_cpu_op_counts_itself() {
    let sources = [
        ("ops/mod.rs", include_str!("ops/mod.rs")),
        ("ops/train.rs", include_str!("ops/train.rs")),
        ("ops/decode.rs", include_str!("ops/decode.rs")),
        ("ops/linear.rs", include_str!("ops/linear.rs")),
    ];
    let mut ops = 0;
    for (file, source) in sources {
        for body in source.split("fn cpu_fwd(").skip(1) {
            ops += 1;
            let first = body.split_once("{\n").map_or("", |(_, rest)| rest.trim_start());
            assert!(first.starts_with("fused_op_ran();"), "a `cpu_fwd` in {file} that does not count itself");
        }
    }
    assert_ne!(ops, 0, "no `cpu_fwd` found: the test reads the wrong files");
}
