//! The model's assertions on the portable kernels and on a CUDA GPU.
//!
//! On the CPU, [`Kernels::Portable`] runs the arithmetic a GPU runs (composed candle
//! ops instead of the fused CPU ones), so these tests check the GPU path's numbers in
//! CI. The `cuda_*` tests run the same assertions on GPU 0 when the crate is built
//! with the `cuda` feature and a GPU is present; otherwise they print why they were
//! skipped and pass (`cargo xtask gpu` runs them on a GPU machine).

use metronome_core::Targets;
use metronome_model::{Device, DeviceSpec, Kernels, Model, ModelConfig};

use crate::common::{
    close, fixture, full_logits, logprob_around_sgd, logprobs_and_gradients, max_abs_diff, separate_rows,
    tokens,
};
use crate::decode::{
    decode_matches_full_forward, draw_logits, drawing_matches_the_host_reference, draws_for,
    paged_equals_contiguous,
};
use crate::reference::logits_equal_transformers;
use crate::training::{every_parameter_gets_a_gradient, shared_prompt_equals_separate_rows};

fn portable(model: Model) -> Model {
    model.with_kernels(Kernels::Portable).unwrap()
}

fn cpu_fixture(name: &str) -> Model {
    Model::load_hf(&fixture(name), &Device::Cpu).unwrap()
}

/// GPU 0, or `None` with the reason printed (not silently).
fn cuda() -> Option<Device> {
    if !cfg!(feature = "cuda") {
        eprintln!("skipped: built without the `cuda` feature (`cargo xtask gpu` runs this on a GPU)");
        return None;
    }
    match DeviceSpec::Cuda(0).open() {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipped: no CUDA device: {e}");
            None
        }
    }
}

/// A tensor dropped on a thread that never used the GPU (a tokio or rayon worker) is
/// freed there, which needs the context current on that thread: without it the free
/// fails, and the next call anywhere returns `CUDA_ERROR_INVALID_CONTEXT` (a `periodic`
/// run on an H100 stopped so; the vendored candle-core binds it, `vendor/candle-core/PATCH.md`).
#[test]
fn cuda_tensors_dropped_on_a_thread_that_never_used_the_gpu_leave_the_device_working() {
    use metronome_model::{DType, Tensor};
    let Some(gpu) = cuda() else { return };
    for _ in 0..4 {
        let t = Tensor::ones(4096, DType::F32, &gpu).unwrap();
        std::thread::spawn(move || drop(t)).join().unwrap();
    }
    let sum = Tensor::ones(8, DType::F32, &gpu).unwrap().sum_all().unwrap();
    assert_eq!(sum.to_scalar::<f32>().unwrap(), 8.0);
}

/// Two handles on one GPU, each with a stream of its own (`DeviceSpec::open_stream`,
/// what `METRONOME_CUDA_STAGE_STREAMS=1` gives the trainer and the rollout stage): a
/// model copied from one to the other computes the same logits, a tensor crosses by a
/// device-to-device copy (cudarc orders it after the source's last write with an
/// event) with the same values, and work issued from several host threads on one
/// handle stays in order on its stream.
#[test]
fn cuda_handles_with_streams_of_their_own_take_copies_between_them() {
    use metronome_model::Tensor;
    if cuda().is_none() {
        return;
    }
    let (a, b) = (DeviceSpec::Cuda(0).open_stream().unwrap(), DeviceSpec::Cuda(0).open_stream().unwrap());
    assert!(!a.same_device(&b), "each handle is a device of its own to candle");
    let model = Model::new(ModelConfig::tiny(), &a, 3).unwrap();
    let copy = model.frozen_copy_on(&b).unwrap();
    let ids: Vec<u32> = (0..48).map(|i| (i * 7 + 1) % 90).collect();
    let logits =
        |m: &Model, d: &Device| m.forward_logits(&Tensor::from_slice(&ids, (2, 24), d).unwrap()).unwrap();
    let (la, lb) = (logits(&model, &a), logits(&copy, &b));
    let host = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(host(&la), host(&lb), "the same weights give the same logits on either stream");
    let crossed = la.to_device(&b).unwrap();
    assert!(crossed.device().same_device(&b));
    assert_eq!(host(&crossed), host(&la));
    // Products issued from other threads on handle `a`, read back on this one.
    let x = Tensor::from_slice(&ids.iter().map(|&i| i as f32).collect::<Vec<_>>(), (6, 8), &a).unwrap();
    let ones = Tensor::ones((8, 8), metronome_model::DType::F32, &a).unwrap();
    let sums: Vec<f32> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..4u32)
            .map(|k| {
                let (x, ones) = (&x, &ones);
                s.spawn(move || (x * f64::from(k + 1)).unwrap().matmul(ones).unwrap())
            })
            .collect();
        let parts: Vec<Tensor> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        parts.iter().map(|p| p.sum_all().unwrap().to_scalar::<f32>().unwrap()).collect()
    });
    let base = f64::from(host(&x).iter().sum::<f32>()) * 8.0;
    for (k, sum) in sums.iter().enumerate() {
        let want = base * (k + 1) as f64;
        assert!((f64::from(*sum) - want).abs() <= 1e-5 * want, "thread {k}: {sum} vs {want}");
    }
}

