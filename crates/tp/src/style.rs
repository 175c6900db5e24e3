//! Parallel styles: how one module is split over the ranks of a tensor-parallel group, like
//! `torch.distributed.tensor.parallel`'s `ColwiseParallel`, `RowwiseParallel`,
//! `SequenceParallel`, `PrepareModuleInput` and `PrepareModuleOutput`.
//!
//! A style is data ([`crate::assign`] checks it against a module): [`crate::parallelize_module`] validates it against the module it
//! is applied to, shards that module's parameters and records the style as the layer's
//! parallel state; the parallel-aware layers ([`crate::ParallelLinear`], …) read that
//! state in `forward`.

use bonfire_dtensor::Placement;

/// A [`Placement`] as a parallel style states it: how an activation of any rank lies over
/// the style's tensor-parallel group (one mesh axis), before the activation exists — so
/// `Shard(d)` counts dims from the front when `d ≥ 0` and from the back when `d < 0`
/// (`Shard(-1)` is the last dim, `Shard(1)` the sequence dim of a `[B, T, d]` activation).
/// The gradient convention is Megatron's: the gradient of a `Replicate` activation is the
/// full gradient on every rank; a `Partial` activation holds one summand per rank (always a
/// sum). [`StylePlacement::placement`] is the DTensor placement it means for an activation of
/// a given rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StylePlacement {
    /// Every rank holds the whole activation.
    Replicate,
    /// Each rank holds its torch.chunk piece along this dim (negative: counted from the back).
    Shard(isize),
    /// Each rank holds one summand; the activation is their sum.
    Partial,
}

impl StylePlacement {
    /// The sharded dim of a rank-`rank` activation, if sharded.
    pub fn shard_dim(&self, rank: usize) -> Option<usize> {
        match *self {
            StylePlacement::Shard(d) if d < 0 => Some((rank as isize + d) as usize),
            StylePlacement::Shard(d) => Some(d as usize),
            _ => None,
        }
    }

    /// The [`Placement`] this means for a rank-`rank` activation.
    pub fn placement(&self, rank: usize) -> Placement {
        match *self {
            StylePlacement::Replicate => Placement::Replicate,
            StylePlacement::Shard(_) => Placement::Shard(self.shard_dim(rank).expect("a shard")),
            StylePlacement::Partial => Placement::PARTIAL_SUM,
        }
    }

    /// Whether the two placements are the same for a rank-`rank` activation (`Shard(-1)` and
    /// `Shard(2)` are the same for rank 3).
    pub fn same_as(&self, other: &StylePlacement, rank: usize) -> bool {
        match (self, other) {
            (StylePlacement::Shard(_), StylePlacement::Shard(_)) => {
                self.shard_dim(rank) == other.shard_dim(rank)
            }
            _ => self == other,
        }
    }
}

/// Shards a `ParallelLinear` by output features (weight `[out, in]` by rows, bias with it), or
/// a `ParallelEmbedding` by embedding features. No communication in forward unless the
/// layouts ask for it: a `Replicate` input is used as is (its gradient is all-reduced in
/// backward), a `Shard(d)` input (sequence parallelism) is all-gathered along `d`; the output
/// is `Shard(-1)` (each rank its features) or `Replicate` (all-gathered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColwiseParallel {
    /// StylePlacement of the input the layer receives: `Replicate` (default) or `Shard(d)` on the
    /// sequence; an embedding's ids must be `Replicate`.
    pub input_layout: StylePlacement,
    /// StylePlacement of the output: `Shard(-1)` (default, each rank its features) or `Replicate`.
    pub output_layout: StylePlacement,
    /// Bonfire layers always return local Burn tensors (static types): `true` is the only
    /// accepted value; `false` is rejected by validation with a pointer to
    /// [`crate::DTensor::from_local`].
    pub use_local_output: bool,
}

impl Default for ColwiseParallel {
    fn default() -> Self {
        Self {
            input_layout: StylePlacement::Replicate,
            output_layout: StylePlacement::Shard(-1),
            use_local_output: true,
        }
    }
}

impl ColwiseParallel {
    /// The same style taking its input in `layout`.
    pub fn input_layout(mut self, layout: StylePlacement) -> Self {
        self.input_layout = layout;
        self
    }
    /// The same style handing its output back in `layout`.
    pub fn output_layout(mut self, layout: StylePlacement) -> Self {
        self.output_layout = layout;
        self
    }
    /// The same style with [`ColwiseParallel::use_local_output`] set to `yes`.
    pub fn use_local_output(mut self, yes: bool) -> Self {
        self.use_local_output = yes;
        self
    }
}

/// Shards a `ParallelLinear` by input features (weight `[out, in]` by columns, bias
/// replicated), or a `ParallelEmbedding` by vocabulary rows (Megatron's vocab-parallel
/// embedding: ids outside a rank's rows give zeros). The local result is a partial sum,
/// reduced by the output layout: `Replicate` → one all-reduce, `Shard(d)` (sequence
/// parallelism) → one reduce-scatter along `d`. The input is `Shard(-1)` (the output of a
/// column-wise layer) or `Replicate` (split locally, no communication).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowwiseParallel {
    /// StylePlacement of the input the layer receives: `Shard(-1)` (default) or `Replicate`; an
    /// embedding's ids must be `Replicate`.
    pub input_layout: StylePlacement,
    /// StylePlacement of the reduced output: `Replicate` (default, all-reduce) or `Shard(1)`
    /// (reduce-scatter along the sequence).
    pub output_layout: StylePlacement,
    /// As for [`ColwiseParallel::use_local_output`].
    pub use_local_output: bool,
    /// A vocab-parallel embedding used as a tied head
    /// ([`ParallelEmbedding::tied_head`](crate::ParallelEmbedding::tied_head)): its logits
    /// `Replicate` (default, all-gathered along the vocabulary) or `Shard(-1)` (kept sharded
    /// for loss parallelism).
    pub logits_layout: StylePlacement,
}

