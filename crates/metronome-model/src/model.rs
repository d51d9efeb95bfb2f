//! The decoder: weights, the training forward over packed rows, and plain logits.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use metronome_core::{PackedRow, Targets};

use crate::config::ModelConfig;
use crate::head::{self, HeadInput};
use crate::ops::{
    Buffers, DenseWeight, LayerShape, LayerWeights, Projection, RopeTables, RowIndex, RowMasks, RowPlans,
    layer_backward, layer_forward, read_host, read_hosts, rope_tables, segment_plans,
};
use crate::recompute::{LinkCache, Links, attach};
use crate::{Error, Kernels, Result};

mod init;
mod snapshot;

/// One decoder layer's parameters.
#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) input_norm: Var,
    pub(crate) q: Var,
    pub(crate) q_bias: Option<Var>,
    pub(crate) k: Var,
    pub(crate) k_bias: Option<Var>,
    pub(crate) v: Var,
    pub(crate) v_bias: Option<Var>,
    pub(crate) o: Var,
    pub(crate) post_norm: Var,
    pub(crate) gate: Var,
    pub(crate) up: Var,
    pub(crate) down: Var,
    /// The links of [`Layer::vars`] for a layer run on host buffers (`Model::host_layer`).
    pub(crate) links: LinkCache,
}

impl Layer {
    /// The weights of a layer without biases, in [`crate::ops::LayerWeights`]' order.
    pub(crate) fn vars(&self) -> [&Var; 9] {
        [
            &self.input_norm,
            &self.post_norm,
            &self.q,
            &self.k,
            &self.v,
            &self.o,
            &self.gate,
            &self.up,
            &self.down,
        ]
    }

    /// The base weight of projection `p`.
    pub(crate) fn weight(&self, p: Projection) -> &Var {
        match p {
            Projection::Q => &self.q,
            Projection::K => &self.k,
            Projection::V => &self.v,
            Projection::O => &self.o,
            Projection::Gate => &self.gate,
            Projection::Up => &self.up,
            Projection::Down => &self.down,
        }
    }
}

/// `f` on the host elements of layer `l`'s weights (see [`Layer::vars`]) and of `x`,
/// all contiguous f32 CPU tensors.
fn with_layer<R>(l: &Layer, x: &Tensor, f: impl FnOnce(&LayerWeights<'_>, &[f32]) -> R) -> Result<R> {
    let [a, b, c, d, e, g, h, i, j] = l.vars().map(Var::as_tensor);
    read_hosts([x, a, b, c, d, e, g, h, i, j], |[x, input_norm, post_norm, q, k, v, o, gate, up, down]| {
        f(&LayerWeights { input_norm, post_norm, q, k, v, o, gate, up, down }, x)
    })
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) cfg: ModelConfig,
    pub(crate) device: Device,
    pub(crate) embed: Var,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Var,
    /// `None` when the head is tied to the embedding.
    pub(crate) lm_head: Option<Var>,
    /// Whether this model may keep its linear layers a second time in decode layout:
    /// set for models built never to train (non-trainable, e.g. by
    /// [`Model::frozen_copy`]), cleared for good by `with_trainable(true)`, so a model
    /// whose weights an optimiser moves never decodes from a stale copy. Whether the
    /// copy is made is the kernels' choice ([`Model::decode_weights`]), not the
    /// device's.
    pub(crate) frozen: std::sync::atomic::AtomicBool,
    /// That copy, built by the first decode step that needs it (a frozen reference model
    /// that only scores never pays its memory) and dropped by
    /// [`Model::load_snapshot`], to be rebuilt from the new weights: on the host for the
    /// fused kernels, ...
    pub(crate) decode: std::sync::RwLock<Option<Arc<DecodeWeights>>>,
    /// ... stacked on the model's device for the others ([`StackedWeights`]).
    pub(crate) stacked: std::sync::RwLock<Option<Arc<StackedWeights>>>,
    /// The host buffers of the layers run whole (`Model::host_layer`).
    pub(crate) buffers: Arc<Buffers>,
}

/// One layer's linear weights in decode layout ([`DenseWeight`], `[in, out]`): the
/// query, key and value projections stacked into one product, and the gate and up
/// projections into another.
#[derive(Debug)]
pub(crate) struct DecodeLayer {
    pub(crate) qkv: DenseWeight,
    pub(crate) o: DenseWeight,
    pub(crate) gate_up: DenseWeight,
    pub(crate) down: DenseWeight,
}

/// Every linear layer of a model in decode layout, and the LM head.
#[derive(Debug)]
pub(crate) struct DecodeWeights {
    pub(crate) layers: Vec<DecodeLayer>,
    pub(crate) lm_head: DenseWeight,
}

impl DecodeWeights {
    /// The decode layout of `m`'s current weights.
    fn of(m: &Inner) -> Result<Self> {
        let t = |v: &Var| v.as_tensor().detach();
        let layers = m
            .layers
            .iter()
            .map(|l| {
                let biases: Vec<Tensor> =
                    [&l.q_bias, &l.k_bias, &l.v_bias].into_iter().flatten().map(t).collect();
                Ok(DecodeLayer {
                    qkv: DenseWeight::stacked(
                        &[&t(&l.q), &t(&l.k), &t(&l.v)],
                        &biases.iter().collect::<Vec<_>>(),
                    )?,
                    o: DenseWeight::stacked(&[&t(&l.o)], &[])?,
                    gate_up: DenseWeight::stacked(&[&t(&l.gate), &t(&l.up)], &[])?,
                    down: DenseWeight::stacked(&[&t(&l.down)], &[])?,
                })
            })
            .collect::<Result<_>>()?;
        let lm_head = DenseWeight::stacked(&[&t(m.lm_head.as_ref().unwrap_or(&m.embed))], &[])?;
        Ok(Self { layers, lm_head })
    }
}