/// Publication on one GPU without a host round trip: a trainer's snapshot left on its
/// device (its own stream's handle) installs into an engine on another stream's handle
/// by a device copy, in f32 and into bf16 weights; the engine's logits are then those
/// of the trainer's weights, and the trainer writing its weights afterwards changes
/// neither the snapshot nor the engine. Then a snapshot with a NaN is refused by the
/// device check, naming the element.
#[test]
fn cuda_resident_snapshots_install_device_to_device_across_streams() {
    if cuda().is_none() {
        return;
    }
    let (trainer, engine) =
        (DeviceSpec::Cuda(0).open_stream().unwrap(), DeviceSpec::Cuda(0).open_stream().unwrap());
    resident_snapshots_install_across_handles(&trainer, &engine);
}

/// [`cuda_resident_snapshots_install_device_to_device_across_streams`] on the CPU.
#[test]
fn resident_snapshots_install_across_handles_on_the_cpu() {
    resident_snapshots_install_across_handles(&Device::Cpu, &Device::Cpu);
}

fn resident_snapshots_install_across_handles(trainer: &Device, engine: &Device) {
    use metronome_core::PolicyVersion;
    use metronome_model::{DType, Tensor};
    let policy = Model::new(ModelConfig::tiny(), trainer, 3).unwrap();
    let served = Model::new(ModelConfig::tiny(), engine, 4).unwrap().frozen_copy().unwrap();
    let served_bf16 = served.compute_copy(DType::BF16).unwrap();
    let snap = policy.snapshot_resident(PolicyVersion(1)).unwrap();
    assert!(snap.is_resident());
    served.load_snapshot(&snap).unwrap();
    served_bf16.load_snapshot(&snap).unwrap();
    let built = Model::from_snapshot(policy.config().clone(), &snap, engine, false).unwrap();
    let seq = tokens(5, 9, policy.config().vocab_size);
    let want = full_logits(&policy, &seq);
    assert_eq!(full_logits(&served, &seq), want, "the same f32 weights, the same logits");
    assert_eq!(full_logits(&built, &seq), want);
    let flat = |l: Vec<Vec<f32>>| l.concat();
    let bf16 = max_abs_diff(&flat(full_logits(&served_bf16, &seq)), &flat(want.clone()));
    assert!(bf16 < 0.05, "bf16 weights of the same values: {bf16}");
    for (_, var) in policy.parameters() {
        var.set(&(var.as_tensor() + 1.0).unwrap()).unwrap();
    }
    assert_eq!(full_logits(&served, &seq), want, "the engine's weights are its own");
    let again = Model::from_snapshot(policy.config().clone(), &snap, engine, false).unwrap();
    assert_eq!(full_logits(&again, &seq), want, "the snapshot is its own");
    let (name, var) = policy.parameters().into_iter().nth(2).unwrap();
    let mut values = var.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    values[11] = f32::NAN;
    var.set(&Tensor::from_slice(&values, var.dims(), trainer).unwrap()).unwrap();
    let e =
        served.load_snapshot(&policy.snapshot_resident(PolicyVersion(2)).unwrap()).unwrap_err().to_string();
    assert!(e.contains(&format!("`{name}`")) && e.contains("element 11 is not finite"), "{e}");
    assert_eq!(full_logits(&served, &seq), want, "a refused snapshot changes nothing");
}

#[test]
fn cuda_fused_kernels_are_refused_off_the_cpu() {
    let Some(gpu) = cuda() else { return };
    let model = Model::new(ModelConfig::tiny(), &gpu, 1).unwrap();
    assert_eq!(model.kernels(), Kernels::Cuda);
    let e = model.with_kernels(Kernels::Fused).unwrap_err().to_string();
    assert!(e.contains("CPU only"), "{e}");
}

#[test]
fn portable_kernels_match_transformers_fixtures() {
    for name in ["tiny_llama", "tiny_qwen2"] {
        logits_equal_transformers(&portable(cpu_fixture(name)), name);
    }
}

