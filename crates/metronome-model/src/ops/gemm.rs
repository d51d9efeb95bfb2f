//! Matrix products on strided blocks of host slices, for the fused CPU ops that
//! multiply parts of their operands in place (candle's `matmul` takes whole tensors,
//! so a block would first be copied out). The product is `gemm`'s, the crate candle's
//! CPU matmul calls, whose raw-pointer API this wraps behind bounds checks.

/// A strided `rows × cols` block of a slice: element `(i, j)` at `offset + i·rs + j·cs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub(crate) offset: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

impl Block {
    /// `rows × cols` rows of `rs` elements from `offset`, contiguous in a row.
    pub(crate) fn rows(offset: usize, rows: usize, cols: usize, rs: usize) -> Self {
        Self { offset, rows, cols, rs, cs: 1 }
    }

    /// The transpose: the same elements, `(j, i)` for `(i, j)`.
    pub(crate) fn t(self) -> Self {
        Self { rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs, ..self }
    }

    /// One past the last element the block reaches (0 when it is empty).
    fn end(self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            self.offset + (self.rows - 1) * self.rs + (self.cols - 1) * self.cs + 1
        }
    }
}

/// `dst ← (dst if accumulate) + scale · lhs · rhs` on one thread, for blocks of `f32`
/// slices. Panics when the shapes do not chain or a block reaches past its slice (the
/// callers derive both from tensors they checked, so either is a bug here), or when
/// `dst`'s rows overlap each other.
#[allow(clippy::too_many_arguments, reason = "three blocks of three slices, as a BLAS call takes them")]
pub(crate) fn matmul(
    dst: &mut [f32],
    d: Block,
    accumulate: bool,
    lhs: &[f32],
    a: Block,
    rhs: &[f32],
    b: Block,
    scale: f32,
) {
    product(dst, d, accumulate, (lhs, a), (rhs, b), scale, gemm::Parallelism::None);
}

/// [`matmul`] split over the threads of the current rayon pool, as candle's CPU matmul
/// splits its products (the same kernels on the same blocks: each element's sum runs in
/// the same order whatever the split).
#[allow(clippy::too_many_arguments, reason = "three blocks of three slices, as a BLAS call takes them")]
pub(crate) fn matmul_parallel(
    dst: &mut [f32],
    d: Block,
    accumulate: bool,
    lhs: &[f32],
    a: Block,
    rhs: &[f32],
    b: Block,
    scale: f32,
) {
    let threads = match rayon::current_num_threads() {
        1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    };
    product(dst, d, accumulate, (lhs, a), (rhs, b), scale, threads);
}

