//! This crate's own CUDA kernels (`kernels/*.cu`, compiled to PTX by `build.rs` with
//! the `cuda` feature and loaded on first use) and their launches: what
//! [`crate::Kernels::Cuda`] runs beyond the portable ops. Each has a CPU reference in
//! the crate, which its GPU test compares it with (`tests/it/devices.rs`).

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::{DType, Storage, Tensor};

use crate::draw::{Draw, Drawn, Next};
use crate::{Error, Result};

/// `kernels/draw.cu`.
const DRAW_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/draw.ptx"));
/// Threads per row of the draw kernel (`DRAW_THREADS` there, which sizes its shared arrays).
const DRAW_THREADS: u32 = 1024;
/// The kernel's token for a row without a finite maximum.
const NONE: u32 = u32::MAX;

fn cuda_err(e: impl std::fmt::Display) -> Error {
    Error::invalid("cuda", e.to_string())
}

/// [`crate::Kernels::next_rows`] on a CUDA device: the rows with a draw are drawn by
/// `draw_rows_*` in one launch (one block per row) and only their tokens and log-probs
/// are copied to the host; the other rows' logits are gathered and copied.
pub(crate) fn next_rows(logits: &Tensor, draws: &[Option<Draw>]) -> Result<Vec<Next>> {
    let (rows, vocab) = logits.dims2()?;
    let drawn: Vec<usize> = (0..rows).filter(|&r| draws[r].is_some()).collect();
    let index =
        |rs: &[usize]| Tensor::from_vec(rs.iter().map(|&r| r as u32).collect(), rs.len(), logits.device());
    let picked = if drawn.len() == rows {
        logits.contiguous()?
    } else {
        logits.index_select(&index(&drawn)?, 0)?.contiguous()?
    };
    let draws_of: Vec<Draw> = drawn.iter().filter_map(|&r| draws[r]).collect();
    let results = draw_rows(&picked, vocab, &draws_of)?;
    // Rows without a draw, and drawn rows that had no finite maximum, go to the host.
    let mut out: Vec<Option<Next>> = vec![None; rows];
    for (&r, d) in drawn.iter().zip(results) {
        out[r] = d.map(Next::Drawn);
    }
    let host: Vec<usize> = (0..rows).filter(|&r| out[r].is_none()).collect();
    if !host.is_empty() {
        let logits = logits.index_select(&index(&host)?, 0)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        for (&r, row) in host.iter().zip(logits) {
            out[r] = Some(Next::Logits(row));
        }
    }
    Ok(out.into_iter().map(|n| n.expect("every row is drawn or copied")).collect())
}

/// Launches the draw kernel on `logits: [draws.len(), vocab]` (contiguous, f32 or bf16);
/// `None` for a row without a finite maximum.
#[allow(unsafe_code, reason = "a kernel launch: cudarc cannot check the arguments against the PTX")]
fn draw_rows(logits: &Tensor, vocab: usize, draws: &[Draw]) -> Result<Vec<Option<Drawn>>> {
    let n = draws.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    let vocab32 =
        u32::try_from(vocab).map_err(|_| Error::invalid("draw", format!("vocabulary of {vocab}")))?;
    let (storage, layout) = logits.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(Error::invalid("draw", "the CUDA kernels need logits on a CUDA device"));
    };
    let dev = cs.device();
    let stream = dev.cuda_stream();
    // The host's scaling: `1 / T` in f32, none at `T = 0` (greedy) or `T = 1`.
    let inv: Vec<f32> = draws
        .iter()
        .map(|d| if d.temperature == 0.0 || d.temperature == 1.0 { 1.0 } else { 1.0 / d.temperature })
        .collect();
    let greedy: Vec<u32> = draws.iter().map(|d| u32::from(d.temperature == 0.0)).collect();
    let u: Vec<f64> = draws.iter().map(|d| d.u).collect();
    let inv = stream.clone_htod(&inv).map_err(cuda_err)?;
    let greedy = stream.clone_htod(&greedy).map_err(cuda_err)?;
    let u = stream.clone_htod(&u).map_err(cuda_err)?;
    let tokens: CudaSlice<u32> = stream.alloc_zeros(n).map_err(cuda_err)?;
    let logprobs: CudaSlice<f32> = stream.alloc_zeros(n).map_err(cuda_err)?;
    let (start, len) = (layout.start_offset(), n * vocab);
    let cfg =
        LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (DRAW_THREADS, 1, 1), shared_mem_bytes: 0 };
    macro_rules! launch {
        ($t:ty, $name:literal) => {{
            let src = cs.as_cuda_slice::<$t>()?.slice(start..start + len);
            let func = dev.get_or_load_custom_func($name, "metronome_draw", DRAW_PTX)?;
            let mut b = func.builder();
            b.arg(&src).arg(&inv).arg(&greedy).arg(&u).arg(&tokens).arg(&logprobs).arg(&vocab32);
            // SAFETY: the arguments are the kernel's, in its order and types; `src` holds
            // `n * vocab` elements and the outputs `n`, one block writing each row's.
            unsafe { b.launch(cfg) }.map_err(cuda_err)?;
        }};
    }
    match logits.dtype() {
        DType::F32 => launch!(f32, "draw_rows_f32"),
        DType::BF16 => launch!(half::bf16, "draw_rows_bf16"),
        other => {
            return Err(Error::invalid(
                "draw",
                format!("logits of {other:?}: the kernel reads f32 and bf16"),
            ));
        }
    }
    let tokens = stream.clone_dtoh(&tokens).map_err(cuda_err)?;
    let logprobs = stream.clone_dtoh(&logprobs).map_err(cuda_err)?;
    Ok(tokens
        .into_iter()
        .zip(logprobs)
        .map(|(token, logprob)| (token != NONE).then_some(Drawn { token, logprob }))
        .collect())
}
