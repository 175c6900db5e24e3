//! Parallel-aware layers: ordinary Burn modules that hold their local shard and read a
//! per-rank *parallel state* in `forward`.
//!
//! Unsharded (no plan applied, or a tensor-parallel group of one) each layer is exactly the
//! plain layer: [`ParallelLinear`] is `y = x Wᵀ + b` with `weight` `[out, in]` (PyTorch
//! layout) and `bias` `[out]`; [`ParallelEmbedding`] a `[num, d]` table; [`ParallelLayerNorm`]
//! LayerNorm with `weight` and `bias`; [`ParallelRmsNorm`] RMSNorm with `weight`. Their
//! parameter names, shapes and records are those of the unsharded model, so checkpoints load
//! unchanged (load first, then [`crate::parallelize_module`]).
//!
//! ## Where the parallel state lives
//! Burn modules are static types and `#[derive(Module)]` mappers only see parameters, so a
//! plan cannot replace a layer's `forward` or write a field at run time. Each layer instead
//! carries a [`ParallelKey`] — a parameter-less field, unique per constructed layer, kept by
//! `clone`, `fork` and record loading — that announces itself to module visitors and mappers.
//! `parallelize_module` shards the layer's parameters in place (same [`burn::module::ParamId`]s)
//! and records the applied style and process group under that key in a table of the **current
//! thread** (one rank). `forward` looks the key up: no entry means unsharded. Ranks as threads
//! therefore each parallelize their own `fork` of the model on their own thread, which they
//! must do anyway (see the crate docs); a multi-process rank has one thread doing it.

use crate::sequence::{relayout, replicated_param};
use crate::state::{Applied, ParallelKey, ParallelState};
use crate::style::StylePlacement;
use bonfire_comm::ProcessGroup;
use bonfire_dtensor::{chunk_range, functional};
use bonfire_kernels::add_bias;
use burn::module::{Module, Param};
use burn::tensor::{DType, Device, Int, Tensor};

/// `value` as a new leaf, tracked when `like` is.
fn leaf<const D: usize>(value: Tensor<D>, like: &Param<Tensor<D>>) -> Tensor<D> {
    let value = value.detach();
    if like.is_require_grad() {
        value.require_grad()
    } else {
        value
    }
}

fn normal(shape: [usize; 2], device: &Device) -> Tensor<2> {
    bonfire_module::params::normal(shape, 0.0, 0.02, device)
}

/// Records, on this thread, the dtypes a layer's `forward` computes with: its float input
/// and its parameter values (see [`bonfire_module::precision::observe`]).
fn observe<const N: usize>(input: Option<DType>, params: [Option<DType>; N]) {
    let record = bonfire_module::precision::observe::observer();
    input.into_iter().for_each(|d| record.activation(d));
    params.into_iter().flatten().for_each(|d| record.param(d));
}

// ---------------------------------------------------------------------------------------
// Linear
// ---------------------------------------------------------------------------------------

/// `y = x Wᵀ + b` with `weight` `[out, in]` and optional `bias` `[out]` — column-wise,
/// row-wise or unsharded (see the module docs and [`ColwiseParallel`], [`RowwiseParallel`]).
#[derive(Module, Debug)]
pub struct ParallelLinear {
    /// `[out, in]`, or this rank's shard: `[out / tp, in]` column-wise, `[out, in / tp]`
    /// row-wise.
    pub weight: Param<Tensor<2>>,
    /// `[out]` (`[out / tp]` column-wise), if the layer has a bias.
    pub bias: Option<Param<Tensor<1>>>,
    /// This layer's identity, under which its parallel state is recorded.
    pub key: ParallelKey,
}

impl ParallelLinear {
    /// Normal(0, 0.02) weights and zero bias (GPT-2's initialization).
    pub fn new(d_in: usize, d_out: usize, bias: bool, device: &Device) -> Self {
        Self {
            weight: Param::from_tensor(normal([d_out, d_in], device)),
            bias: bias.then(|| Param::from_tensor(Tensor::zeros([d_out], device))),
            key: ParallelKey::default(),
        }
    }

    /// From a `burn::nn::Linear` (whose weight is `[in, out]`): the same function.
    pub fn from_burn(linear: burn::nn::Linear) -> Self {
        Self {
            weight: Param::from_tensor(leaf(linear.weight.val().transpose(), &linear.weight)),
            bias: linear.bias.map(|b| Param::from_tensor(leaf(b.val(), &b))),
            key: ParallelKey::default(),
        }
    }