/// A layer's products in the decode layout of the portable and CUDA kernels: the query,
/// key and value weights stacked into one `[(heads + 2 kv_heads) head_dim, hidden]`
/// tensor (and their biases into one), the gate and up weights into one `[2
/// intermediate, hidden]`, so that a cached forward runs one product for each stack
/// (`Model::extend_stacked`): on a GPU a decode step's time is its launches.
#[derive(Debug)]
pub(crate) struct StackedLayer {
    pub(crate) qkv: Tensor,
    pub(crate) qkv_bias: Option<Tensor>,
    pub(crate) gate_up: Tensor,
}

/// Every layer's [`StackedLayer`].
#[derive(Debug)]
pub(crate) struct StackedWeights {
    pub(crate) layers: Vec<StackedLayer>,
    /// Unique to this build of the stacks (CUDA graphs of decode steps, which hold the
    /// weights' addresses, are dropped when it changes; an address could be reused).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "read by the CUDA graphs only"))]
    pub(crate) id: u64,
}

/// A layer's weights as its stacks take them: query, key, value; their biases (all three
/// or none); gate, up.
struct StackParts {
    qkv: [Tensor; 3],
    biases: Option<[Tensor; 3]>,
    gate_up: [Tensor; 2],
}

fn stack_parts(l: &Layer) -> Result<StackParts> {
    let t = |v: &Var| v.as_tensor().detach();
    let biases = match (&l.q_bias, &l.k_bias, &l.v_bias) {
        (Some(q), Some(k), Some(v)) => Some([t(q), t(k), t(v)]),
        (None, None, None) => None,
        _ => {
            return Err(Error::invalid(
                "decode layout",
                "a layer with biases on some of its query, key and value projections only",
            ));
        }
    };
    Ok(StackParts { qkv: [t(&l.q), t(&l.k), t(&l.v)], biases, gate_up: [t(&l.gate), t(&l.up)] })
}

/// Writes `parts` into `stack` one after another along its first dimension, in place.
fn restack(stack: &Tensor, parts: &[Tensor]) -> Result<()> {
    let mut offset = 0;
    for p in parts {
        stack.slice_set(p, 0, offset)?;
        offset += p.dim(0)?;
    }
    Ok(())
}

impl StackedWeights {
    /// The stacks of `m`'s current weights, on its device.
    fn of(m: &Inner) -> Result<Self> {
        let layers = m
            .layers
            .iter()
            .map(|l| {
                let StackParts { qkv, biases, gate_up } = stack_parts(l)?;
                Ok(StackedLayer {
                    qkv: Tensor::cat(&qkv, 0)?,
                    qkv_bias: biases.map(|b| Tensor::cat(&b, 0)).transpose()?,
                    gate_up: Tensor::cat(&gate_up, 0)?,
                })
            })
            .collect::<Result<_>>()?;
        static BUILT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Self { layers, id: BUILT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) })
    }

    /// Writes `m`'s current weights into these stacks, in place: their addresses, which
    /// CUDA graphs of decode steps hold, stay.
    fn refresh(&self, m: &Inner) -> Result<()> {
        for (l, sl) in m.layers.iter().zip(&self.layers) {
            let StackParts { qkv, biases, gate_up } = stack_parts(l)?;
            restack(&sl.qkv, &qkv)?;
            if let (Some(stack), Some(b)) = (&sl.qkv_bias, biases) {
                restack(stack, &b)?;
            }
            restack(&sl.gate_up, &gate_up)?;
        }
        Ok(())
    }
}

/// The value in `slot`, built by `build` on first use; `None` when the lock is poisoned.
fn cached<T>(
    slot: &std::sync::RwLock<Option<Arc<T>>>,
    build: impl FnOnce() -> Result<T>,
) -> Result<Option<Arc<T>>> {
    if let Some(d) = slot.read().ok().and_then(|d| d.clone()) {
        return Ok(Some(d));
    }
    let Ok(mut slot) = slot.write() else { return Ok(None) };
    // Another worker may have built it while this one waited for the lock.
    if slot.is_none() {
        *slot = Some(Arc::new(build()?));
    }
    Ok(slot.clone())
}

/// A Llama/Qwen2-family decoder.
///
/// Cloning is cheap and shares the weights: a clone sees every later optimiser step
/// (use [`Model::snapshot`] or [`Model::frozen_copy`] for an independent copy).
/// Every weight is a `candle_core::Var`; a *trainable* model records autograd graphs in
/// [`Model::target_logprobs`] and [`Model::forward_logits`], a frozen one reads the same
/// storage through detached tensors and builds none. Generation
/// ([`Model::prefill`], [`Model::decode_step`]) never builds a graph.
#[derive(Clone, Debug)]
pub struct Model {
    pub(crate) inner: Arc<Inner>,
    pub(crate) trainable: bool,
    /// Which implementation of the element-wise ops the forward passes run.
    pub(crate) kernels: Kernels,
    /// Low-rank adapters on this handle's projections ([`Model::with_lora`]); with
    /// them the base weights are read detached, so only the adapters train.
    pub(crate) lora: Option<Arc<crate::lora::adapters::Adapters>>,
    /// The log-prob head of [`Model::score`] in chunks of at most about this many
    /// logits ([`Model::with_chunked_head`]); `None`, the whole `[targets, vocab]`.
    pub(crate) head_chunk: Option<usize>,
    /// Whether a training forward keeps each decoder layer's input only and
    /// recomputes its activations in the backward ([`Model::with_gradient_checkpointing`]).
    pub(crate) checkpoint_layers: bool,
    /// Whether a training forward attends each packed row as a whole, all rows in one
    /// batched product per layer ([`Model::with_batched_attention`]), rather than each
    /// segment on its own.
    pub(crate) batched_attention: bool,
}

/// What [`Model::target_logprobs`] returns, one entry per target.
#[derive(Clone, Debug)]
pub struct TargetOutput {
    /// `log p(target token)` at its predicting position, `[n_targets]` f32.
    pub logprobs: Tensor,
    /// Entropy of the predicting position's distribution, `[n_targets]` f32.
    pub entropy: Tensor,
    /// What the head read: the rows a loss over the whole distributions builds on
    /// ([`crate::reverse_kl`]).
    pub head: HeadInput,
}

