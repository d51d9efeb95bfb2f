//! The workspace's third change to candle (`vendor/candle-core/PATCH.md`): the CPU
//! matmul no longer zero-fills its output before gemm writes it. What the change must
//! keep: every element of the result is written, whatever path gemm takes (an empty
//! inner dimension, a batch whose right operand is shared and folds into one product,
//! batches with operands of their own, transposed operands, a single row or column).
//! Each case runs after a same-sized buffer of NaNs was freed, so a recycled allocation
//! shows through any element left unwritten, and is compared with a plain triple loop.
//!
//! And the workspace's change to gemm-common (`vendor/gemm-common/PATCH.md`): a product
//! packs its operands into a buffer its thread lends from one call to the next, with its
//! "row block packed" flags on the stack, so a product allocates only its result; the
//! buffer, left longer or shorter by the last product, still gives the right answers.

use candle_core::{Device, Tensor};

/// `[b, m, k] x [b, k, n]` (or `[k, n]` shared by the batch) by definition.
fn naive(a: &[f32], b: &[f32], (batch, m, k, n): (usize, usize, usize, usize), shared_rhs: bool) -> Vec<f32> {
    let mut out = Vec::with_capacity(batch * m * n);
    for s in 0..batch {
        let rhs = if shared_rhs { 0 } else { s * k * n };
        for i in 0..m {
            for j in 0..n {
                out.push((0..k).map(|p| a[s * m * k + i * k + p] * b[rhs + p * n + j]).sum());
            }
        }
    }
    out
}

fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len).map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 17) as f32 / 8.0 - 1.0).collect()
}

/// Frees a buffer of NaNs the size of the product's output, for the allocator to hand back.
fn poison(len: usize) {
    let nans = Tensor::from_vec(vec![f32::NAN; len], len, &Device::Cpu).unwrap();
    drop(std::hint::black_box(nans));
}

fn check(dims: (usize, usize, usize, usize), shared_rhs: bool, transposed: bool) {
    let (batch, m, k, n) = dims;
    let (a, b) = (values(batch * m * k, 1), values(if shared_rhs { k * n } else { batch * k * n }, 2));
    let lhs = Tensor::from_vec(a.clone(), (batch, m, k), &Device::Cpu).unwrap();
    let rhs = if shared_rhs {
        Tensor::from_vec(b.clone(), (k, n), &Device::Cpu).unwrap().broadcast_as((batch, k, n)).unwrap()
    } else {
        Tensor::from_vec(b.clone(), (batch, k, n), &Device::Cpu).unwrap()
    };
    // The same right operand, stored transposed and read through a strided view.
    let rhs = if transposed {
        rhs.transpose(1, 2).unwrap().contiguous().unwrap().transpose(1, 2).unwrap()
    } else {
        rhs
    };
    poison(batch * m * n);
    let got: Vec<f32> = lhs.matmul(&rhs).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let want = naive(&a, &b, dims, shared_rhs);
    assert_eq!(got.len(), want.len(), "{dims:?}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
            "{dims:?} shared {shared_rhs} transposed {transposed}: element {i} is {g}, not {w}"
        );
    }
}

#[test]
fn every_element_of_a_product_is_written() {
    for dims in [(3, 37, 29, 41), (2, 5, 0, 7), (4, 1, 16, 33), (2, 33, 16, 1), (1, 8, 8, 8), (5, 64, 3, 70)]
    {
        for shared_rhs in [false, true] {
            for transposed in [false, true] {
                check(dims, shared_rhs, transposed);
            }
        }
    }
}

#[test]
fn a_product_allocates_only_its_result_and_reuses_the_packing_buffer_of_the_last() {
    // Large enough that gemm packs the right operand and prepacks the left one.
    let (m, k, n) = (256, 96, 128);
    let lhs = Tensor::from_vec(values(m * k, 3), (m, k), &Device::Cpu).unwrap();
    let rhs = Tensor::from_vec(values(k * n, 4), (k, n), &Device::Cpu).unwrap();
    let rhs = rhs.t().unwrap().contiguous().unwrap().t().unwrap();
    // Two products first: after some sequences of other tests in this binary the first
    // product after the first one allocated once more (4, then 3 for every product
    // after it, with `--test-threads=1` over the checkpoint, decode, devices, gguf and
    // lora tests), a one-time cost of its thread that this test is not about.
    for _ in 0..2 {
        drop(lhs.matmul(&rhs).unwrap());
    }
    let count = allocation_counter::measure(|| drop(lhs.matmul(&rhs).unwrap())).count_total;
    // The result's elements, its storage's lock and the tensor; before the change also
    // the packing buffer and the flags (5).
    assert_eq!(count, 3);
}

#[test]
fn products_that_pack_are_right_whatever_the_last_product_left_in_the_buffer() {
    // Packing needs that grow, shrink and grow again on one thread.
    for dims in [(1, 300, 64, 96), (1, 70, 8, 9), (2, 520, 130, 200), (1, 129, 33, 65), (1, 300, 64, 96)] {
        for transposed in [false, true] {
            check(dims, false, transposed);
        }
    }
}
