//! Differentiable collectives on Burn tensors.
//!
//! Every collective is one Burn backend-extension operation ([`CollectiveBackend`]) whose
//! argument, a [`CollectiveSpec`], says which call to make on which [`ProcessGroup`]. The
//! concrete backends (`Flex`, and `Cube` behind the `cuda` feature) run the forward; the
//! `Autodiff` implementation records a backward step that runs the *dual* collective on the
//! gradient ([`CollectiveSpec::dual`]). Most users call the functions of [`functional`]
//! (re-exported at the crate root) instead of building specs.
//!
//! Semantics of the gradients: the functional collectives are differentiated as ordinary
//! functions of every rank's local tensors, with the loss being the **sum of the ranks'
//! losses** (the convention of `torch.distributed.nn.functional`). The two Megatron
//! mappings and [`functional::split`] / [`functional::gather`] instead treat the tensor
//! around them as one replicated logical tensor — their backward is not the adjoint of the
//! forward but the conjugate collective, which is what tensor parallelism needs.

mod autodiff;
mod buffers;
pub mod functional;
mod host;
mod ops;
mod shift;

pub use ops::CollectiveBackend;

use bonfire_comm::{ProcessGroup, ReduceOp};

/// Tag bit added to the tag of a differentiable send/recv for the gradient that flows back.
pub const BACKWARD_TAG_BIT: u64 = 1 << 63;

