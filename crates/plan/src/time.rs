//! Step time. Collectives by the ring algorithm's α–β cost ([`all_reduce`],
//! [`all_gather`] — reduce-scatter costs the same —, [`p2p`]) on the link a group crosses,
//! plus the link's fixed cost per call; fixed costs per kernel ([`KERNELS_PER_BLOCK`]);
//! compute from FLOPs at the device's sustained rate; the pipeline's bubble by its schedule;
//! data-parallel communication hidden behind backward up to the cluster's overlap fraction;
//! the optimizer step bound by memory bandwidth; context parallelism's ring transfers, each
//! hidden behind one block's compute up to the overlap fraction ([`ring_transfer`]);
//! expert parallelism's all-to-alls on the links its group spans ([`all_to_all`]).

use crate::cluster::LinkSpec;

/// Kernels one transformer block launches in a forward (norms, the four products and
/// their biases, the heads' reshapes, scores, mask, softmax, the activation, residual adds:
/// about 20 in an eager GPT block); backward launches twice as many.
pub const KERNELS_PER_BLOCK: f64 = 20.0;
/// Kernels one step of ring attention launches in a forward (counted in
/// `bonfire_cp::ring_attention`; in 16-bit types: the block's key/value
/// narrows and head selects, the causal bias from the chunks' positions, the two products,
/// the bias, the running max, the rescale, exponents, sums and the running numerator's
/// update; in f32: per fused call — at most two a step — copies of inputs whose rows are
/// not contiguous, the op, the packing and the log-sum-exp's copy, about 6, and at the end
/// about 10 per query chunk to merge the parts, so about 20 a step at cp = 2 and fewer
/// beyond): a block under cp > 1 launches `cp` of them besides [`KERNELS_PER_BLOCK`].
pub const KERNELS_PER_RING_STEP: f64 = 20.0;
/// Kernels a mixture of experts' routing launches in a forward besides
/// [`KERNELS_PER_BLOCK`] (an estimate from `bonfire_models::mixtral::moe`: the router's
/// product, softmax and top k by ranks, the renormalized weights, the chosen experts' ids,
/// the permutation and its inverse — about 30; not measured).
pub const KERNELS_MOE_ROUTING: f64 = 30.0;
/// Kernels each of a rank's local experts launches in a forward (its weights' narrows,
/// reshapes and casts, the two products, SiLU and the gate's product: about 10; not
/// measured).
pub const KERNELS_PER_LOCAL_EXPERT: f64 = 10.0;
/// Kernels the embeddings (lookups and their sum) launch in a forward.
pub const KERNELS_EMBEDDING: f64 = 3.0;
/// Kernels the head (norm, product, loss) launches in a forward.
pub const KERNELS_HEAD: f64 = 5.0;

/// Seconds for a ring all-reduce of `bytes` over `n` ranks in one call:
/// `2(n−1)/n · bytes/B + 2(n−1)·α + c`.
pub fn all_reduce(bytes: f64, n: usize, link: &LinkSpec) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let k = (n - 1) as f64;
    2.0 * k / n as f64 * bytes / link.bandwidth + 2.0 * k * link.latency + link.call
}

/// Seconds for a ring all-gather (or reduce-scatter) whose whole result is `bytes`, in one
/// call: `(n−1)/n · bytes/B + (n−1)·α + c`.
pub fn all_gather(bytes: f64, n: usize, link: &LinkSpec) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let k = (n - 1) as f64;
    k / n as f64 * bytes / link.bandwidth + k * link.latency + link.call
}

/// Seconds of one all-to-all of `n` ranks in which a rank sends `bytes` in all, an equal
/// share to each of its `n − 1` peers, `local` of them in its node (on `intra`) and the rest
/// on `inter`: both links carry their shares at once, so the slower share bounds it, plus
/// `(n−1)·α` and one call's `c` of the slower link.
pub fn all_to_all(bytes: f64, n: usize, local: usize, intra: &LinkSpec, inter: &LinkSpec) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let share = bytes / (n - 1) as f64;
    let remote = n - 1 - local;
    let inside = local as f64 * share / intra.bandwidth;
    let (wire, link) = if remote == 0 {
        (inside, intra)
    } else {
        (inside.max(remote as f64 * share / inter.bandwidth), inter)
    };
    wire + (n - 1) as f64 * link.latency + link.call
}

/// Seconds to send `bytes` to one peer: `bytes/B + α + c`.
pub fn p2p(bytes: f64, link: &LinkSpec) -> f64 {
    bytes / link.bandwidth + link.latency + link.call
}

/// Seconds one ring step's transfer of `bytes` adds beside `compute` seconds of the block
/// computed while it travels (the send is posted before the block's compute): the part of
/// `bytes/B` that `overlap` of the compute does not hide, plus `α + c`.
pub fn ring_transfer(bytes: f64, compute: f64, overlap: f64, link: &LinkSpec) -> f64 {
    (bytes / link.bandwidth - overlap * compute).max(0.0) + link.latency + link.call
}

/// A step's predicted time, by part, seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTime {
    /// Forward, backward and recomputation of the slowest pipeline rank, all micro-batches.
    pub compute: f64,
    /// The fixed cost of the kernels those launch (per kernel, per micro-batch).
    pub launch: f64,
    /// Idle time of the pipeline's fill and drain.
    pub bubble: f64,
    /// Tensor-parallel collectives (on the critical path).
    pub tp_comm: f64,
    /// Pipeline sends between stages.
    pub pp_comm: f64,
    /// Context parallelism's ring transfers not hidden behind the blocks' compute.
    pub cp_comm: f64,
    /// Expert parallelism's all-to-alls (dispatch and combine, forward and backward; on the
    /// critical path, not hidden).
    pub ep_comm: f64,
    /// Data-parallel (DDP / ZeRO) communication not hidden behind backward.
    pub dp_comm: f64,
    /// HSDP's all-reduce of each rank's reduced gradient across its dp_replicate replicas
    /// (after the shard group's reduction, not hidden; 0 without HSDP).
    pub replica_comm: f64,
    /// The optimizer step.
    pub optimizer: f64,
    /// Data-parallel communication hidden behind compute (not in the total: it breaks ties —
    /// of two equally fast layouts, the one that moves less is the safer bet).
    pub dp_hidden: f64,
}

impl StepTime {
    /// The step's seconds: every part but [`Self::dp_hidden`].
    pub fn total(&self) -> f64 {
        self.compute
            + self.launch
            + self.bubble
            + self.tp_comm
            + self.pp_comm
            + self.cp_comm
            + self.ep_comm
            + self.dp_comm
            + self.replica_comm
            + self.optimizer
    }

    /// The largest part's name and seconds.
    pub fn bound(&self) -> (&'static str, f64) {
        [
            ("compute", self.compute),
            ("kernel launches", self.launch),
            ("pipeline bubble", self.bubble),
            ("tensor-parallel communication", self.tp_comm),
            ("pipeline communication", self.pp_comm),
            ("context-parallel ring", self.cp_comm),
            ("expert-parallel all-to-all", self.ep_comm),
            ("data-parallel communication", self.dp_comm),
            ("HSDP's all-reduce across replicas", self.replica_comm),
            ("optimizer step", self.optimizer),
        ]
        .into_iter()
        .fold(("compute", f64::MIN), |a, b| if b.1 > a.1 { b } else { a })
    }
}
