//! Decode steps replayed as CUDA graphs (issue #31, "launch overhead"): a decode step of
//! the stacked decode layout (`Model::extend_stacked`) is about 280 launches whose
//! shapes depend only on the number of rows, so the step of a given row count is
//! captured once and then replayed with one launch, its inputs (token ids, rotary
//! tables, the rows' block-table starts and lengths, the block tables) written in
//! place into device buffers the graph reads.
//!
//! Opt-in ([`crate::KvCache::set_cuda_graphs`], or `METRONOME_CUDA_GRAPHS=1` for
//! every cache): a capture is invalidated when another thread synchronises the same
//! GPU meanwhile (a trainer beside the engine), and a synchronising call of that other
//! thread may fail with it, so graphs wait for measurements on a GPU before they become
//! a default. A capture that fails leaves the step to run op by op (the forward
//! captured nothing, executed nothing and wrote no cache) and is tried again at a later
//! step; after four failures in a row a cache stops trying and says why
//! ([`crate::KvCache::decode_graphs`]).
//!
//! What a graph holds: the weights' and caches' addresses (it belongs to one cache, and
//! is dropped when the stacked weights are built anew, for a model built anew; an
//! installed snapshot writes over the weights and stacks in place, so graphs outlive
//! it), and its own allocations for the step's intermediates and its logits, which
//! it frees and makes again at each launch at the same addresses
//! (`CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`): the logits a replay returns are
//! overwritten by the next replay of that graph, so a caller reads them before its next
//! step (the engine's steps do).

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaGraph, sys};
use candle_core::{CudaStorage, Layout, Tensor};

use crate::kv_cache::DecodeGraphStats;
use crate::replays::Replays;
use crate::{Error, Result};

/// The host inputs of a decode step that its graph reads from device buffers.
pub(crate) struct StepInputs<'a> {
    /// Token ids of every row of the residual stream (the padding rows' included).
    pub(crate) ids: &'a [u32],
    /// Rotary tables `[n, head_dim / 2]`.
    pub(crate) cos: &'a [f32],
    pub(crate) sin: &'a [f32],
    /// Per computed row its block-table start and cached length, interleaved.
    pub(crate) rows: &'a [u32],
    /// The cache's block tables.
    pub(crate) blocks: &'a [u32],
    /// The stacked weights' identity: graphs of other weights are dropped.
    pub(crate) weights: u64,
}

/// The device buffers a graph reads its inputs from.
#[derive(Debug)]
pub(crate) struct GraphInputs {
    pub(crate) ids: Tensor,
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
    pub(crate) rows: Tensor,
    pub(crate) blocks: Tensor,
}

impl GraphInputs {
    /// Buffers holding `inputs`, the tables shaped as `RopeTables::on` makes them.
    fn new(device: &candle_core::Device, inputs: &StepInputs<'_>) -> Result<Self> {
        let n = inputs.rows.len() / 2;
        let half = inputs.cos.len() / n.max(1);
        Ok(Self {
            ids: Tensor::from_slice(inputs.ids, inputs.ids.len(), device)?,
            cos: Tensor::from_slice(inputs.cos, (n, 1, half), device)?,
            sin: Tensor::from_slice(inputs.sin, (n, 1, half), device)?,
            rows: Tensor::from_slice(inputs.rows, (n, 2), device)?,
            blocks: Tensor::from_slice(inputs.blocks, inputs.blocks.len(), device)?,
        })
    }

    /// Writes `inputs` into the buffers, in place (their sizes are the graph's).
    fn write(&self, inputs: &StepInputs<'_>) -> Result<()> {
        self.ids.inplace_op1(&Upload::U32(inputs.ids))?;
        self.cos.inplace_op1(&Upload::F32(inputs.cos))?;
        self.sin.inplace_op1(&Upload::F32(inputs.sin))?;
        self.rows.inplace_op1(&Upload::U32(inputs.rows))?;
        self.blocks.inplace_op1(&Upload::U32(inputs.blocks))?;
        Ok(())
    }
}

/// A captured step: its graph, the buffers it reads and the logits it writes. The graph
/// is dropped before the buffers (field order).
struct Captured {
    graph: Graph,
    inputs: GraphInputs,
    logits: Tensor,
}

/// A [`CudaGraph`] moved with the cache that holds it.
struct Graph(CudaGraph);

// SAFETY: a graph is launched only through the `&mut KvCache` that holds it, so by one
// thread at a time (cudarc leaves it `!Send` because CUDA's graph objects are not
// internally synchronised, which exclusive access provides).
#[allow(
    unsafe_code,
    reason = "exclusive access through the cache stands in for CUDA's missing graph locking"
)]
unsafe impl Send for Graph {}

