//! Parallel styles: how one module is split over the ranks of a tensor-parallel group, like
//! `torch.distributed.tensor.parallel`'s `ColwiseParallel`, `RowwiseParallel`,
//! `SequenceParallel`, `PrepareModuleInput` and `PrepareModuleOutput`.
//!
//! A style is data: [`crate::parallelize_module`] validates it against the module it
//! is applied to, shards that module's parameters and records the style as the layer's
//! parallel state; the parallel-aware layers ([`crate::ParallelLinear`], …) read that
//! state in `forward`.

use super::layers::{Applied, LayerKind};
use super::plan::{Assignment, ParallelError, Site};
use bonfire_dtensor::{Placement, chunk_range};

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
}

impl Default for RowwiseParallel {
    fn default() -> Self {
        Self {
            input_layout: StylePlacement::Shard(-1),
            output_layout: StylePlacement::Replicate,
            use_local_output: true,
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
            use_local_output: true,
        }
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

    /// Checks the input layout of the linear at `site`.
    fn assign(&self, site: &Site) -> Result<Assignment, ParallelError> {
        if self.input_layout == StylePlacement::Partial || self.input_layout.shard_dim(3) == Some(2)
        {
            return Err(site.layout_error(format!(
                "input layout {:?}: a replicated layer takes a replicated or sequence-sharded \
                 input",
                self.input_layout
            )));
        }
        Ok(Assignment {
            kind: LayerKind::Linear,
            applied: Applied::Replicate(*self),
        })
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

    /// Checks the style fits the matched module at `site`; the path of the layer it applies to
    /// (the module, or its `ParallelIo`) and that layer's assignment.
    pub(super) fn assign(&self, site: &Site) -> Result<(String, Assignment), ParallelError> {
        let at_site = |assignment| Ok((site.path().to_string(), assignment));
        match (self, site.kind()) {
            (Self::Colwise(s), Some(k @ (LayerKind::Linear | LayerKind::Embedding))) => {
                at_site(s.assign(site, k)?)
            }
            (Self::Rowwise(s), Some(k @ (LayerKind::Linear | LayerKind::Embedding))) => {
                at_site(s.assign(site, k)?)
            }
            (Self::Sequence(s), Some(k @ (LayerKind::Norm | LayerKind::Embedding))) => {
                at_site(s.assign(k))
            }
            (Self::Replicate(s), Some(LayerKind::Linear)) => at_site(s.assign(site)?),
            (Self::PrepareInput(p), _) => p.assign(site),
            (Self::PrepareOutput(p), _) => p.assign(site),
            _ => Err(site.wrong_module()),
        }
    }
}

/// Column- and row-wise layers both hand back local Burn tensors: an error unless
/// `use_local_output`.
fn require_local_output(site: &Site, use_local_output: bool) -> Result<(), ParallelError> {
    if use_local_output {
        Ok(())
    } else {
        Err(site.layout_error(
            "use_local_output = false: Bonfire layers return local Burn tensors; \
             wrap the output with DTensor::from_local instead",
        ))
    }
}

impl ColwiseParallel {
    /// Checks the layouts and the split dim of the linear or embedding (`kind`) at `site`.
    fn assign(&self, site: &Site, kind: LayerKind) -> Result<Assignment, ParallelError> {
        require_local_output(site, self.use_local_output)?;
        if kind == LayerKind::Linear {
            site.weight_len(0, "out_features")?;
            if self.input_layout == StylePlacement::Partial
                || self.input_layout.shard_dim(3) == Some(2)
            {
                return Err(site.layout_error(format!(
                    "input layout {:?}: a column-wise layer takes a replicated or \
                     sequence-sharded input",
                    self.input_layout
                )));
            }
        } else {
            site.weight_len(1, "embedding dim")?;
            if self.input_layout != StylePlacement::Replicate {
                return Err(site.layout_error("an embedding's ids must be Replicate"));
            }
        }
        if self.output_layout == StylePlacement::Partial {
            return Err(site.layout_error("output layout Partial: use Replicate or Shard"));
        }
        Ok(Assignment {
            kind,
            applied: Applied::Colwise(*self),
        })
    }
}

impl RowwiseParallel {
    /// Checks the layouts and the split dim of the linear or embedding (`kind`) at `site`; an
    /// embedding also gets the first vocabulary row this rank holds.
    fn assign(&self, site: &Site, kind: LayerKind) -> Result<Assignment, ParallelError> {
        require_local_output(site, self.use_local_output)?;
        if self.output_layout == StylePlacement::Partial
            || self.output_layout.shard_dim(3) == Some(2)
        {
            return Err(site.layout_error(format!(
                "output layout {:?}: a row-wise layer's output is Replicate or \
                 sharded on the sequence (Shard(1))",
                self.output_layout
            )));
        }
        let offset = if kind == LayerKind::Linear {
            site.weight_len(1, "in_features")?;
            if self.input_layout == StylePlacement::Partial {
                return Err(site.layout_error("input layout Partial"));
            }
            0
        } else {
            let rows = site.weight_len(0, "vocabulary size")?;
            if self.input_layout != StylePlacement::Replicate {
                return Err(site.layout_error("an embedding's ids must be Replicate"));
            }
            chunk_range(rows, site.parts, site.rank).start
        };
        Ok(Assignment {
            kind,
            applied: Applied::Rowwise {
                style: *self,
                offset,
            },
        })
    }
}

impl SequenceParallel {
    /// The assignment of a norm or embedding (`kind`): nothing to check.
    fn assign(&self, kind: LayerKind) -> Assignment {
        Assignment {
            kind,
            applied: Applied::Sequence(*self),
        }
    }
}

impl PrepareModuleInput {
    /// Checks the desired layout; the `ParallelIo` of the module at `site`, preparing this
    /// input and any output an earlier entry prepared there.
    fn assign(&self, site: &Site) -> Result<(String, Assignment), ParallelError> {
        let io = site.io_path()?;
        let (_, output) = site.held_io(&io);
        if self.desired_input_layout == StylePlacement::Partial {
            return Err(site.layout_error("desired input layout Partial"));
        }
        Ok((io, io_assignment(Some(*self), output)))
    }
}

impl PrepareModuleOutput {
    /// Checks the desired layout; the `ParallelIo` of the module at `site`, preparing this
    /// output and any input an earlier entry prepared there.
    fn assign(&self, site: &Site) -> Result<(String, Assignment), ParallelError> {
        let io = site.io_path()?;
        let (input, _) = site.held_io(&io);
        if self.desired_output_layout == StylePlacement::Partial {
            return Err(site.layout_error("desired output layout Partial"));
        }
        Ok((io, io_assignment(input, Some(*self))))
    }
}

/// The assignment of a `ParallelIo` preparing `input` and `output`.
fn io_assignment(
    input: Option<PrepareModuleInput>,
    output: Option<PrepareModuleOutput>,
) -> Assignment {
    Assignment {
        kind: LayerKind::Io,
        applied: Applied::Io { input, output },
    }
}

impl From<ColwiseParallel> for ParallelStyle {
    fn from(s: ColwiseParallel) -> Self {
        ParallelStyle::Colwise(s)
    }
}
impl From<RowwiseParallel> for ParallelStyle {
    fn from(s: RowwiseParallel) -> Self {
        ParallelStyle::Rowwise(s)
    }
}
impl From<SequenceParallel> for ParallelStyle {
    fn from(s: SequenceParallel) -> Self {
        ParallelStyle::Sequence(s)
    }
}
impl From<ReplicateParallel> for ParallelStyle {
    fn from(s: ReplicateParallel) -> Self {
        ParallelStyle::Replicate(s)
    }
}
impl From<PrepareModuleInput> for ParallelStyle {
    fn from(s: PrepareModuleInput) -> Self {
        ParallelStyle::PrepareInput(s)
    }
}
impl From<PrepareModuleOutput> for ParallelStyle {
    fn from(s: PrepareModuleOutput) -> Self {
        ParallelStyle::PrepareOutput(s)
    }
}