#[test]
fn portable_kernels_give_every_parameter_a_gradient() {
    every_parameter_gets_a_gradient(&portable(Model::new(ModelConfig::tiny(), &Device::Cpu, 11).unwrap()));
    every_parameter_gets_a_gradient(&portable(cpu_fixture("tiny_qwen2")));
}

#[test]
fn portable_kernels_pack_shared_prompts_like_separate_rows() {
    shared_prompt_equals_separate_rows(&portable(cpu_fixture("tiny_llama")));
}

#[test]
fn portable_decode_equals_full_forward() {
    decode_matches_full_forward(&portable(Model::new(ModelConfig::tiny(), &Device::Cpu, 7).unwrap()), 1e-5);
    decode_matches_full_forward(&portable(cpu_fixture("tiny_qwen2")), 1e-5);
    // A frozen copy keeps the portable kernels, and decodes from stacked products.
    let frozen = portable(cpu_fixture("tiny_llama")).frozen_copy().unwrap();
    assert_eq!(frozen.kernels(), Kernels::Portable);
    decode_matches_full_forward(&frozen, 1e-5);
}

/// A batch of rows of unequal lengths, one of them a shared-prompt tree of three
/// responses, for [`batched_attention_equals_per_segment`].
fn mixed_rows(vocab: usize) -> (Vec<metronome_core::PackedRow>, Targets) {
    let responses = [tokens(32, 5, vocab), tokens(33, 2, vocab), tokens(34, 6, vocab)];
    let batch = metronome_testkit::BatchBuilder::new()
        .shared_prompt(0, &tokens(31, 7, vocab), &responses, &[0.0; 3])
        .separate_rows(1, &tokens(35, 3, vocab), &[tokens(36, 4, vocab), tokens(37, 9, vocab)], &[0.0; 2])
        .build();
    (batch.rows, batch.targets)
}

/// `model`'s training step with the rows attended whole (padded to the longest, under
/// their masks) equals the per-segment one, plain and with checkpointed layers:
/// log-probs and entropies within `tol.0`, gradients within `tol.1`; the batch counts
/// its rows' positions, not the padding.
fn batched_attention_equals_per_segment(model: &Model, tol: (f32, f32)) {
    use crate::common::logprobs_and_gradients_on;
    let (rows, targets) = mixed_rows(model.config().vocab_size);
    let real: usize = rows.iter().map(metronome_core::PackedRow::len).sum();
    for checkpoint in [false, true] {
        let run = |batched: bool| {
            let m = model.clone().with_batched_attention(batched).with_gradient_checkpointing(checkpoint);
            assert_eq!(m.prepare_batch(&rows, &targets).unwrap().num_positions(), real);
            logprobs_and_gradients_on(&m, m.parameters(), &rows, &targets)
        };
        let ((lp, h, g), (lp0, h0, g0)) = (run(true), run(false));
        let what = |x: &str| format!("{x}, checkpointing {checkpoint}");
        close(&what("log-probs"), &lp, &lp0, tol.0);
        close(&what("entropies"), &h, &h0, tol.0);
        for ((name, a), (_, b)) in g.iter().zip(&g0) {
            close(&what(name), a, b, tol.1);
        }
    }
}

#[test]
fn portable_batched_attention_equals_per_segment() {
    let exact = (1e-5, 1e-4);
    batched_attention_equals_per_segment(
        &portable(Model::new(ModelConfig::tiny(), &Device::Cpu, 13).unwrap()),
        exact,
    );
    batched_attention_equals_per_segment(&portable(cpu_fixture("tiny_qwen2")), exact);
    batched_attention_equals_per_segment(&cpu_fixture("tiny_llama"), exact);
}

#[test]
fn cuda_batched_attention_equals_per_segment() {
    let Some(gpu) = cuda() else { return };
    let model = Model::load_hf(&fixture("tiny_qwen2"), &gpu).unwrap();
    batched_attention_equals_per_segment(&model, (1e-5, 1e-4));
    // In bf16 the two layouts' products round differently (other shapes, other cuBLAS
    // algorithms): a loose bound that catches a wrong mask or row, not rounding.
    batched_attention_equals_per_segment(
        &model.compute_copy(metronome_model::DType::BF16).unwrap(),
        (5e-2, 1e-1),
    );
}