/// What a collective operation does. Sizes are per rank of the group, in elements along `dim`.
#[derive(Debug, Clone, PartialEq)]
pub enum CollectiveKind {
    /// Every rank gets the reduction. Backward: all-reduce (sum) of the gradients — divided
    /// by the size for `Avg`; for `Max` / `Min`, given only to the ranks holding the
    /// extremum, split evenly between ties (like `torch.amax`). `Product` runs only on
    /// tensors that do not require gradients.
    AllReduce {
        /// How the ranks' tensors are combined.
        op: ReduceOp,
    },
    /// Every rank gets `root`'s tensor. Backward: reduce (sum) of the gradients to `root`.
    Broadcast {
        /// Group rank whose tensor every rank receives.
        root: usize,
    },
    /// `root` gets the reduction; the other ranks get **zeros** (so that the output is a
    /// well-defined function of the inputs). Backward: broadcast of `root`'s gradient.
    Reduce {
        /// How the ranks' tensors are combined.
        op: ReduceOp,
        /// Group rank that receives the reduction.
        root: usize,
    },
    /// Concatenation along `dim` of every rank's tensor; rank `r` contributes `sizes[r]`.
    /// Backward: reduce-scatter (sum). A rank whose size is 0 contributes nothing: it may pass
    /// a placeholder of length 1 along `dim`, which is not sent, and gets zeros back as its
    /// gradient.
    AllGather {
        /// Dimension the pieces are concatenated along.
        dim: usize,
        /// Each rank's length along `dim`, indexed by group rank.
        sizes: Vec<usize>,
    },
    /// The input (of `sum(sizes)` along `dim`) is split in rank order; rank `r` gets the
    /// reduction of every rank's piece `r`. Backward: all-gather.
    ReduceScatter {
        /// Dimension the input is split along.
        dim: usize,
        /// Length along `dim` of the piece each rank gets, indexed by group rank.
        sizes: Vec<usize>,
        /// How the ranks' pieces are combined.
        op: ReduceOp,
    },
    /// The input is split along `split_dim` into pieces of `split_sizes`; piece `s` goes to
    /// rank `s`; the pieces received are concatenated along `cat_dim`, the one from rank `r`
    /// having `cat_sizes[r]` elements along it. Backward: the inverse all-to-all.
    AllToAll {
        /// Dimension the input is split along.
        split_dim: usize,
        /// Length along `split_dim` of the piece sent to each rank, indexed by group rank.
        split_sizes: Vec<usize>,
        /// Dimension the received pieces are concatenated along.
        cat_dim: usize,
        /// Length along `cat_dim` of the piece received from each rank, indexed by group rank.
        cat_sizes: Vec<usize>,
    },
    /// Sends the tensor to `dst`; the output is a one-element zero "token" to add to the
    /// loss. Backward: receives the gradient of the tensor from `dst`.
    Send {
        /// Group rank the tensor is sent to.
        dst: usize,
        /// Message tag; the matching [`CollectiveKind::Recv`] must use the same one.
        tag: u64,
    },
    /// Receives a tensor of the input's shape from `src` (the input is only a template).
    /// Backward: sends the gradient back to `src`.
    Recv {
        /// Group rank the tensor is received from.
        src: usize,
        /// Message tag of the matching [`CollectiveKind::Send`].
        tag: u64,
    },
    /// A ring step: every rank sends its tensor to rank `+ offset` and receives, in its
    /// place, the tensor of rank `- offset` (mod the group size; every rank's tensor has the
    /// same shape). Backward: the shift by `-offset`, each gradient going back to the rank
    /// its tensor came from.
    Shift {
        /// How many ranks along the ring the tensors move (1: to the next rank).
        offset: usize,
        /// Message tag.
        tag: u64,
    },
    /// The first half of a [`CollectiveKind::Shift`] that overlaps the caller's computation:
    /// posts this rank's tensor to rank `+ offset` and a receive from rank `- offset` on the
    /// group's send and receive threads, and returns at once — the input itself (`keep`) or
    /// zeros of its shape. The [`CollectiveKind::ShiftFinish`] of the same tag, later on this
    /// thread, takes what arrived. Backward (of the `keep` form): waits for the gradient's
    /// shift back and adds it to the gradient.
    ShiftStart {
        /// How many ranks along the ring the tensors move (1: to the next rank).
        offset: usize,
        /// Message tag, shared with the finishing half.
        tag: u64,
        /// Return the input (forward) rather than zeros (the backward's half).
        keep: bool,
    },
    /// The second half of an overlapped shift: waits for the [`CollectiveKind::ShiftStart`]
    /// of `tag` posted on this thread and returns the tensor received (the input, the start's
    /// output, is a template), or the input plus it (`add`). Backward (of the plain form):
    /// starts the gradient's shift back to the rank its tensor came from.
    ShiftFinish {
        /// The offset of the start (the backward shifts by its opposite).
        offset: usize,
        /// Message tag of the start.
        tag: u64,
        /// Return the input plus the tensor received (the backward's half).
        add: bool,
    },
    /// Megatron's `f`: identity forward, all-reduce (sum) backward.
    CopyToGroup,
    /// Megatron's `g`: all-reduce forward, identity backward (divided by the group size
    /// for `Avg`).
    ReduceFromGroup {
        /// How the ranks' tensors are combined.
        op: ReduceOp,
    },
    /// Keeps this rank's chunk along `dim` (no communication). Backward: all-gather.
    Split {
        /// Dimension the tensor is chunked along.
        dim: usize,
        /// Each rank's chunk length along `dim`, indexed by group rank.
        sizes: Vec<usize>,
    },
    /// All-gather along `dim`. Backward: keeps this rank's chunk of the gradient (no
    /// communication).
    Gather {
        /// Dimension the chunks are concatenated along.
        dim: usize,
        /// Each rank's chunk length along `dim`, indexed by group rank.
        sizes: Vec<usize>,
    },
    /// Places the tensor at `offset` along `dim` in zeros of length `len` along it (no
    /// communication; `Shard` → `Partial`). Backward: keeps the matching slice.
    Pad {
        /// Dimension the tensor is padded along.
        dim: usize,
        /// Index along `dim` where the tensor starts in the padded output.
        offset: usize,
        /// Length of the padded output along `dim`.
        len: usize,
    },
    /// Turns a replicated tensor into a partial one (no communication): for `Sum`, `keep`
    /// ranks keep the value and the others become zeros; for `Avg` every rank keeps it.
    /// Backward: identity (`Sum`) or multiplied by the group size (`Avg`).
    Partition {
        /// The reduction the partial output is pending under (`Sum` or `Avg`).
        op: ReduceOp,
        /// Under `Sum`, whether this rank keeps the value rather than outputting zeros;
        /// ignored under `Avg`.
        keep: bool,
    },
}