    /// `x Wᵀ`; inside a zero-bubble stage's forward the weight gradient is deferred to its
    /// "W" step (see [`bonfire_module::weight_grad`]).
    fn matmul<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        bonfire_module::weight_grad::linear_matmul(x, self.weight.val())
    }

    /// `x Wᵀ + b` with this layer's own bias, if any (one node: see
    /// [`bonfire_module::weight_grad::linear`]).
    fn linear<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let bias = self.bias.as_ref().map(|b| b.val());
        bonfire_module::weight_grad::linear(x, self.weight.val(), bias)
    }

    /// The layer on `x` `[..., in]` (or this rank's input shard, per the applied style).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let bias_dtype = self.bias.as_ref().map(|b| b.val().dtype());
        observe(
            Some(x.dtype()),
            [Some(self.weight.val().dtype()), bias_dtype],
        );
        let Some(state) = self.key.state() else {
            return self.linear(x);
        };
        let g = &state.group;
        match state.applied {
            Applied::Replicate(style) => {
                let x = colwise_input(x, style.input_layout, g);
                let w = replicated_param(self.weight.val(), g);
                let b = self.bias.as_ref().map(|b| replicated_param(b.val(), g));
                bonfire_module::weight_grad::linear(x, w, b)
            }
            Applied::Colwise(style) => {
                let x = colwise_input(x, style.input_layout, g);
                let y = self.linear(x);
                relayout(y, StylePlacement::Shard(-1), style.output_layout, g)
            }
            Applied::Rowwise { style, .. } => {
                let x = relayout(x, style.input_layout, StylePlacement::Shard(-1), g);
                let y = self.matmul(x);
                let sharded = style.output_layout.shard_dim(D).is_some();
                let y = relayout(y, StylePlacement::Partial, style.output_layout, g);
                match &self.bias {
                    Some(b) if sharded => add_bias(y, replicated_param(b.val(), g)),
                    Some(b) => add_bias(y, b.val()),
                    None => y,
                }
            }
            other => panic!("bonfire-dtensor parallel: a ParallelLinear cannot run {other:?}"),
        }
    }

    /// The mean cross-entropy of this layer's output on `x` `[N, in]` against class ids
    /// `targets` `[N]` as one node by blocks of `rows` rows
    /// ([`bonfire_kernels::linear_cross_entropy`]: the `[N, out]` logits never whole), for a
    /// language model's head; `None` where the layer runs a tensor-parallel style or has a
    /// bias (the caller then runs [`Self::forward`] and its loss).
    pub fn cross_entropy(
        &self,
        x: Tensor<2>,
        targets: Tensor<1, Int>,
        rows: usize,
    ) -> Option<Tensor<1>> {
        if self.key.state().is_some() || self.bias.is_some() {
            return None;
        }
        observe(Some(x.dtype()), [Some(self.weight.val().dtype()), None]);
        let weight = self.weight.val().cast(x.dtype());
        Some(bonfire_kernels::linear_cross_entropy(
            x, weight, targets, rows,
        ))
    }

    /// This rank's place `(rank, size)` in the group over which the layer's output features
    /// are split (a column-wise layer), if they are.
    pub fn colwise_shard(&self) -> Option<(usize, usize)> {
        let state = self.key.state()?;
        match state.applied {
            Applied::Colwise(_) => Some((state.group.rank(), state.group.size())),
            _ => None,
        }
    }

    /// The group over which this layer's output `[B, T, out]` is sharded along its last dim (a column-wise
    /// layer with output `Shard(-1)`, e.g. an LM head for [`crate::loss_parallel`]).
    pub fn output_shard_group(&self) -> Option<ProcessGroup> {
        let state = self.key.state()?;
        match state.applied {
            Applied::Colwise(style) if style.output_layout.shard_dim(3) == Some(2) => {
                Some(state.group)
            }
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------------------

/// A lookup table `weight` `[num, d]`: row-wise (Megatron's vocab-parallel embedding),
/// column-wise (by features), sequence-parallel (position tables) or unsharded.
#[derive(Module, Debug)]
pub struct ParallelEmbedding {
    /// The table `[num, d]`, or this rank's shard: `[num / tp, d]` row-wise, `[num, d / tp]`
    /// column-wise.
    pub weight: Param<Tensor<2>>,
    /// This layer's identity, under which its parallel state is recorded.
    pub key: ParallelKey,
}

impl ParallelEmbedding {
    /// Normal(0, 0.02) rows.
    pub fn new(num: usize, d: usize, device: &Device) -> Self {
        Self {
            weight: Param::from_tensor(normal([num, d], device)),
            key: ParallelKey::default(),
        }
    }

    /// From a `burn::nn::Embedding` (same `[num, d]` layout).
    pub fn from_burn(embedding: burn::nn::Embedding) -> Self {
        Self {
            weight: Param::from_tensor(leaf(embedding.weight.val(), &embedding.weight)),
            key: ParallelKey::default(),
        }
    }

    fn lookup(table: Tensor<2>, ids: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = ids.dims();
        let d = table.dims()[1];
        table.select(0, ids.reshape([b * t])).reshape([b, t, d])
    }

    /// Rows for `ids` `[B, T]` → `[B, T, d]` (or this rank's share, per the applied style).
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        observe(None, [Some(self.weight.val().dtype())]);
        let Some(state) = self.key.state() else {
            return Self::lookup(self.weight.val(), ids);
        };
        let g = &state.group;
        match state.applied {
            Applied::Rowwise { style, offset } => {
                let rows = self.weight.dims()[0];
                let in_range = ids
                    .clone()
                    .greater_equal_elem(offset as i64)
                    .bool_and(ids.clone().lower_elem((offset + rows) as i64));
                // Ids owned by another rank read row 0 (masked out below).
                let local = (ids - offset as i64).mask_fill(in_range.clone().bool_not(), 0);
                let rows = Self::lookup(self.weight.val(), local);
                let keep = in_range.float().cast(rows.dtype()).unsqueeze_dim::<3>(2);
                let partial = rows * keep;
                relayout(partial, StylePlacement::Partial, style.output_layout, g)
            }
            Applied::Colwise(style) => {
                let y = Self::lookup(self.weight.val(), ids);
                relayout(y, StylePlacement::Shard(-1), style.output_layout, g)
            }
            Applied::Sequence(_) => Self::lookup(replicated_param(self.weight.val(), g), ids),
            other => panic!("bonfire-dtensor parallel: a ParallelEmbedding cannot run {other:?}"),
        }
    }

    /// The table as a tied output head: `x` `[B, T, d]` → logits `[B, T, num]`, `x Wᵀ` (the
    /// table cast to `x`'s dtype). Vocab-parallel (row-wise), each rank multiplies by its own
    /// rows — the head column-wise over the embedding's shard —, `x` taken as the embedding's
    /// output leaves it (the sequence gathered under sequence parallelism; its gradient, each
    /// rank's from its rows, summed over tp) and the logits all-gathered along the
    /// vocabulary, or kept sharded for loss parallelism (the style's `logits_layout`); the
    /// shard's gradient sums both uses with no collective of its own.
    pub fn tied_head(&self, x: Tensor<3>) -> Tensor<3> {
        observe(Some(x.dtype()), [Some(self.weight.val().dtype())]);
        let table = bonfire_module::tied::table(&self.weight).cast(x.dtype());
        let logits = |x: Tensor<3>| {
            let [b, t, d] = x.dims();
            let v = table.dims()[0];
            bonfire_kernels::matmul(x.reshape([b * t, d]), table.clone().transpose())
                .reshape([b, t, v])
        };
        let Some(state) = self.key.state() else {
            return logits(x);
        };
        let g = &state.group;
        match state.applied {
            Applied::Rowwise { style, .. } => {
                let x = colwise_input(x, style.output_layout, g);
                let y = logits(x);
                relayout(y, StylePlacement::Shard(-1), style.logits_layout, g)
            }
            other => panic!("bonfire-dtensor parallel: a tied head cannot run {other:?}"),
        }
    }

    /// [`Self::tied_head`]'s mean cross-entropy on `x` `[N, d]` against `targets` `[N]` as one
    /// node by blocks of `rows` rows ([`ParallelLinear::cross_entropy`]); `None` where the
    /// embedding runs a tensor-parallel style.
    pub fn tied_cross_entropy(
        &self,
        x: Tensor<2>,
        targets: Tensor<1, Int>,
        rows: usize,
    ) -> Option<Tensor<1>> {
        if self.key.state().is_some() {
            return None;
        }
        observe(Some(x.dtype()), [Some(self.weight.val().dtype())]);
        let table = bonfire_module::tied::table(&self.weight).cast(x.dtype());
        Some(bonfire_kernels::linear_cross_entropy(
            x, table, targets, rows,
        ))
    }

    /// The group over which this embedding's tied-head logits stay sharded along the
    /// vocabulary (a vocab-parallel embedding whose style keeps them `Shard(-1)`: loss
    /// parallelism, [`crate::loss_parallel`]).
    pub fn logits_shard_group(&self) -> Option<ProcessGroup> {
        let state = self.key.state()?;
        match state.applied {
            Applied::Rowwise { style, .. } if style.logits_layout.shard_dim(3) == Some(2) => {
                Some(state.group)
            }
            _ => None,
        }
    }

    /// The rows of the positions of a rank's `t` tokens, `[t, d]`: `0..t`, or its chunks' of
    /// the whole sequence under a context-parallel scope ([`bonfire_cp::positions`]);
    /// under [`SequenceParallel`] this rank's piece of them (`t` must divide evenly), to add
    /// to a sequence-sharded activation.
    pub fn position_rows(&self, t: usize) -> Tensor<2> {
        let positions = bonfire_cp::positions(t);
        let (weight, mine) = match self.key.state() {
            Some(ParallelState {
                group,
                applied: Applied::Sequence(_),
            }) => {
                if let Err(e) = super::sequence::check_divisible(t, group.size(), "sequence length")
                {
                    panic!("bonfire-dtensor parallel: {e}");
                }
                let r = chunk_range(t, group.size(), group.rank());
                (replicated_param(self.weight.val(), &group), &positions[r])
            }
            _ => (self.weight.val(), &positions[..]),
        };
        // Runs of consecutive positions (one without a context split, two per rank with
        // one), each a slice of the table: no index crosses from the host.
        let mut rows = Vec::new();
        let mut start = 0;
        for i in 1..=mine.len() {
            if i == mine.len() || mine[i] != mine[i - 1] + 1 {
                rows.push(weight.clone().narrow(0, mine[start], i - start));
                start = i;
            }
        }
        // Concatenated even when there is one run, so that every cp rank records the same
        // ops: a rank whose two chunks are adjacent (one run) would otherwise differ from the
        // others and, under Balanced checkpointing (ZeRO-3), decide differently whether
        // backward recomputes — re-gathers — the table: a collective mismatch on dp × cp.
        Tensor::cat(rows, 0)
    }
}

// ---------------------------------------------------------------------------------------
// Norms
// ---------------------------------------------------------------------------------------

/// The weight (and bias) as used in forward: all-reduced in backward under sequence
/// parallelism, where each rank sees only its positions.
fn norm_param<const D: usize>(key: &ParallelKey, p: Tensor<1>) -> Tensor<D> {
    match key.state() {
        Some(ParallelState {
            group,
            applied: Applied::Sequence(_),
        }) => replicated_param(p, &group).unsqueeze::<D>(),
        _ => p.unsqueeze::<D>(),
    }
}

/// The input of a column-wise (or replicated) linear laid out as `layout`, made whole for the
/// local matmul: a replicated input passes (its gradient all-reduced in backward); a
/// sequence shard is all-gathered — the local matmul's gradient is partial, so backward
/// reduce-scatters it — marked recomputable: under Burn's Balanced checkpointing the gathered
/// input is re-gathered in backward instead of kept (Megatron's SP memory).
fn colwise_input<const D: usize>(
    x: Tensor<D>,
    layout: StylePlacement,
    g: &ProcessGroup,
) -> Tensor<D> {
    match layout {
        StylePlacement::Replicate => functional::copy_to_group(x, g),
        layout => {
            let d = layout.shard_dim(D).expect("validated");
            let sizes = vec![x.dims()[d]; g.size()];
            functional::all_gather_recomputable(x, g, d, &sizes).expect("valid dim")
        }
    }
}

/// LayerNorm over the last dim: biased variance, `eps` (1e-5 by default), then `weight` and
/// `bias`. Position-wise, so [`SequenceParallel`] runs it on a sequence shard. The
/// normalization is one fused node ([`bonfire_kernels::fused::layer_norm_core`], keeping `x̂`
/// and a `rstd` a row) where bonfire-kernels fuses the type on the device (f32; 16-bit on
/// CubeCL), else Burn's ops.
#[derive(Module, Debug)]
pub struct ParallelLayerNorm {
    /// The scale `[d]` (replicated).
    pub weight: Param<Tensor<1>>,
    /// The shift `[d]` (replicated).
    pub bias: Param<Tensor<1>>,
    /// This layer's identity, under which its parallel state is recorded.
    pub key: ParallelKey,
    eps: f64,
}

impl ParallelLayerNorm {
    /// The default epsilon added to the variance.
    pub const EPS: f64 = 1e-5;

    /// Unit weight, zero bias, eps 1e-5.
    pub fn new(d: usize, device: &Device) -> Self {
        Self {
            weight: Param::from_tensor(Tensor::ones([d], device)),
            bias: Param::from_tensor(Tensor::zeros([d], device)),
            key: ParallelKey::default(),
            eps: Self::EPS,
        }
    }

    /// The same layer adding `eps` to the variance.
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// The normalized `x` `[..., d]`, same shape (a sequence shard under [`SequenceParallel`]).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let params = [&self.weight, &self.bias].map(|p| Some(p.val().dtype()));
        observe(Some(x.dtype()), params);
        let normed = match bonfire_kernels::fused::takes(&x) {
            true => bonfire_kernels::fused::layer_norm_core(x, self.eps),
            false => {
                let (var, mean) = x.clone().var_mean_bias(D - 1);
                (x - mean) / (var + self.eps).sqrt()
            }
        };
        normed * norm_param::<D>(&self.key, self.weight.val())
            + norm_param::<D>(&self.key, self.bias.val())
    }
}