/// The training forward and backward of `other` equal the fused CPU kernels' on the
/// same weights: log-probs and entropies within 1e-5, gradients within 1e-4 of their
/// largest magnitude.
fn training_matches_fused_cpu(other: &Model, reference: &Model) {
    let (lp, h, g) = logprobs_and_gradients(other);
    let (lp0, h0, g0) = logprobs_and_gradients(reference);
    close("log-probs", &lp, &lp0, 1e-5);
    close("entropies", &h, &h0, 1e-5);
    for ((name, a), (_, b)) in g.iter().zip(&g0) {
        close(name, a, b, 1e-4);
    }
}

#[test]
fn portable_training_matches_fused_values_and_gradients() {
    for name in ["tiny_llama", "tiny_qwen2"] {
        training_matches_fused_cpu(&portable(cpu_fixture(name)), &cpu_fixture(name));
    }
}

#[test]
fn cuda_logits_equal_transformers() {
    let Some(gpu) = cuda() else { return };
    for name in ["tiny_llama", "tiny_qwen2"] {
        logits_equal_transformers(&Model::load_hf(&fixture(name), &gpu).unwrap(), name);
    }
}

#[test]
fn cuda_training_matches_cpu_values_and_gradients() {
    let Some(gpu) = cuda() else { return };
    for name in ["tiny_llama", "tiny_qwen2"] {
        training_matches_fused_cpu(&Model::load_hf(&fixture(name), &gpu).unwrap(), &cpu_fixture(name));
    }
}

#[test]
fn cuda_every_parameter_gets_a_finite_nonzero_gradient() {
    let Some(gpu) = cuda() else { return };
    every_parameter_gets_a_gradient(&Model::new(ModelConfig::tiny(), &gpu, 11).unwrap());
    every_parameter_gets_a_gradient(&Model::load_hf(&fixture("tiny_qwen2"), &gpu).unwrap());
}

#[test]
fn cuda_shared_prompt_equals_separate_rows() {
    let Some(gpu) = cuda() else { return };
    shared_prompt_equals_separate_rows(&Model::load_hf(&fixture("tiny_llama"), &gpu).unwrap());
}

#[test]
fn cuda_decode_equals_full_forward() {
    let Some(gpu) = cuda() else { return };
    decode_matches_full_forward(&Model::new(ModelConfig::tiny(), &gpu, 7).unwrap(), 1e-5);
    decode_matches_full_forward(
        &Model::load_hf(&fixture("tiny_qwen2"), &gpu).unwrap().frozen_copy().unwrap(),
        1e-5,
    );
}

/// The CUDA decode kernels through block tables: one block per slot, blocks of 16 and
/// of 3 positions give bitwise the same logits (f32 and a bf16 compute copy).
#[test]
fn cuda_paged_cache_decodes_as_contiguous() {
    let Some(gpu) = cuda() else { return };
    let model = Model::load_hf(&fixture("tiny_llama"), &gpu).unwrap().frozen_copy().unwrap();
    assert_eq!(model.kernels(), Kernels::Cuda);
    paged_equals_contiguous(&model);
    paged_equals_contiguous(&model.compute_copy(metronome_model::DType::BF16).unwrap());
}

#[test]
fn cuda_decode_is_reproducible_and_near_batch_invariant() {
    let Some(gpu) = cuda() else { return };
    let model = Model::load_hf(&fixture("tiny_llama"), &gpu).unwrap().frozen_copy().unwrap();
    let vocab = model.config().vocab_size;
    let run = |batch: &[usize]| {
        let mut cache = metronome_model::KvCache::new(&model, 16, 32).unwrap();
        for &s in batch {
            model.prefill(&mut cache, s, &tokens(s as u64, 2 + s % 5, vocab)).unwrap();
        }
        let step: Vec<(usize, u32)> =
            batch.iter().map(|&s| (s, tokens(50 + s as u64, 1, vocab)[0])).collect();
        let out = model.decode_step(&mut cache, &step).unwrap();
        out[batch.iter().position(|&s| s == 3).unwrap()].clone()
    };
    let alone = run(&[3]);
    // The same batch twice: bitwise the same (no atomics, no nondeterministic algorithm).
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&run(&[0, 3, 9, 12])), bits(&run(&[0, 3, 9, 12])));
    // Other batches: within 1e-5 (cuBLAS may pick another algorithm for another M).
    let d = max_abs_diff(&alone, &run(&[0, 3, 9, 12, 1, 2, 4, 5, 6, 7, 8, 10, 11, 13, 14, 15]));
    eprintln!("slot 3 alone vs in a batch of 16: max |diff| = {d:e}");
    assert!(d < 1e-5, "{d}");
}

