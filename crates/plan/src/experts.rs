//! Expert parallelism's costs beyond the state (which [`crate::memory::rank_state`] owns):
//! what a rank sends in one all-to-all of a mixture-of-experts layer
//! ([`all_to_all_bytes`]), which ranks an ep group spans and how many of a rank's peers
//! share its node ([`expert_group_local_peers`]), and the seconds a layer's all-to-alls cost
//! per micro-batch ([`ep_per_layer`]). Loads are assumed balanced (dropless routing, each
//! expert receiving `k·tokens/E` of a rank's rows): skew is not modelled.

use crate::cluster::ClusterSpec;
use crate::layout::PlannedLayout;
use crate::model::ModelSpec;
use crate::time::all_to_all;
use bonfire_layout::ParallelDims;

/// The bytes a rank sends in one of expert parallelism's all-to-alls of a mixture-of-experts
/// layer, for a micro-batch of `tokens` tokens on the rank: each token's `k` routed rows of
/// `d` values in the compute dtype, of which — with balanced loads, an assumption — the
/// share `(ep−1)/ep` goes to the other ranks of its ep group: `tokens·k·d·(ep−1)/ep` values.
/// The combine sends as many back. 0 without ep or for a dense model.
pub fn all_to_all_bytes(model: &ModelSpec, layout: &ParallelDims, tokens: f64) -> f64 {
    let (Some(moe), ep) = (model.moe(), layout.ep()) else {
        return 0.0;
    };
    let ab = layout.precision.param.bytes() as f64;
    let k = moe.top_k as f64;
    tokens * k * model.d_model as f64 * (ep - 1) as f64 / ep as f64 * ab
}

/// The fewest peers in its own node that a rank of an ep group has: the group is `ep`
/// consecutive ranks of the flattened dp × cp group (`ParallelDims::coordinate` on ep), so
/// in the mesh `[pp, dp, cp, tp]` (tp innermost; no dp_replicate with ep) ranks `tp` apart
/// spanning `ep·tp` consecutive ranks from `b·dp·cp·tp + g·ep·tp` (pipeline block b, group g).
/// `ep − 1` when every group stays in a node.
pub fn expert_group_local_peers(cluster: &ClusterSpec, layout: &ParallelDims) -> usize {
    let (ep, tp, gpn) = (layout.ep(), layout.tp(), cluster.gpus_per_node);
    let block = layout.dp() * layout.cp() * tp;
    let groups = layout.dp() * layout.cp() / ep;
    let mut fewest = ep;
    for b in 0..layout.pp() {
        for g in 0..groups {
            let start = b * block + g * ep * tp;
            // The members' nodes rise with their index: count each node's run.
            let mut run = 0;
            for i in 0..ep {
                let node = (start + i * tp) / gpn;
                if i > 0 && node != (start + (i - 1) * tp) / gpn {
                    fewest = fewest.min(run);
                    run = 0;
                }
                run += 1;
            }
            fewest = fewest.min(run);
        }
    }
    fewest - 1
}

/// Seconds of expert parallelism's all-to-alls one mixture-of-experts layer costs a rank per
/// micro-batch of `tokens` tokens: the dispatch and the combine in forward, the same two in
/// backward (their gradients), and the forward's two again when recomputing, each of
/// [`all_to_all_bytes`] on the links the ep group spans ([`expert_group_local_peers`]:
/// inside a node while the group fits one). Not hidden: the experts wait for their tokens
/// and the next layer for their outputs (Bonfire does not overlap them).
pub fn ep_per_layer(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    layout: &ParallelDims,
    tokens: f64,
) -> f64 {
    let ep = layout.ep();
    if ep <= 1 || model.moe().is_none() {
        return 0.0;
    }
    let bytes = all_to_all_bytes(model, layout, tokens);
    let local = expert_group_local_peers(cluster, layout);
    let calls = if layout.recomputes() { 6.0 } else { 4.0 };
    calls * all_to_all(bytes, ep, local, &cluster.intra, &cluster.inter)
}