impl Default for RowwiseParallel {
    fn default() -> Self {
        Self {
            input_layout: StylePlacement::Shard(-1),
            output_layout: StylePlacement::Replicate,
            use_local_output: true,
            logits_layout: StylePlacement::Replicate,
        }
    }
}

impl RowwiseParallel {
    /// The same style taking its input in `layout`.
    pub fn input_layout(mut self, layout: StylePlacement) -> Self {
        self.input_layout = layout;
        self
    }
    /// The same style handing its output back in `layout`.
    pub fn output_layout(mut self, layout: StylePlacement) -> Self {
        self.output_layout = layout;
        self
    }
    /// The same style with [`RowwiseParallel::use_local_output`] set to `yes`.
    pub fn use_local_output(mut self, yes: bool) -> Self {
        self.use_local_output = yes;
        self
    }
    /// The Megatron vocab-parallel embedding: `RowwiseParallel` with a replicated input
    /// (token ids) and the given output layout (`Replicate`, or `Shard(1)` to enter a
    /// sequence-parallel region with a reduce-scatter).
    pub fn vocab_embedding(output_layout: StylePlacement) -> Self {
        Self {
            input_layout: StylePlacement::Replicate,
            output_layout,
            ..Self::default()
        }
    }
    /// The same style with a tied head's logits in `layout` (see
    /// [`RowwiseParallel::logits_layout`]).
    pub fn logits_layout(mut self, layout: StylePlacement) -> Self {
        self.logits_layout = layout;
        self
    }
}

/// Keeps a `ParallelLinear` whole on every rank of the group: for a projection each rank
/// needs only part of the output of — grouped-query attention's key/value projections when
/// tp exceeds the key/value heads (each rank uses the heads its query heads attend with).
/// The input is prepared as a column-wise layer's (a replicated input's gradient
/// all-reduced in backward, a sequence-sharded one all-gathered); the output is whole
/// (`Replicate`); the weight's gradient, which each rank computes from the part of the output
/// it used, is summed over the group in backward, so every rank holds the full gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicateParallel {
    /// How the input arrives: `Replicate` or sharded along the sequence (`Shard(1)`).
    pub input_layout: StylePlacement,
}

impl Default for ReplicateParallel {
    fn default() -> Self {
        Self {
            input_layout: StylePlacement::Replicate,
        }
    }
}

impl ReplicateParallel {
    /// The same style with input `layout`.
    pub fn input_layout(mut self, layout: StylePlacement) -> Self {
        self.input_layout = layout;
        self
    }
}

/// Sequence parallelism for a module with replicated parameters that works position-wise
/// (LayerNorm, RMSNorm, a position embedding): its input and output are sharded along the
/// sequence dim (`seq_dim`, 1 for `[B, T, d]`), no communication in forward; the parameters'
/// gradients, partial per rank, are all-reduced in backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceParallel {
    /// The sequence dim the input and output are sharded along (default 1).
    pub seq_dim: usize,
}

impl Default for SequenceParallel {
    fn default() -> Self {
        Self { seq_dim: 1 }
    }
}

/// Re-lays the input of a module out before its forward: applied to a module that has a
/// [`crate::ParallelIo`] child (or to that child), whose `input` call converts
/// `input_layout` to `desired_input_layout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrepareModuleInput {
    /// StylePlacement the input arrives in.
    pub input_layout: StylePlacement,
    /// StylePlacement the module's forward gets it in (not `Partial`).
    pub desired_input_layout: StylePlacement,
}

/// Re-lays the output of a module out after its forward (the `output` call of its
/// [`crate::ParallelIo`] child).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrepareModuleOutput {
    /// StylePlacement the module's forward produces its output in.
    pub output_layout: StylePlacement,
    /// StylePlacement the output is handed on in (not `Partial`).
    pub desired_output_layout: StylePlacement,
}

/// Any of the styles, as stored in a [`crate::ParallelPlan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParallelStyle {
    /// Split by output features ([`ColwiseParallel`]).
    Colwise(ColwiseParallel),
    /// Split by input features or vocabulary rows ([`RowwiseParallel`]).
    Rowwise(RowwiseParallel),
    /// Replicated parameters on a sequence-sharded activation ([`SequenceParallel`]).
    Sequence(SequenceParallel),
    /// A linear kept whole, its weight's partial gradients summed ([`ReplicateParallel`]).
    Replicate(ReplicateParallel),
    /// Re-lays a module's input out ([`PrepareModuleInput`]).
    PrepareInput(PrepareModuleInput),
    /// Re-lays a module's output out ([`PrepareModuleOutput`]).
    PrepareOutput(PrepareModuleOutput),
}

impl ParallelStyle {
    /// The style's name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            ParallelStyle::Colwise(_) => "ColwiseParallel",
            ParallelStyle::Rowwise(_) => "RowwiseParallel",
            ParallelStyle::Sequence(_) => "SequenceParallel",
            ParallelStyle::Replicate(_) => "ReplicateParallel",
            ParallelStyle::PrepareInput(_) => "PrepareModuleInput",
            ParallelStyle::PrepareOutput(_) => "PrepareModuleOutput",
        }
    }
}