/// Decode steps of `model` (frozen, not shared with another run: it takes new weights)
/// with CUDA graphs `on` or off: three slots for four steps, `other`'s weights
/// installed, four more steps, then two slots for three steps (another row count). The
/// logits of every step, and what the graphs did.
fn decode_with_graphs(
    model: &Model,
    other: &Model,
    on: bool,
) -> (Vec<Vec<Vec<f32>>>, metronome_model::DecodeGraphStats) {
    let vocab = model.config().vocab_size;
    let mut cache = metronome_model::KvCache::new(model, 4, 40).unwrap();
    cache.set_cuda_graphs(on);
    for s in 0..3 {
        model.prefill(&mut cache, s, &tokens(70 + s as u64, 3 + 2 * s, vocab)).unwrap();
    }
    let mut steps = Vec::new();
    for t in 0..11u64 {
        if t == 4 {
            model.load_snapshot(&other.snapshot(metronome_core::PolicyVersion(1)).unwrap()).unwrap();
        }
        let slots: &[usize] = if t < 8 { &[0, 1, 2] } else { &[0, 2] };
        let batch: Vec<(usize, u32)> =
            slots.iter().map(|&s| (s, tokens(90 + t * 7 + s as u64, 1, vocab)[0])).collect();
        steps.push(model.decode_step(&mut cache, &batch).unwrap());
    }
    (steps, cache.decode_graphs())
}

/// Decode steps replayed as CUDA graphs compute bitwise what the same steps compute op
/// by op, in f32 and bf16, with and without biases (the tiny shape, whose heads of 32
/// the CUDA attention kernel takes: the fixtures' heads of 8 run the portable attention,
/// which graphs are not used with), across an installed snapshot (written over the
/// stacked weights in place, so the graphs stay and read the new weights) and a change
/// of row count; and they did run as graphs (one capture per row count, every other
/// step replayed, no failed capture).
#[test]
fn cuda_decode_graphs_replay_what_steps_compute_op_by_op() {
    let Some(gpu) = cuda() else { return };
    for architecture in [metronome_model::Architecture::Llama, metronome_model::Architecture::Qwen2] {
        let cfg = ModelConfig { architecture, ..ModelConfig::tiny() };
        let base = Model::new(cfg.clone(), &gpu, 5).unwrap();
        let other = Model::new(cfg, &gpu, 11).unwrap();
        // Biases that are not zero, so that adding them shows.
        for model in [&base, &other] {
            for (name, var) in model.parameters() {
                if name.ends_with("bias") {
                    var.set(&var.as_tensor().randn_like(0.0, 0.5).unwrap()).unwrap();
                }
            }
        }
        for dtype in [metronome_model::DType::F32, metronome_model::DType::BF16] {
            // A fresh frozen engine model for each run, in the run's type.
            let engine = || base.frozen_copy().unwrap().compute_copy(dtype).unwrap();
            let (eager, none) = decode_with_graphs(&engine(), &other, false);
            assert_eq!(none, metronome_model::DecodeGraphStats::default());
            let (graphed, stats) = decode_with_graphs(&engine(), &other, true);
            let flat = |s: &[Vec<Vec<f32>>]| -> Vec<f32> { s.iter().flatten().flatten().copied().collect() };
            let d = max_abs_diff(&flat(&graphed), &flat(&eager));
            eprintln!("{architecture:?} {dtype:?}: {stats:?}, max |graphed - op by op| = {d:e}");
            let bits = |s: &[Vec<Vec<f32>>]| -> Vec<u32> {
                s.iter().flatten().flatten().map(|x| x.to_bits()).collect()
            };
            assert_eq!(bits(&graphed), bits(&eager), "{architecture:?} {dtype:?}");
            // Three rows: op by op, captured, then replayed, also after the install; two
            // rows: op by op, captured, replayed.
            assert_eq!((stats.captured, stats.replayed, stats.failed), (2, 9, 0), "{stats:?}");
        }
    }
}

/// Off a GPU the switch changes nothing: the same logits, and no graph.
#[test]
fn graphs_switched_on_change_nothing_off_a_gpu() {
    let base = portable(cpu_fixture("tiny_qwen2"));
    let other = Model::new(base.config().clone(), &Device::Cpu, 11).unwrap();
    let (eager, _) = decode_with_graphs(&base.frozen_copy().unwrap(), &other, false);
    let (on, stats) = decode_with_graphs(&base.frozen_copy().unwrap(), &other, true);
    assert_eq!(on, eager);
    assert_eq!(stats, metronome_model::DecodeGraphStats::default());
}