impl CollectiveKind {
    /// The communication call that the forward of this kind makes (a shift is a send and a
    /// receive, counted as its send), for the transfer ledger's bytes by kind.
    pub fn op_kind(&self) -> bonfire_comm::OpKind {
        use bonfire_comm::OpKind;
        match self {
            CollectiveKind::AllReduce { .. } | CollectiveKind::ReduceFromGroup { .. } => {
                OpKind::AllReduce
            }
            CollectiveKind::Broadcast { .. } => OpKind::Broadcast,
            CollectiveKind::Reduce { .. } => OpKind::Reduce,
            CollectiveKind::AllGather { .. } | CollectiveKind::Gather { .. } => OpKind::AllGather,
            CollectiveKind::ReduceScatter { .. } | CollectiveKind::Partition { .. } => {
                OpKind::ReduceScatter
            }
            CollectiveKind::AllToAll { .. } => OpKind::AllToAll,
            CollectiveKind::Recv { .. } => OpKind::Recv,
            _ => OpKind::Send,
        }
    }

    /// Whether the forward of this kind exchanges data.
    pub fn communicates(&self) -> bool {
        !matches!(
            self,
            CollectiveKind::CopyToGroup
                | CollectiveKind::Split { .. }
                | CollectiveKind::Pad { .. }
                | CollectiveKind::Partition { .. }
        )
    }
}

/// One differentiable collective: what to do, on which group, and whether autodiff may
/// recompute it in backward instead of keeping its output.
#[derive(Debug, Clone)]
pub struct CollectiveSpec {
    /// The process group the collective runs on.
    pub group: ProcessGroup,
    /// Which collective to run, with its arguments.
    pub kind: CollectiveKind,
    /// Mark the output recomputable: under Burn's Balanced gradient-checkpointing strategy
    /// (`Device::flex().autodiff().gradient_checkpointing()`) an operation that needs this
    /// output in backward gets it by re-running the collective there (e.g. re-gathering a
    /// ZeRO-3 parameter) rather than keeping it alive since forward.
    pub recompute: bool,
    /// Cast the output to this dtype (the input's dtype when `None`). The backward casts the
    /// gradient back to the input's dtype before its dual collective: e.g. ZeRO-3 gathers
    /// fp32 shards and hands out bf16 parameters, and a recomputable gather then re-runs the
    /// cast with it instead of keeping the half-precision copy since forward.
    pub output_dtype: Option<burn::tensor::DType>,
}

impl CollectiveSpec {
    /// A spec on `group` (not recomputable).
    pub fn new(group: &ProcessGroup, kind: CollectiveKind) -> Self {
        Self {
            group: group.clone(),
            kind,
            recompute: false,
            output_dtype: None,
        }
    }

    /// The same spec, its output cast to `dtype`.
    pub fn cast_output(mut self, dtype: burn::tensor::DType) -> Self {
        self.output_dtype = Some(dtype);
        self
    }

    /// The same spec, marked recomputable.
    pub fn recomputable(mut self) -> Self {
        self.recompute = true;
        self
    }

    /// Whether this collective has a correct gradient.
    pub fn is_differentiable(&self) -> bool {
        let linear = |op: &ReduceOp| matches!(op, ReduceOp::Sum | ReduceOp::Avg);
        match &self.kind {
            CollectiveKind::AllReduce { op } => *op != ReduceOp::Product,
            // The halves that run on gradients have no gradient of their own.
            CollectiveKind::ShiftStart { keep, .. } => *keep,
            CollectiveKind::ShiftFinish { add, .. } => !add,
            CollectiveKind::Reduce { op, .. }
            | CollectiveKind::ReduceScatter { op, .. }
            | CollectiveKind::ReduceFromGroup { op }
            | CollectiveKind::Partition { op, .. } => linear(op),
            _ => true,
        }
    }