#[allow(unsafe_code, reason = "gemm's product takes raw pointers and strides; the checks here bound them")]
fn product(
    dst: &mut [f32],
    d: Block,
    accumulate: bool,
    (lhs, a): (&[f32], Block),
    (rhs, b): (&[f32], Block),
    scale: f32,
    parallelism: gemm::Parallelism,
) {
    assert!(
        d.rows == a.rows && d.cols == b.cols && a.cols == b.rows,
        "matmul: {a:?} · {b:?} does not make {d:?}"
    );
    assert!(
        d.end() <= dst.len() && a.end() <= lhs.len() && b.end() <= rhs.len(),
        "matmul: a block reaches past its slice ({d:?} of {}, {a:?} of {}, {b:?} of {})",
        dst.len(),
        lhs.len(),
        rhs.len()
    );
    // Distinct (i, j) must be distinct elements of `dst`: rows of contiguous elements
    // that do not overlap.
    assert!(d.rows <= 1 || (d.cs == 1 && d.rs >= d.cols), "matmul: the destination {d:?} overlaps itself");
    if d.rows == 0 || d.cols == 0 {
        return;
    }
    if a.cols == 0 {
        if !accumulate {
            for i in 0..d.rows {
                dst[d.offset + i * d.rs..][..d.cols].fill(0.0);
            }
        }
        return;
    }
    let stride = |s: usize| isize::try_from(s).expect("a stride that fits a slice fits isize");
    // SAFETY: every element the product reads (`a` in `lhs`, `b` in `rhs`) or writes
    // (`d` in `dst`) lies inside its slice, by the bounds asserted above; `dst` is
    // borrowed mutably, so it aliases neither input, and its elements are distinct, so
    // no element is written twice (gemm's threads, with `Parallelism::Rayon`, write
    // disjoint blocks of it, and the borrows outlive the call, which joins them).
    unsafe {
        gemm::gemm(
            d.rows,
            d.cols,
            a.cols,
            dst.as_mut_ptr().add(d.offset),
            stride(d.cs),
            stride(d.rs),
            accumulate,
            lhs.as_ptr().add(a.offset),
            stride(a.cs),
            stride(a.rs),
            rhs.as_ptr().add(b.offset),
            stride(b.cs),
            stride(b.rs),
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(clippy::too_many_arguments, reason = "the arguments of `matmul`, to compare with it")]
    fn naive(d: &mut [f32], db: Block, acc: bool, l: &[f32], a: Block, r: &[f32], b: Block, s: f32) {
        for i in 0..db.rows {
            for j in 0..db.cols {
                let dot: f32 = (0..a.cols)
                    .map(|k| l[a.offset + i * a.rs + k * a.cs] * r[b.offset + k * b.rs + j * b.cs])
                    .sum();
                let o = &mut d[db.offset + i * db.rs + j * db.cs];
                *o = if acc { *o + s * dot } else { s * dot };
            }
        }
    }

    #[test]
    fn strided_and_transposed_blocks_multiply_as_the_naive_product() {
        let l: Vec<f32> = (0..200).map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0).collect();
        let r: Vec<f32> = (0..200).map(|i| ((i * 11 % 13) as f32 - 6.0) / 6.0).collect();
        // A 3x4 block inside rows of 10, times the transpose of a 5x4 block in rows of 7,
        // into a 3x5 block of rows of 6 at offset 2, overwritten then accumulated.
        let a = Block::rows(3, 3, 4, 10);
        let b = Block::rows(1, 5, 4, 7).t();
        let d = Block::rows(2, 3, 5, 6);
        for acc in [false, true] {
            let mut got: Vec<f32> = (0..20).map(|i| i as f32).collect();
            let mut want = got.clone();
            matmul(&mut got, d, acc, &l, a, &r, b, 0.5);
            naive(&mut want, d, acc, &l, a, &r, b, 0.5);
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "{g} vs {w}");
            }
        }
        // An empty inner dimension writes zeros, or leaves an accumulated block alone.
        let mut z = vec![1.0f32; 6];
        matmul(
            &mut z,
            Block::rows(0, 2, 3, 3),
            true,
            &l,
            Block::rows(0, 2, 0, 1),
            &r,
            Block::rows(0, 0, 3, 3),
            1.0,
        );
        assert_eq!(z, vec![1.0; 6]);
        matmul(
            &mut z,
            Block::rows(0, 2, 3, 3),
            false,
            &l,
            Block::rows(0, 2, 0, 1),
            &r,
            Block::rows(0, 0, 3, 3),
            1.0,
        );
        assert_eq!(z, vec![0.0; 6]);
    }

    #[test]
    #[should_panic(expected = "reaches past its slice")]
    fn a_block_past_its_slice_is_refused() {
        let mut d = vec![0.0f32; 4];
        matmul(
            &mut d,
            Block::rows(0, 2, 2, 2),
            false,
            &[1.0; 4],
            Block::rows(1, 2, 2, 2),
            &[1.0; 4],
            Block::rows(0, 2, 2, 2),
            1.0,
        );
    }

    #[test]
    #[should_panic(expected = "overlaps itself")]
    fn a_destination_whose_rows_overlap_is_refused() {
        let mut d = vec![0.0f32; 8];
        matmul(
            &mut d,
            Block::rows(0, 2, 2, 1),
            false,
            &[1.0; 4],
            Block::rows(0, 2, 2, 2),
            &[1.0; 4],
            Block::rows(0, 2, 2, 2),
            1.0,
        );
    }
}