/// A cache's decode-step graphs: [`Replays`] (when to replay, capture or run op by
/// op, and what a failed capture costs) of captured steps.
#[derive(Debug, Default)]
pub(crate) struct DecodeGraphs(Replays<Captured>);

impl std::fmt::Debug for Captured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Captured").field("logits", &self.logits.dims()).finish()
    }
}

impl DecodeGraphs {
    pub(crate) fn stats(&self) -> DecodeGraphStats {
        self.0.stats()
    }

    /// Drops every graph.
    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }

    /// Runs a decode step of `n` computed rows as a graph ([`Replays::run`]): replayed
    /// with `inputs` written into its buffers, or captured by running `forward` on fresh
    /// buffers under stream capture, then launched. `None` when the step is to run op
    /// by op: its caller runs it. `forward` must read its inputs from the
    /// [`GraphInputs`] it is given only.
    pub(crate) fn run(
        &mut self,
        device: &candle_core::Device,
        n: usize,
        inputs: &StepInputs<'_>,
        forward: impl FnOnce(&GraphInputs) -> Result<Tensor>,
    ) -> Result<Option<Tensor>> {
        let replay = |step: &Captured| {
            step.inputs.write(inputs)?;
            step.graph.0.launch().map_err(cuda_err)?;
            Ok(step.logits.clone())
        };
        let capture = || {
            let step = capture(device, inputs, forward)?;
            step.graph.0.launch().map_err(cuda_err)?;
            let logits = step.logits.clone();
            Ok((step, logits))
        };
        self.0.run(n, inputs.weights, replay, capture)
    }
}

fn cuda_err(e: impl std::fmt::Display) -> Error {
    Error::invalid("cuda graph", e.to_string())
}

/// Captures `forward` on fresh input buffers holding `inputs`. Whatever fails, the
/// stream leaves capture mode, and errors the failed capture left recorded in the
/// context are cleared (so that the op-by-op step after it does not report them).
fn capture(
    device: &candle_core::Device,
    inputs: &StepInputs<'_>,
    forward: impl FnOnce(&GraphInputs) -> Result<Tensor>,
) -> Result<Captured> {
    let stream = device.as_cuda_device()?.cuda_stream();
    let graph_inputs = GraphInputs::new(device, inputs)?;
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(cuda_err)?;
    let logits = forward(&graph_inputs);
    let graph =
        stream.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    // Errors cudarc recorded meanwhile (frees, event waits under a capture gone wrong).
    let recorded = stream.context().check_err();
    match (logits, graph, recorded) {
        (Ok(logits), Ok(Some(graph)), Ok(())) => {
            Ok(Captured { graph: Graph(graph), inputs: graph_inputs, logits })
        }
        (logits, graph, recorded) => {
            let why = match (&logits, &graph, &recorded) {
                (Err(e), _, _) => format!("the forward under capture: {e}"),
                (_, Err(e), _) => format!("ending the capture: {e}"),
                (_, Ok(None), _) => "the capture recorded nothing".to_owned(),
                (_, _, Err(e)) => format!("an error recorded under capture: {e}"),
                (Ok(_), Ok(Some(_)), Ok(())) => unreachable!("matched above"),
            };
            // Logits of a graph never launched live in memory that is not allocated:
            // freeing them would record another error.
            if let Ok(logits) = logits {
                std::mem::forget(logits);
            }
            drop(graph);
            let _ = stream.context().check_err();
            Err(cuda_err(why))
        }
    }
}

/// Host data written into a device buffer of the same type and size, in place.
enum Upload<'a> {
    U32(&'a [u32]),
    F32(&'a [f32]),
}

impl candle_core::InplaceOp1 for Upload<'_> {
    fn name(&self) -> &'static str {
        "cuda-graph-input"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("{} runs on CUDA devices only", self.name())
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("{}: not contiguous", self.name())
        };
        let stream = s.device().cuda_stream();
        macro_rules! write {
            ($t:ty, $data:expr) => {{
                if $data.len() != b - a {
                    candle_core::bail!("{}: {} values for a buffer of {}", self.name(), $data.len(), b - a)
                }
                let slice = s.as_cuda_slice_mut::<$t>()?;
                let mut dst = slice.slice_mut(a..b);
                stream.memcpy_htod($data, &mut dst).map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
            }};
        }
        match self {
            Self::U32(data) => write!(u32, *data),
            Self::F32(data) => write!(f32, *data),
        }
        Ok(())
    }
}