/// This crate's CUDA kernels for RMSNorm, SwiGLU and rotary embeddings (`kernels/layer.cu`, the default
/// `Kernels::Cuda` on a GPU) against the portable forms on the same GPU weights: a
/// training step's log-probs and entropies within 1e-5, gradients within 1e-4, and a
/// frozen copy's decode steps (which run them too) within 1e-5 of its full forward.
/// bf16 is held by `cuda_bf16_compute_tracks_the_cpu_f32_step`, which runs them.
#[test]
fn cuda_kernels_match_the_portable_forms() {
    let Some(gpu) = cuda() else { return };
    for name in ["tiny_llama", "tiny_qwen2"] {
        let model = Model::load_hf(&fixture(name), &gpu).unwrap();
        assert_eq!(model.kernels(), Kernels::Cuda);
        training_matches_fused_cpu(&model, &portable(model.clone()));
        let frozen = model.frozen_copy().unwrap();
        assert_eq!(frozen.kernels(), Kernels::Cuda);
        decode_matches_full_forward(&frozen, 1e-5);
    }
}

/// The masked-softmax kernel over segments longer than its block (the tiny fixtures'
/// rows fit in one pass of its threads): a shared prompt of 300 tokens and responses of
/// 400, 250 and 5, so keys run to 700 per query. In f32 the training step's values and
/// gradients equal the portable form's (1e-5, 1e-4); in bf16 they stay within a loose
/// bound of it (the backward reads the probabilities as saved, in bf16, where the
/// composed form keeps them in f32), which catches a wrong row or mask, not rounding.
#[test]
fn cuda_kernel_masked_softmax_over_long_segments_matches_the_portable_form() {
    use crate::common::shared_prompt_row;
    let Some(gpu) = cuda() else { return };
    let model = Model::new(ModelConfig::tiny(), &gpu, 5).unwrap();
    let vocab = model.config().vocab_size;
    let (row, targets) = shared_prompt_row(
        &tokens(21, 300, vocab),
        &[tokens(22, 400, vocab), tokens(23, 250, vocab), tokens(24, 5, vocab)],
    );
    kernel_step_matches_portable(&model, &row, &targets, |_, _, _, _| {});
}

/// The flash attention kernels (`kernels/attention.cu`), which attend rows per segment
/// on a GPU (`with_batched_attention(false)`), against the portable forms: segments
/// longer than a tile and not a multiple of one (a shared prompt of 300 tokens with
/// responses of 400, 250 and 5: keys to 700 per query, seen by four segments), with
/// grouped-query heads, at head dimensions for each of the kernels' lane shares (32,
/// 64, 128), f32 and bf16 within the bounds of the other kernel tests. Their logic is
/// also checked without a GPU (`kernels_on_cpu.rs`).
#[test]
fn cuda_kernel_flash_attention_matches_the_portable_form() {
    use crate::common::shared_prompt_row;
    let Some(gpu) = cuda() else { return };
    for head_dim in [32, 64, 128] {
        let cfg = ModelConfig { hidden_size: 4 * head_dim, head_dim, ..ModelConfig::tiny() };
        let model = Model::new(cfg, &gpu, 17).unwrap().with_batched_attention(false);
        let vocab = model.config().vocab_size;
        let (row, targets) = shared_prompt_row(
            &tokens(71, 300, vocab),
            &[tokens(72, 400, vocab), tokens(73, 250, vocab), tokens(74, 5, vocab)],
        );
        kernel_step_matches_portable(&model, &row, &targets, |_, _, _, _| {});
    }
}

/// The chunked head's kernels (`logprob_stats`, `logprob_columns_grad` in
/// `kernels/layer.cu`) against the portable forms, through a model of 3,001 tokens
/// (more than a block's threads per row, not a multiple of them) whose head runs
/// several chunks of rows and blocks of columns: in f32 the training step's values and
/// gradients within 1e-5 and 1e-4 (the portable step's own bound against the fused CPU
/// one), and values at temperature 0.7; in bf16 the loose bound of the other bf16
/// kernel tests, which catches a wrong row, column or target, not rounding.
#[test]
fn cuda_kernel_head_chunk_matches_the_portable_form() {
    use crate::common::shared_prompt_row;
    let Some(gpu) = cuda() else { return };
    let cfg = ModelConfig { vocab_size: 3001, ..ModelConfig::tiny() };
    let model = Model::new(cfg, &gpu, 9).unwrap().with_chunked_head(Some(3001 * 5));
    let (row, targets) = shared_prompt_row(
        &tokens(61, 9, 3001),
        &[tokens(62, 12, 3001), tokens(63, 7, 3001), tokens(64, 3, 3001)],
    );
    kernel_step_matches_portable(&model, &row, &targets, |precision, model, reference, tol| {
        let at = |m: &Model| {
            let out = m.score(&m.prepare_batch(std::slice::from_ref(&row), &targets).unwrap(), 0.7).unwrap();
            let v = |t: &metronome_model::Tensor| {
                t.to_dtype(metronome_model::DType::F32).unwrap().to_vec1::<f32>().unwrap()
            };
            (v(&out.logprobs), v(&out.entropy))
        };
        let ((lp, h), (lp0, h0)) = (at(model), at(reference));
        close(&format!("{precision} log-probs at T 0.7"), &lp, &lp0, tol);
        close(&format!("{precision} entropies at T 0.7"), &h, &h0, tol);
    });
}