/// A packed micro-batch checked and laid out by [`Model::prepare_batch`], ready for
/// [`Model::score`] by any model of the same vocabulary, head size, rotary base and
/// device (a policy and its frozen reference share one).
#[derive(Debug)]
pub struct ScoringBatch {
    shape: BatchShape,
    device: Device,
    /// Positions of the rows, without the padding of rows attended whole.
    positions: usize,
    /// Token ids of the concatenated rows, `[positions]`.
    ids: RowIndex,
    /// What every decoder layer reads of the layout.
    layout: LayerLayout,
    /// Each target's predicting position in the concatenated rows, `[targets]`.
    index: RowIndex,
    targets: Vec<u32>,
}

impl ScoringBatch {
    /// Number of positions of the rows (the tokens every forward runs).
    #[must_use]
    pub fn num_positions(&self) -> usize {
        self.positions
    }

    /// Number of targets scored.
    #[must_use]
    pub fn num_targets(&self) -> usize {
        self.targets.len()
    }
}

/// What a decoder layer reads of a batch's layout: the rotary tables and each row's
/// attention plans. Shared, because a checkpointed layer's backward runs the layer
/// again after the forward that prepared it has returned.
#[derive(Clone, Debug)]
struct LayerLayout {
    rope: RopeTables,
    /// Per row: its length and the attention plan of each segment (empty when the
    /// rows are attended whole).
    plans: Arc<RowPlans>,
    /// With [`Model::with_batched_attention`]: the rows, each padded to the longest,
    /// attended whole.
    batched: Option<RowMasks>,
}

/// The largest `[rows, len, len]` f32 mask a batch attended row by row may build;
/// beyond it the batch is attended per segment.
pub const BATCHED_MASK_BYTES: usize = 256 << 20;

/// What a [`ScoringBatch`]'s layout depends on besides the rows: the vocabulary the
/// tokens were checked against, and the rotary tables' head size and base.
#[derive(Clone, Copy, Debug, PartialEq)]
struct BatchShape {
    vocab_size: usize,
    head_dim: usize,
    rope_theta: f64,
}

impl BatchShape {
    fn of(cfg: &ModelConfig) -> Self {
        Self { vocab_size: cfg.vocab_size, head_dim: cfg.head_dim, rope_theta: cfg.rope_theta }
    }
}

/// A projection weight's layer and projection.
type ProjectionAt = (usize, Projection);

/// Where the parameters come from when a model is built.
pub(crate) type Source<'a> = dyn FnMut(&str, &[usize], Init) -> Result<Tensor> + 'a;

/// How a freshly initialised parameter is filled.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Init {
    Normal,
    Zeros,
    Ones,
}