/// RMSNorm over the last dim: `x / sqrt(mean(x²) + eps) · weight`; the normalization one
/// fused node ([`bonfire_kernels::fused::rms_norm_core`]) where bonfire-kernels fuses the type
/// on the device (f32; 16-bit on CubeCL), else Burn's ops.
#[derive(Module, Debug)]
pub struct ParallelRmsNorm {
    /// The scale `[d]` (replicated).
    pub weight: Param<Tensor<1>>,
    /// This layer's identity, under which its parallel state is recorded.
    pub key: ParallelKey,
    eps: f64,
}

impl ParallelRmsNorm {
    /// Unit weight, eps 1e-5.
    pub fn new(d: usize, device: &Device) -> Self {
        Self {
            weight: Param::from_tensor(Tensor::ones([d], device)),
            key: ParallelKey::default(),
            eps: 1e-5,
        }
    }

    /// The same layer adding `eps` to the mean square.
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// The normalized `x` `[..., d]`, same shape (a sequence shard under [`SequenceParallel`]).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        observe(Some(x.dtype()), [Some(self.weight.val().dtype())]);
        let normed = match bonfire_kernels::fused::takes(&x) {
            true => bonfire_kernels::fused::rms_norm_core(x, self.eps),
            false => {
                let rms = (x.clone().powi_scalar(2).mean_dim(D - 1) + self.eps).sqrt();
                x / rms
            }
        };
        normed * norm_param::<D>(&self.key, self.weight.val())
    }
}