/// `model`'s training step on `row` under its CUDA kernels against the portable forms'
/// on the same weights: in f32 values within 1e-5 and gradients within 1e-4; in a bf16
/// compute copy within 5e-2 and 1e-1, a loose bound that catches a wrong row, mask,
/// column or target, not rounding. `also(precision, model, reference, value
/// tolerance)` adds a test's own checks at each precision.
fn kernel_step_matches_portable(
    model: &Model,
    row: &metronome_core::PackedRow,
    targets: &Targets,
    also: impl Fn(&str, &Model, &Model, f32),
) {
    use crate::common::logprobs_and_gradients_on;
    for (precision, model, tol) in [
        ("f32", model.clone(), (1e-5, 1e-4)),
        ("bf16", model.compute_copy(metronome_model::DType::BF16).unwrap(), (5e-2, 1e-1)),
    ] {
        assert_eq!(model.kernels(), Kernels::Cuda);
        let reference = portable(model.clone());
        let on = |m: &Model| logprobs_and_gradients_on(m, m.parameters(), std::slice::from_ref(row), targets);
        let ((lp, h, g), (lp0, h0, g0)) = (on(&model), on(&reference));
        close(&format!("{precision} log-probs"), &lp, &lp0, tol.0);
        close(&format!("{precision} entropies"), &h, &h0, tol.0);
        for ((name, a), (_, b)) in g.iter().zip(&g0) {
            close(&format!("{precision} {name}"), a, b, tol.1);
        }
        also(precision, &model, &reference, tol.0);
    }
}

/// The draw kernels (`kernels/draw.cu`: plain and truncated, on penalised rows, with raw
/// log-probs, as `draws_for` varies them) against their host reference on the same logits,
/// f32 and bf16, at vocabulary sizes from the tiny model's to Qwen2's (one run or many
/// per thread of its block), with the edge rows of `draw_logits`; then through a
/// model's decode steps. Tokens must be identical (they differ only where `u · total`
/// falls within f64 rounding of a boundary), log-probs within 1e-6.
#[test]
fn cuda_kernel_draws_what_the_host_draws() {
    use metronome_model::{DType, Next};
    let Some(gpu) = cuda() else { return };
    let (mut same, mut drawn, mut bitwise) = (0, 0, 0);
    for vocab in [99, 1025, 49_152, 151_936] {
        let draws = draws_for(64);
        for dtype in [DType::F32, DType::BF16] {
            let logits = draw_logits(64, vocab, &gpu).to_dtype(dtype).unwrap();
            let device = Kernels::Cuda.next_rows(&logits, &draws).unwrap();
            let host = Kernels::Portable.next_rows(&logits, &draws).unwrap();
            for (r, (d, h)) in device.iter().zip(&host).enumerate() {
                match (d, h) {
                    (Next::Drawn(d), Next::Drawn(h)) => {
                        drawn += 1;
                        same += usize::from(d.token == h.token);
                        bitwise += usize::from(d.logprob.to_bits() == h.logprob.to_bits());
                        let diff = (d.logprob - h.logprob).abs();
                        assert!(
                            d.token != h.token || diff <= 1e-6 * h.logprob.abs().max(1.0),
                            "vocab {vocab} {dtype:?} row {r}: log-prob {} vs {}",
                            d.logprob,
                            h.logprob
                        );
                    }
                    (Next::Logits(d), Next::Logits(h)) => {
                        assert_eq!(d.len(), h.len());
                        assert!(d.iter().zip(h).all(|(a, b)| a.to_bits() == b.to_bits()), "row {r}'s logits");
                    }
                    (d, h) => panic!("vocab {vocab} {dtype:?} row {r}: device {d:?}, host {h:?}"),
                }
            }
        }
    }
    eprintln!("draw kernel vs host: {same} of {drawn} tokens identical, {bitwise} log-probs bitwise equal");
    assert_eq!(same, drawn, "tokens drawn on the GPU differ from the host's on the same logits");
    let model = Model::load_hf(&fixture("tiny_llama"), &gpu).unwrap().frozen_copy().unwrap();
    assert_eq!(model.kernels(), Kernels::Cuda);
    let (bitwise, total) = drawing_matches_the_host_reference(&model, 1e-6);
    eprintln!("decode steps on the GPU: {bitwise} of {total} drawn log-probs bitwise equal to the host's");
}