impl Model {
    /// Builds a model, asking `source` for each parameter by Hugging Face name.
    pub(crate) fn build(
        cfg: ModelConfig,
        device: &Device,
        trainable: bool,
        source: &mut Source<'_>,
    ) -> Result<Self> {
        cfg.validate()?;
        let d = cfg.hidden_size;
        let qd = cfg.num_attention_heads * cfg.head_dim;
        let kvd = cfg.num_key_value_heads * cfg.head_dim;
        let bias = cfg.architecture.qkv_bias();
        let mut var = |name: &str, shape: &[usize], init: Init| -> Result<Var> {
            let t = source(name, shape, init)?;
            if t.dims() != shape {
                return Err(Error::checkpoint(
                    format!("tensor `{name}`"),
                    format!("has shape {:?}, expected {shape:?}", t.dims()),
                ));
            }
            Ok(Var::from_tensor(&t.to_dtype(DType::F32)?.to_device(device)?)?)
        };
        let embed = var("model.embed_tokens.weight", &[cfg.vocab_size, d], Init::Normal)?;
        // Grown layer by layer: the count comes from a file, and a corrupted one must
        // end at the first missing tensor, not in an allocation of that many layers.
        let mut layers = Vec::new();
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let input_norm = var(&format!("{p}.input_layernorm.weight"), &[d], Init::Ones)?;
            let q = var(&format!("{p}.self_attn.q_proj.weight"), &[qd, d], Init::Normal)?;
            let q_bias = if bias {
                Some(var(&format!("{p}.self_attn.q_proj.bias"), &[qd], Init::Zeros)?)
            } else {
                None
            };
            let k = var(&format!("{p}.self_attn.k_proj.weight"), &[kvd, d], Init::Normal)?;
            let k_bias = if bias {
                Some(var(&format!("{p}.self_attn.k_proj.bias"), &[kvd], Init::Zeros)?)
            } else {
                None
            };
            let v = var(&format!("{p}.self_attn.v_proj.weight"), &[kvd, d], Init::Normal)?;
            let v_bias = if bias {
                Some(var(&format!("{p}.self_attn.v_proj.bias"), &[kvd], Init::Zeros)?)
            } else {
                None
            };
            layers.push(Layer {
                input_norm,
                q,
                q_bias,
                k,
                k_bias,
                v,
                v_bias,
                o: var(&format!("{p}.self_attn.o_proj.weight"), &[d, qd], Init::Normal)?,
                post_norm: var(&format!("{p}.post_attention_layernorm.weight"), &[d], Init::Ones)?,
                gate: var(&format!("{p}.mlp.gate_proj.weight"), &[cfg.intermediate_size, d], Init::Normal)?,
                up: var(&format!("{p}.mlp.up_proj.weight"), &[cfg.intermediate_size, d], Init::Normal)?,
                down: var(&format!("{p}.mlp.down_proj.weight"), &[d, cfg.intermediate_size], Init::Normal)?,
                links: LinkCache::default(),
            });
        }
        let norm = var("model.norm.weight", &[d], Init::Ones)?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(var("lm_head.weight", &[cfg.vocab_size, d], Init::Normal)?)
        };
        // A model built to never train (a frozen copy, a rollout worker's) may keep its
        // linear layers a second time in decode layout: under the fused kernels that
        // memory buys decode steps without repacking transposed weights (crate `ops`,
        // `dense_rows`).
        let buffers = Arc::new(Buffers::new(cfg.num_hidden_layers));
        let inner = Inner {
            cfg,
            device: device.clone(),
            embed,
            layers,
            norm,
            lm_head,
            frozen: std::sync::atomic::AtomicBool::new(!trainable),
            decode: std::sync::RwLock::new(None),
            stacked: std::sync::RwLock::new(None),
            buffers,
        };
        Ok(Self {
            inner: Arc::new(inner),
            trainable,
            kernels: Kernels::for_device(device),
            lora: None,
            head_chunk: None,
            checkpoint_layers: false,
            batched_attention: device.is_cuda(),
        })
    }

    /// A copy of this handle's weights (and adapters) in `dtype`, in storage of its
    /// own, trainable as this handle is: the compute weights of mixed precision
    /// ([`crate::Precision`]). An optimiser keeps its f32 masters elsewhere and writes
    /// them into the copy after each step (its parameters, [`Model::parameters`] and
    /// [`Model::adapter_parameters`], come in the same order as this handle's). The
    /// copy runs this handle's kernels, chunked head and checkpointing, except that a
    /// type the fused CPU kernels cannot compute in (bf16) runs the portable ones, the
    /// arithmetic a GPU runs. In f32 it is a deep copy.
    pub fn compute_copy(&self, dtype: DType) -> Result<Self> {
        let cast =
            |v: &Var| -> Result<Var> { Ok(Var::from_tensor(&v.as_tensor().detach().to_dtype(dtype)?)?) };
        let cast_opt = |v: &Option<Var>| v.as_ref().map(cast).transpose();
        let m = &self.inner;
        let layers = m
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    input_norm: cast(&l.input_norm)?,
                    q: cast(&l.q)?,
                    q_bias: cast_opt(&l.q_bias)?,
                    k: cast(&l.k)?,
                    k_bias: cast_opt(&l.k_bias)?,
                    v: cast(&l.v)?,
                    v_bias: cast_opt(&l.v_bias)?,
                    o: cast(&l.o)?,
                    post_norm: cast(&l.post_norm)?,
                    gate: cast(&l.gate)?,
                    up: cast(&l.up)?,
                    down: cast(&l.down)?,
                    links: LinkCache::default(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let inner = Inner {
            cfg: m.cfg.clone(),
            device: m.device.clone(),
            embed: cast(&m.embed)?,
            layers,
            norm: cast(&m.norm)?,
            lm_head: cast_opt(&m.lm_head)?,
            frozen: std::sync::atomic::AtomicBool::new(!self.trainable),
            decode: std::sync::RwLock::new(None),
            stacked: std::sync::RwLock::new(None),
            buffers: Arc::new(Buffers::new(m.cfg.num_hidden_layers)),
        };
        let lora = match &self.lora {
            Some(ad) => Some(Arc::new(ad.cast(dtype)?)),
            None => None,
        };
        let kernels =
            if self.kernels.check(&m.device, dtype).is_ok() { self.kernels } else { Kernels::Portable };
        Ok(Self { inner: Arc::new(inner), kernels, lora, ..self.clone() })
    }

    /// The type of the weights (f32, or bf16 for a [`Model::compute_copy`]).
    #[must_use]
    pub fn dtype(&self) -> DType {
        self.inner.embed.dtype()
    }

    /// The same weights (shared) with [`Model::score`]'s log-prob head computed in
    /// chunks: the final projection, the log-softmax, the target's log-prob and the
    /// entropy as one graph node whose transient logits hold at most about `elements`
    /// values (never less than one row), recomputed by blocks of vocabulary columns in
    /// the backward, so that no `[targets, vocab]` tensor exists. `None` (the default)
    /// is the whole-logits head. Values match it within 1e-5 and gradients within
    /// 1e-4 in f32 (tested); [`Model::default_head_chunk`] suits the device.
    #[must_use]
    pub fn with_chunked_head(mut self, elements: Option<usize>) -> Self {
        self.head_chunk = elements;
        self
    }

    /// The chunked head's budget, if it is on ([`Model::with_chunked_head`]).
    #[must_use]
    pub fn chunked_head(&self) -> Option<usize> {
        self.head_chunk
    }

    /// A chunk budget for this model's device: 4 M logits on the CPU, 32 M on a GPU
    /// (fewer, larger chunks: each one costs kernel launches).
    #[must_use]
    pub fn default_head_chunk(&self) -> usize {
        if self.device().is_cpu() { head::CPU_CHUNK_ELEMENTS } else { head::GPU_CHUNK_ELEMENTS }
    }

    /// The same weights (shared) with gradient checkpointing of the decoder layers:
    /// a training forward keeps each layer's input and no activation inside it, and
    /// the backward runs each layer's forward again to differentiate it (about one
    /// more forward of the layers per step, for the memory of all their
    /// activations). Gradients are those without checkpointing (tested bitwise on
    /// the CPU); forwards that record no graph are unchanged.
    #[must_use]
    pub fn with_gradient_checkpointing(mut self, on: bool) -> Self {
        self.checkpoint_layers = on;
        self
    }

    /// The same weights (shared), preparing batches whose attention runs per packed row,
    /// every row in one batched product per layer, instead of per segment (on by
    /// default on a GPU). Each row is padded to the longest and attended under its
    /// segment-tree mask (`[rows, len, len]`, built once per batch), so a layer launches
    /// the same few kernels however many rows and segments the batch holds, and no
    /// gradient is sliced out of the whole batch per segment (on a GPU those slices'
    /// backwards, each padding its gradient to the whole batch, took a third of a
    /// step's GPU time). It computes the masked pairs too: a row of many short segments
    /// costs up to its length squared. Batches whose masks would pass
    /// [`BATCHED_MASK_BYTES`] are laid out per segment whatever this says. Values and
    /// gradients equal the per-segment ones (tested on the CPU within 1e-5 and 1e-4).
    #[must_use]
    pub fn with_batched_attention(mut self, on: bool) -> Self {
        self.batched_attention = on;
        self
    }

    /// Whether decoder layers are checkpointed ([`Model::with_gradient_checkpointing`]).
    #[must_use]
    pub fn gradient_checkpointing(&self) -> bool {
        self.checkpoint_layers
    }

    /// The hyper-parameters.
    #[must_use]
    pub fn config(&self) -> &ModelConfig {
        &self.inner.cfg
    }

    /// The device the weights live on.
    #[must_use]
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Whether forward passes record autograd graphs.
    #[must_use]
    pub fn is_trainable(&self) -> bool {
        self.trainable
    }

    /// The same weights (shared, not copied) with forward passes that do or do not
    /// record autograd graphs.
    ///
    /// Only a model built frozen ([`Model::frozen_copy`], [`Model::from_snapshot`] with
    /// `trainable == false`) decodes from a copy of its linear layers in decode layout
    /// (several times faster on many slots). Making it trainable drops that copy for
    /// good, for every handle sharing the weights, since an optimiser would leave it
    /// stale; its decoding then runs on the training layout, like that of any model
    /// built trainable. A frozen model's weights change only through
    /// [`Model::load_snapshot`] (which refreshes the copy).
    #[must_use]
    pub fn with_trainable(mut self, trainable: bool) -> Self {
        if trainable {
            self.inner.frozen.store(false, std::sync::atomic::Ordering::SeqCst);
            self.drop_decode_layouts();
        }
        self.trainable = trainable;
        self
    }

    /// Which implementation of the element-wise ops this handle runs.
    #[must_use]
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// The same weights (shared) running `kernels`: [`Kernels::for_device`] is the
    /// default; [`Kernels::Portable`] on the CPU runs what a GPU runs (how the tests
    /// check the GPU's arithmetic without one). An error for [`Kernels::Fused`] off
    /// the CPU or on weights other than f32 (a bf16 [`Model::compute_copy`]), and for
    /// [`Kernels::Cuda`] off a CUDA device.
    pub fn with_kernels(mut self, kernels: Kernels) -> Result<Self> {
        kernels.check(self.device(), self.dtype())?;
        self.kernels = kernels;
        Ok(self)
    }

    /// The decode-layout weights of a frozen model under the fused kernels, built on
    /// first use; `None` for a model that may train, and for the other kernels (the
    /// layout is a CPU kernel's).
    pub(crate) fn decode_weights(&self) -> Result<Option<Arc<DecodeWeights>>> {
        if self.kernels != Kernels::Fused || !self.is_frozen() {
            return Ok(None);
        }
        cached(&self.inner.decode, || DecodeWeights::of(&self.inner))
    }

    /// The stacked products of a frozen model under the portable and CUDA kernels,
    /// built on first use; `None` for a model that may train, and under the fused
    /// kernels (which decode from [`Model::decode_weights`]).
    pub(crate) fn stacked_weights(&self) -> Result<Option<Arc<StackedWeights>>> {
        if self.kernels == Kernels::Fused || !self.is_frozen() {
            return Ok(None);
        }
        cached(&self.inner.stacked, || StackedWeights::of(&self.inner))
    }

    fn is_frozen(&self) -> bool {
        self.inner.frozen.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Drops the decode layouts (the model may now train): the next decode step of a
    /// frozen model would rebuild the one it needs.
    fn drop_decode_layouts(&self) {
        if let Ok(mut d) = self.inner.decode.write() {
            *d = None;
        }
        if let Ok(mut d) = self.inner.stacked.write() {
            *d = None;
        }
    }

    /// Brings the decode layouts up to weights just installed: the host layout of the
    /// fused kernels is rebuilt on its next use, the stacked products are written over
    /// in place (so CUDA graphs of decode steps, which read them where they are, stay
    /// valid across installs).
    pub(crate) fn refresh_decode_layouts(&self) -> Result<()> {
        if let Ok(mut d) = self.inner.decode.write() {
            *d = None;
        }
        let stacked = self.inner.stacked.read().ok().and_then(|s| s.clone());
        let Some(sw) = stacked else { return Ok(()) };
        sw.refresh(&self.inner).inspect_err(|_| {
            // Stacks partly written: the next decode step builds them anew.
            if let Ok(mut d) = self.inner.stacked.write() {
                *d = None;
            }
        })
    }

    /// Every base parameter with its Hugging Face name, in a stable order (embedding,
    /// then each layer, then the final norm and the LM head when untied). Adapters are
    /// [`Model::adapter_parameters`].
    #[must_use]
    pub fn parameters(&self) -> Vec<(String, Var)> {
        self.named_parameters().into_iter().map(|(name, var, _)| (name, var)).collect()
    }

    /// [`Model::parameters`], each projection weight tagged with its layer and
    /// projection (where an adapter may merge into it).
    fn named_parameters(&self) -> Vec<(String, Var, Option<ProjectionAt>)> {
        let m = &self.inner;
        let mut out = vec![("model.embed_tokens.weight".to_owned(), m.embed.clone(), None)];
        for (i, l) in m.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            out.push((format!("{p}.input_layernorm.weight"), l.input_norm.clone(), None));
            for proj in Projection::ALL {
                if proj == Projection::Gate {
                    out.push((format!("{p}.post_attention_layernorm.weight"), l.post_norm.clone(), None));
                }
                let name = format!("{p}.{}", proj.module_path());
                out.push((format!("{name}.weight"), l.weight(proj).clone(), Some((i, proj))));
                let bias = match proj {
                    Projection::Q => &l.q_bias,
                    Projection::K => &l.k_bias,
                    Projection::V => &l.v_bias,
                    _ => &None,
                };
                if let Some(b) = bias {
                    out.push((format!("{name}.bias"), b.clone(), None));
                }
            }
        }
        out.push(("model.norm.weight".to_owned(), m.norm.clone(), None));
        if let Some(h) = &m.lm_head {
            out.push(("lm_head.weight".to_owned(), h.clone(), None));
        }
        out
    }

    /// Every weight by Hugging Face name as this handle computes with it: detached
    /// base tensors, with adapters merged into their projections.
    pub(crate) fn weights(&self) -> Result<Vec<(String, Tensor)>> {
        self.named_parameters()
            .into_iter()
            .map(|(name, var, at)| {
                let t = var.as_tensor().detach();
                Ok((
                    name,
                    match at {
                        Some((layer, p)) => self.merge_adapter(layer, p, t)?,
                        None => t,
                    },
                ))
            })
            .collect()
    }

    /// Number of scalar parameters.
    #[must_use]
    pub fn num_parameters(&self) -> usize {
        self.parameters().iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// A weight as the forward pass uses it: the variable itself when gradients are
    /// wanted, otherwise a detached view of the same storage (no graph is recorded).
    pub(crate) fn w(v: &Var, grad: bool) -> Tensor {
        if grad { v.as_tensor().clone() } else { v.as_tensor().detach() }
    }

    pub(crate) fn lm_head(&self, grad: bool) -> Tensor {
        Self::w(self.inner.lm_head.as_ref().unwrap_or(&self.inner.embed), grad)
    }

    /// Refuses a token id outside the vocabulary, naming `what` and the token's place.
    pub(crate) fn check_tokens<'t>(
        &self,
        tokens: impl IntoIterator<Item = &'t u32>,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let v = self.inner.cfg.vocab_size;
        if let Some((i, t)) = tokens.into_iter().enumerate().find(|(_, t)| **t as usize >= v) {
            return Err(Error::invalid(
                what(),
                format!("token {i} is id {t}, outside the vocabulary of {v}"),
            ));
        }
        Ok(())
    }

    /// Checks `rows` and `targets` against this model and lays them out once for
    /// every model of the same shape that scores them ([`Model::score`]): the token
    /// ids, the rotary tables of the explicit positions, each segment's attention
    /// plan and mask, and where each target's predicting position lies. A policy and
    /// its reference score one micro-batch from one [`ScoringBatch`].
    ///
    /// `targets.row`, `position` and `token` are read; the other fields are the
    /// trainer's.
    pub fn prepare_batch(&self, rows: &[PackedRow], targets: &Targets) -> Result<ScoringBatch> {
        let cfg = &self.inner.cfg;
        let dev = self.device();
        let n = targets.token.len();
        if targets.row.len() != n || targets.position.len() != n {
            return Err(Error::invalid(
                "targets",
                format!(
                    "have {} rows and {} positions for {n} tokens",
                    targets.row.len(),
                    targets.position.len()
                ),
            ));
        }
        self.check_tokens(&targets.token, &|| "targets".to_owned())?;
        for (r, row) in rows.iter().enumerate() {
            row.validate(r).map_err(|e| Error::invalid("batch:", e.to_string()))?;
            self.check_tokens(&row.tokens, &|| format!("packed row {r}"))?;
        }
        let real_positions: usize = rows.iter().map(PackedRow::len).sum();
        if real_positions == 0 {
            return Err(Error::invalid("rows", "hold no positions"));
        }
        // Attended whole, every row is padded to the longest (token 0 at position 0,
        // attending only to itself; no target reads it).
        let longest = rows.iter().map(PackedRow::len).max().unwrap_or(0);
        let whole = self.batched_attention
            && rows.len().saturating_mul(longest).saturating_mul(longest).saturating_mul(4)
                <= BATCHED_MASK_BYTES;
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut plans = Vec::with_capacity(rows.len());
        let mut offsets = Vec::with_capacity(rows.len());
        for row in rows {
            offsets.push(tokens.len() as u32);
            tokens.extend_from_slice(&row.tokens);
            positions.extend_from_slice(&row.positions);
            if whole {
                tokens.resize(tokens.len() + longest - row.len(), 0);
                positions.resize(positions.len() + longest - row.len(), 0);
            } else {
                plans.push((row.len(), segment_plans(row, dev)?));
            }
        }
        let mut index = Vec::with_capacity(n);
        for i in 0..n {
            let (row, pos) = (targets.row[i] as usize, targets.position[i]);
            let Some(r) = rows.get(row) else {
                return Err(Error::invalid(
                    format!("target {i}"),
                    format!("names row {row} of {}", rows.len()),
                ));
            };
            if pos as usize >= r.len() {
                return Err(Error::invalid(
                    format!("target {i}"),
                    format!("names position {pos} of a {}-token row", r.len()),
                ));
            }
            index.push(offsets[row] + pos);
        }
        Ok(ScoringBatch {
            shape: BatchShape::of(cfg),
            device: dev.clone(),
            positions: real_positions,
            ids: RowIndex::new(tokens, dev)?,
            layout: LayerLayout {
                rope: rope_tables(&positions, cfg.head_dim, cfg.rope_theta),
                plans: Arc::new(plans),
                batched: if whole { Some(RowMasks::new(rows, longest, dev)?) } else { None },
            },
            index: RowIndex::new(index, dev)?,
            targets: targets.token.clone(),
        })
    }

    /// Final hidden states (after the last norm) of a prepared batch's concatenated
    /// positions, `[sum of lengths, hidden]`. Base weights record a graph when `grad`
    /// is set; adapters whenever this handle is trainable.
    fn hidden_states(&self, batch: &ScoringBatch, grad: bool) -> Result<Tensor> {
        let m = &self.inner;
        let mut x = self.kernels.gather_rows(&Self::w(&m.embed, grad), &batch.ids)?;
        // Checkpointing only matters where a layer records a graph: through its base
        // weights, or through its adapters.
        let checkpoint = self.checkpoint_layers && (grad || (self.trainable && self.lora.is_some()));
        for li in 0..m.layers.len() {
            x = if checkpoint {
                self.checkpointed_layer(li, &x, &batch.layout, grad)?
            } else {
                self.layer(li, &x, &batch.layout, grad)?
            };
        }
        self.kernels.rms_norm(&x, &Self::w(&m.norm, grad), m.cfg.rms_norm_eps)
    }

    /// Decoder layer `li` on the residual stream `x: [positions, hidden]`; base
    /// weights record a graph when `grad` is set, adapters when this handle is
    /// trainable.
    fn layer(&self, li: usize, x: &Tensor, layout: &LayerLayout, grad: bool) -> Result<Tensor> {
        if let Some(y) = self.host_layer(li, x, layout, grad)? {
            return Ok(y);
        }
        let m = &self.inner;
        let cfg = &m.cfg;
        let l = &m.layers[li];
        let n = x.dim(0)?;
        let rope = &layout.rope;
        let (h, kvh, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let ks = self.kernels;
        let w = |v: &Var| Self::w(v, grad);
        let wo = |v: &Option<Var>| v.as_ref().map(|v| Self::w(v, grad));
        // A projection, plus its adapter's low-rank term when it has one (the
        // frozen base then through `Kernels::frozen_linear`, which skips its
        // gradient where it can).
        let proj = |p: Projection, x: &Tensor, bias: &Option<Var>| -> Result<Tensor> {
            self.add_adapter(li, p, x, self.base_linear(x, &w(l.weight(p)), wo(bias).as_ref())?)
        };
        let a = ks.rms_norm(x, &w(&l.input_norm), cfg.rms_norm_eps)?;
        let q = proj(Projection::Q, &a, &l.q_bias)?.reshape((n, h, hd))?;
        let k = proj(Projection::K, &a, &l.k_bias)?.reshape((n, kvh, hd))?;
        let v = proj(Projection::V, &a, &l.v_bias)?.reshape((n, kvh, hd))?;
        let q = ks.rope(&q, rope)?;
        let k = ks.rope(&k, rope)?;
        let att = match &layout.batched {
            Some(masks) => ks.row_attention(&q, &k, &v, masks)?,
            None => ks.segment_attention(&q, &k, &v, &layout.plans)?,
        };
        let x = (x + proj(Projection::O, &att, &None)?)?;
        let b = ks.rms_norm(&x, &w(&l.post_norm), cfg.rms_norm_eps)?;
        let gu = ks.swiglu_train(&proj(Projection::Gate, &b, &None)?, &proj(Projection::Up, &b, &None)?)?;
        Ok((&x + proj(Projection::Down, &gu, &None)?)?)
    }

    /// [`Model::layer`] as one computation on host buffers ([`crate::ops::layer_forward`],
    /// one graph node whose backward is [`crate::ops::layer_backward`]) where the
    /// kernels run whole layers ([`Kernels::runs_whole_layers`]): the plain f32 layer
    /// on the CPU, without adapters or biases, attended per segment. `None` otherwise,
    /// for the composed ops.
    fn host_layer(&self, li: usize, x: &Tensor, layout: &LayerLayout, grad: bool) -> Result<Option<Tensor>> {
        let m = &self.inner;
        let l = &m.layers[li];
        if !self.kernels.runs_whole_layers()
            || self.lora.is_some()
            || layout.batched.is_some()
            || [&l.q_bias, &l.k_bias, &l.v_bias].iter().any(|b| b.is_some())
            || x.dtype() != DType::F32
            || l.q.dtype() != DType::F32
            || !x.device().is_cpu()
        {
            return Ok(None);
        }
        let cfg = &m.cfg;
        let x = x.contiguous()?;
        let shape = LayerShape {
            n: x.dim(0)?,
            hidden: cfg.hidden_size,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            hd: cfg.head_dim,
            inter: cfg.intermediate_size,
            eps: cfg.rms_norm_eps as f32,
        };
        let keep = grad || x.track_op();
        let (y, saved) = with_layer(l, &x, |w, x| {
            layer_forward(shape, w, x, &layout.rope, &layout.plans, &m.buffers, keep)
        })??;
        let y = Tensor::from_vec(y, x.shape(), x.device())?;
        let Some(saved) = saved else { return Ok(Some(y)) };
        let (links, anchor) = if grad {
            l.links.get(|| l.vars().into_iter().cloned().collect(), self.device())?
        } else {
            Links::new(Vec::new(), self.device())?
        };
        let (model, layout) = (self.clone(), layout.clone());
        let backward = move |x: &Tensor,
                             anchor: &Tensor,
                             dy: &Tensor|
              -> Result<(Option<Tensor>, Option<Tensor>)> {
            let l = &model.inner.layers[li];
            let dy = dy.contiguous()?;
            let (dx, dws) = with_layer(l, x, |w, x| {
                read_host(&dy, |dy| layer_backward(shape, w, x, &layout.rope, &layout.plans, &saved, dy))
            })???;
            if grad {
                let dws =
                    dws.into_iter().zip(l.vars()).map(|(g, v)| Tensor::from_vec(g, v.shape(), v.device()));
                links.hand(dws.collect::<candle_core::Result<Vec<_>>>()?);
            }
            let dx = if x.track_op() { Some(Tensor::from_vec(dx, x.shape(), x.device())?) } else { None };
            Ok((dx, Some(anchor.zeros_like()?)))
        };
        Ok(Some(attach(
            "host-layer",
            &x,
            &anchor,
            y,
            Box::new(move |x, anchor, dy| backward(x, anchor, dy).map_err(candle_core::Error::wrap)),
        )?))
    }

    /// [`Model::layer`] with gradient checkpointing: the forward runs without a graph
    /// (nothing inside the layer is kept), and one node attaches its output to the
    /// layer's input and to the weights that train (chained by [`Links`]); its backward
    /// runs the layer again, from a copy of the input, under a graph of its own,
    /// differentiates that and hands the weights their gradients. The recomputed
    /// forward is the same ops on the same values, so the gradients are those of
    /// [`Model::layer`].
    fn checkpointed_layer(&self, li: usize, x: &Tensor, layout: &LayerLayout, grad: bool) -> Result<Tensor> {
        let graphless = Self { trainable: false, ..self.clone() };
        let value = graphless.layer(li, &x.detach(), layout, false)?;
        let (links, anchor) = Links::new(self.layer_vars(li, grad), self.device())?;
        let (model, layout) = (self.clone(), layout.clone());
        let backward =
            move |x: &Tensor, anchor: &Tensor, dy: &Tensor| -> Result<(Option<Tensor>, Option<Tensor>)> {
                let input = if x.track_op() { Some(Var::from_tensor(&x.detach())?) } else { None };
                let x = input.as_ref().map_or_else(|| x.detach(), |v| v.as_tensor().clone());
                let y = model.layer(li, &x, &layout, grad)?;
                let mut grads = (y * dy)?.sum_all()?.backward()?;
                links.deliver(&mut grads);
                // Detached, as the weights' gradients are ([`Links::deliver`]).
                let dx = input.and_then(|v| grads.remove(v.as_tensor())).map(|g| g.detach());
                Ok((dx, Some(anchor.zeros_like()?)))
            };
        attach(
            "checkpointed-layer",
            x,
            &anchor,
            value,
            Box::new(move |x, anchor, dy| backward(x, anchor, dy).map_err(candle_core::Error::wrap)),
        )
    }

    /// The variables of layer `li` that record gradients in this handle: its base
    /// weights when `grad` is set, its adapters when this handle is trainable.
    fn layer_vars(&self, li: usize, grad: bool) -> Vec<Var> {
        let l = &self.inner.layers[li];
        let mut vars = Vec::new();
        if grad {
            vars.extend([&l.input_norm, &l.post_norm].into_iter().cloned());
            vars.extend(Projection::ALL.iter().map(|&p| l.weight(p).clone()));
            vars.extend([&l.q_bias, &l.k_bias, &l.v_bias].into_iter().flatten().cloned());
        }
        if self.trainable {
            vars.extend(self.layer_adapter_vars(li));
        }
        vars
    }

    /// The product with a base weight: [`Kernels::frozen_linear`] under adapters (the
    /// base is frozen, and candle's matmul would compute its gradient anyway), else
    /// [`Kernels::linear`].
    fn base_linear(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        if self.lora.is_some() { self.kernels.frozen_linear(x, w, b) } else { self.kernels.linear(x, w, b) }
    }

    /// Whether the base weights record a graph: on a trainable handle without
    /// adapters (with adapters only they train, and the base stays frozen: Hu et al.
    /// 2021, arXiv 2106.09685, §4.1).
    fn base_grad(&self) -> bool {
        self.trainable && self.lora.is_none()
    }

    /// Training forward on packed rows: for each target, the log-prob of its token at
    /// its predicting position and that position's entropy, at temperature 1.
    ///
    /// Only the predicting positions go through the LM head, so at most
    /// `[n_targets, vocab]` logits exist. Differentiable with respect to every
    /// parameter when the model is trainable. `targets.row`, `position` and `token`
    /// are read; the other fields are the trainer's. The same as [`Model::score`] of
    /// [`Model::prepare_batch`] at `temperature = 1`.
    pub fn target_logprobs(&self, rows: &[PackedRow], targets: &Targets) -> Result<TargetOutput> {
        self.score(&self.prepare_batch(rows, targets)?, 1.0)
    }

    /// The forward of [`Model::target_logprobs`] on a prepared batch, with the logits
    /// divided by `temperature` before the log-softmax: the log-prob of each target
    /// under the distribution a sampler at that temperature draws from, and its
    /// entropy. `temperature = 0` (greedy decoding) scores at 1, as the rollout engine
    /// records the log-probs of greedy tokens.
    ///
    /// Errors when the batch was prepared by a model of another vocabulary, head
    /// size, rotary base or device, and for a negative or non-finite temperature.
    pub fn score(&self, batch: &ScoringBatch, temperature: f32) -> Result<TargetOutput> {
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(Error::invalid("temperature", format!("is {temperature}, expected a number >= 0")));
        }
        if batch.shape != BatchShape::of(&self.inner.cfg) || !batch.device.same_device(self.device()) {
            return Err(Error::invalid(
                "scoring batch",
                "was prepared by a model of another vocabulary, head size, rotary base or device",
            ));
        }
        let grad = self.base_grad();
        let inv_temperature = if temperature == 0.0 { 1.0 } else { 1.0 / temperature };
        let head_input = |hidden: Tensor| HeadInput {
            hidden,
            weight: self.lm_head(grad),
            inv_temperature,
            chunk_elements: self.head_chunk.unwrap_or_else(|| self.default_head_chunk()),
        };
        if batch.targets.is_empty() {
            let empty = Tensor::zeros(0, DType::F32, self.device())?;
            let head =
                head_input(Tensor::zeros((0, self.inner.cfg.hidden_size), self.dtype(), self.device())?);
            return Ok(TargetOutput { logprobs: empty.clone(), entropy: empty, head });
        }
        let hidden = self.hidden_states(batch, grad)?;
        let head = head_input(self.kernels.gather_rows(&hidden, &batch.index)?);
        let both = match self.head_chunk {
            Some(elements) => head::linear_logprobs(
                self.kernels,
                &head.hidden,
                &head.weight,
                batch.targets.clone(),
                inv_temperature,
                elements,
            )?,
            None => {
                let logits = self.base_linear(&head.hidden, &head.weight, None)?;
                self.kernels.target_logprobs_entropy(&logits, batch.targets.clone(), inv_temperature)?
            }
        };
        let logprobs = both.narrow(1, 0, 1)?.squeeze(1)?;
        let entropy = both.narrow(1, 1, 1)?.squeeze(1)?;
        Ok(TargetOutput { logprobs, entropy, head })
    }

    /// Plain causal forward for ordinary rows: `tokens: [batch, seq]` (u32) to logits
    /// `[batch, seq, vocab]`. Positions are `0..seq` in every row.
    pub fn forward_logits(&self, tokens: &Tensor) -> Result<Tensor> {
        let (b, s) = tokens.dims2()?;
        let rows: Vec<PackedRow> = tokens
            .to_dtype(DType::U32)?
            .to_vec2::<u32>()?
            .into_iter()
            .map(|t| PackedRow {
                tokens: t,
                positions: (0..s as u32).collect(),
                segments: vec![metronome_core::Segment { start: 0, len: s as u32, parent: None }],
            })
            .collect();
        let batch = self.prepare_batch(&rows, &Targets::default())?;
        let hidden = self.hidden_states(&batch, self.base_grad())?;
        let logits = self.base_linear(&hidden, &self.lm_head(self.base_grad()), None)?;
        Ok(logits.reshape((b, s, self.inner.cfg.vocab_size))?)
    }

    /// Parameters by name, for loaders.
    pub(crate) fn param_map(&self) -> HashMap<String, Var> {
        self.parameters().into_iter().collect()
    }
}