// ---------------------------------------------------------------------------------------
// Module input / output
// ---------------------------------------------------------------------------------------

/// The hook point of [`PrepareModuleInput`] / [`PrepareModuleOutput`]: a parameter-less
/// field a module calls at the start (`input`) and end (`output`) of its `forward`. Identity
/// unless a plan prepares the module that holds it.
#[derive(Module, Debug, Default)]
pub struct ParallelIo {
    /// This hook's identity, under which the prepared layouts are recorded.
    pub key: ParallelKey,
}

impl ParallelIo {
    /// A hook with a fresh key (identity until a plan prepares it).
    pub fn new() -> Self {
        Self::default()
    }

    /// The module's input, re-laid out per its [`PrepareModuleInput`].
    pub fn input<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match self.key.state() {
            Some(ParallelState {
                group,
                applied: Applied::Io { input: Some(p), .. },
            }) => relayout(x, p.input_layout, p.desired_input_layout, &group),
            _ => x,
        }
    }

    /// The module's output, re-laid out per its [`PrepareModuleOutput`].
    pub fn output<const D: usize>(&self, y: Tensor<D>) -> Tensor<D> {
        match self.key.state() {
            Some(ParallelState {
                group,
                applied: Applied::Io {
                    output: Some(p), ..
                },
            }) => relayout(y, p.output_layout, p.desired_output_layout, &group),
            _ => y,
        }
    }
}