#[test]
fn cuda_checkpoints_round_trip_bit_exact() {
    let Some(gpu) = cuda() else { return };
    let model = Model::load_hf(&fixture("tiny_qwen2"), &gpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model.save_hf(dir.path()).unwrap();
    let again = Model::load_hf(dir.path(), &Device::Cpu).unwrap();
    let cpu = cpu_fixture("tiny_qwen2");
    for ((name, a), (_, b)) in again.parameters().iter().zip(cpu.parameters()) {
        let h = |v: &metronome_model::Var| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(h(a), h(&b), "{name}");
    }
    // A snapshot (device to host) and back onto the GPU keeps the logits.
    let snap = model.snapshot(metronome_core::PolicyVersion(3)).unwrap();
    let back = Model::from_snapshot(model.config().clone(), &snap, &gpu, false).unwrap();
    let seq = tokens(5, 9, model.config().vocab_size);
    let (a, b) = (full_logits(&model, &seq), full_logits(&back, &seq));
    assert_eq!(a, b);
}

#[test]
fn cuda_training_step_moves_only_the_device_weights() {
    // A gradient step on the GPU raises the targets' log-probs, as on the CPU.
    let Some(gpu) = cuda() else { return };
    let model = Model::load_hf(&fixture("tiny_llama"), &gpu).unwrap();
    let seq = tokens(4, 8, 96);
    let (rows, targets): (_, Targets) = separate_rows(&seq[..3], &[seq[3..].to_vec()]);
    let (before, after) = logprob_around_sgd(&model, &rows, &targets, 3);
    assert!(after > before + 0.01, "{before} -> {after}");
}

#[test]
fn cuda_bf16_compute_tracks_the_cpu_f32_step() {
    // The tolerances measured on the CPU's bf16 (tests `precision`), on the GPU's.
    use crate::precision::{Gap, assert_within_bf16_tolerances, small_llama};
    let Some(gpu) = cuda() else { return };
    let cases = [
        (
            "tiny_qwen2 fixture",
            Model::load_hf(&fixture("tiny_qwen2"), &gpu).unwrap(),
            cpu_fixture("tiny_qwen2"),
        ),
        (
            "small llama",
            Model::new(small_llama(), &gpu, 4).unwrap(),
            Model::new(small_llama(), &Device::Cpu, 4).unwrap(),
        ),
    ];
    for (name, model, cpu) in cases {
        let reference = logprobs_and_gradients(&cpu);
        let bf16 = model.compute_copy(metronome_model::DType::BF16).unwrap();
        assert_within_bf16_tolerances(
            &format!("GPU {name}"),
            Gap::between(&logprobs_and_gradients(&bf16), &reference),
        );
        let vocab = model.config().vocab_size;
        let levers = bf16.with_chunked_head(Some(3 * vocab)).with_gradient_checkpointing(true);
        let gap = Gap::between(&logprobs_and_gradients(&levers), &reference);
        assert_within_bf16_tolerances(&format!("GPU {name}, chunked head and checkpointing"), gap);
    }
}

#[test]
fn cuda_chunked_head_and_checkpointing_match_the_plain_step() {
    let Some(gpu) = cuda() else { return };
    for name in ["tiny_llama", "tiny_qwen2"] {
        let model = Model::load_hf(&fixture(name), &gpu).unwrap();
        let plain = logprobs_and_gradients(&model);
        for (what, levered, tol) in [
            ("chunked head", model.clone().with_chunked_head(Some(300)), (1e-5, 1e-4)),
            (
                "GPU chunk budget",
                model.clone().with_chunked_head(Some(model.default_head_chunk())),
                (1e-5, 1e-4),
            ),
            ("checkpointing", model.clone().with_gradient_checkpointing(true), (1e-6, 1e-6)),
        ] {
            let (lp, h, g) = logprobs_and_gradients(&levered);
            close(&format!("{name}, {what}: log-probs"), &lp, &plain.0, tol.0);
            close(&format!("{name}, {what}: entropies"), &h, &plain.1, tol.0);
            for ((n, a), (_, b)) in g.iter().zip(&plain.2) {
                close(&format!("{name}, {what}: {n}"), a, b, tol.1);
            }
        }
    }
}