    /// The collective applied to the gradient in backward, and the factor the result is
    /// multiplied by afterwards (`1/size` for the averaging forms). `None` means identity.
    pub fn dual(&self) -> (Option<CollectiveKind>, f64) {
        use CollectiveKind::*;
        let size = self.group.size() as f64;
        let avg = |op: &ReduceOp| {
            if *op == ReduceOp::Avg {
                1.0 / size
            } else {
                1.0
            }
        };
        match &self.kind {
            // Max / Min: the summed gradient, masked by the autodiff step.
            AllReduce {
                op: ReduceOp::Max | ReduceOp::Min,
            } => (Some(AllReduce { op: ReduceOp::Sum }), 1.0),
            AllReduce { op } => (Some(AllReduce { op: *op }), 1.0),
            Broadcast { root } => (
                Some(Reduce {
                    op: ReduceOp::Sum,
                    root: *root,
                }),
                1.0,
            ),
            Reduce { op, root } => (Some(Broadcast { root: *root }), avg(op)),
            AllGather { dim, sizes } => (
                Some(ReduceScatter {
                    dim: *dim,
                    sizes: sizes.clone(),
                    op: ReduceOp::Sum,
                }),
                1.0,
            ),
            ReduceScatter { dim, sizes, op } => (
                Some(AllGather {
                    dim: *dim,
                    sizes: sizes.clone(),
                }),
                avg(op),
            ),
            AllToAll {
                split_dim,
                split_sizes,
                cat_dim,
                cat_sizes,
            } => (
                Some(AllToAll {
                    split_dim: *cat_dim,
                    split_sizes: cat_sizes.clone(),
                    cat_dim: *split_dim,
                    cat_sizes: split_sizes.clone(),
                }),
                1.0,
            ),
            Send { dst, tag } => (
                Some(Recv {
                    src: *dst,
                    tag: tag ^ BACKWARD_TAG_BIT,
                }),
                1.0,
            ),
            Recv { src, tag } => (
                Some(Send {
                    dst: *src,
                    tag: tag ^ BACKWARD_TAG_BIT,
                }),
                1.0,
            ),
            Shift { .. } | ShiftStart { .. } | ShiftFinish { .. } => (Some(self.ring_dual()), 1.0),
            CopyToGroup => (Some(AllReduce { op: ReduceOp::Sum }), 1.0),
            ReduceFromGroup { op } => (None, avg(op)),
            Split { dim, sizes } => (
                Some(AllGather {
                    dim: *dim,
                    sizes: sizes.clone(),
                }),
                1.0,
            ),
            Gather { dim, sizes } => (
                Some(Split {
                    dim: *dim,
                    sizes: sizes.clone(),
                }),
                1.0,
            ),
            Partition { op, .. } => (None, if *op == ReduceOp::Avg { size } else { 1.0 }),
            // Pad's backward is a local slice, done by the autodiff step itself.
            Pad { .. } => (None, 1.0),
        }
    }

    /// The dual of a ring shift: the shift back, each gradient to the rank its tensor came
    /// from. Overlapped shifts stay overlapped: the finish's backward starts the gradients'
    /// shift (zeros for now), the start's backward — later in backward, after the computation
    /// in between — adds what arrived.
    fn ring_dual(&self) -> CollectiveKind {
        use CollectiveKind::*;
        let n = self.group.size();
        let back = |offset: &usize| (n - offset % n) % n;
        match &self.kind {
            Shift { offset, tag } => Shift {
                offset: back(offset),
                tag: tag ^ BACKWARD_TAG_BIT,
            },
            ShiftStart { offset, tag, .. } => ShiftFinish {
                offset: back(offset),
                tag: tag ^ BACKWARD_TAG_BIT,
                add: true,
            },
            ShiftFinish { offset, tag, .. } => ShiftStart {
                offset: back(offset),
                tag: tag ^ BACKWARD_TAG_BIT,
                keep: false,
            },
            other => unreachable!("{other:?} is not a ring shift"),
        }
    }

    /// The output shape for an input of shape `input` (validated by the functional API).
    pub fn output_shape(&self, input: &[usize]) -> Vec<usize> {
        use CollectiveKind::*;
        let me = self.group.rank();
        let mut out = input.to_vec();
        match &self.kind {
            AllGather { dim, sizes } | Gather { dim, sizes } => out[*dim] = sizes.iter().sum(),
            ReduceScatter { dim, sizes, .. } | Split { dim, sizes } => out[*dim] = sizes[me],
            AllToAll {
                split_dim,
                split_sizes,
                cat_dim,
                cat_sizes,
            } => {
                out[*split_dim] = split_sizes[me];
                out[*cat_dim] = cat_sizes.iter().sum();
            }
            Pad { dim, len, .. } => out[*dim] = *len,
            Send { .. } => out = vec![1],
            _ => {}
        }
        out
    }
}
