//! The search ([`plan`]): every layout of the cluster's ranks the model admits — tp within a
//! node (a divisor of the devices per node), pp up to the pipeline pieces, cp a power of two
//! whose `2·cp` chunks cut the sequence, the data-parallel rest as dp or, with ZeRO, as
//! dp_replicate × dp (HSDP: every divisor > 1 as dp_replicate, leaving dp × cp > 1 to shard
//! over) and, for a mixture of experts, ep over dp × cp (every divisor of dp·cp dividing
//! the experts, [`expert_degrees`]); each ZeRO stage, ± sequence parallelism, each schedule and micro-batch count,
//! ± recompute, each requested precision — costed by [`estimate`], the ones that fit ranked
//! by predicted step time, and the reasons for the top one ([`explain`]).

use crate::bytes::format_bytes;
use crate::cluster::ClusterSpec;
use crate::cost::{Estimate, Request, estimate, schedule_fits};
use crate::error::PlanError;
use crate::layout::{
    PlannedLayout, SEARCHED_SCHEDULES, context_layout, expert_layout, hsdp_layout,
};
use crate::model::ModelSpec;
use crate::shape::rank_shapes;
use bonfire_layout::{Axis, Recompute};
use bonfire_layout::{ParallelDims, ScheduleKind, ZeroStage};

/// The planner's answer: the layouts that fit, fastest first, and why the first won.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The layouts that fit a rank's memory, fastest first (ties: less hidden communication,
    /// then fewer bytes).
    pub ranked: Vec<Estimate>,
    /// Why the first won, one line each ([`explain`]).
    pub why: Vec<String>,
}

fn divisors(n: usize) -> impl Iterator<Item = usize> {
    (1..=n).filter(move |d| n.is_multiple_of(*d))
}

/// Micro-batch counts tried for `pp` stages and `local` sequences per replica: `pp`, `2pp`,
/// `4pp`, … dividing `local` (at least one micro-batch per stage keeps every stage busy).
fn microbatch_counts(pp: usize, local: usize) -> Vec<usize> {
    if pp == 1 {
        return vec![1];
    }
    let mut out = Vec::new();
    let mut m = pp;
    while m <= local {
        if local.is_multiple_of(m) {
            out.push(m);
        }
        m *= 2;
    }
    out
}

/// The cp degrees tried with `n` ranks left after tp and pp, for sequences of `seq` tokens:
/// 1, and the powers of two dividing `n` whose `2·cp` chunks cut the sequence.
fn context_degrees(n: usize, seq: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(1usize), |c| Some(c * 2))
        .take_while(move |&c| c <= n)
        .filter(move |&c| n.is_multiple_of(c) && (c == 1 || seq.is_multiple_of(2 * c)))
}

/// The ep degrees tried for `model` with `ranks` dp × cp ranks: the divisors of `ranks`
/// that divide its experts (1 among them) for a mixture of experts; only 1 for a dense model.
pub fn expert_degrees(model: &ModelSpec, ranks: usize) -> impl Iterator<Item = usize> {
    let experts = model.moe().map_or(1, |m| m.experts);
    divisors(ranks).filter(move |&e| experts.is_multiple_of(e))
}

/// Every layout the model and the batch admit on the cluster (before memory), and the
/// reasons for the (tp, pp, cp) triples that were turned away.
pub fn candidates(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    req: &Request,
) -> (Vec<ParallelDims>, Vec<String>) {
    let world = cluster.world();
    let (mut out, mut refused) = (Vec::new(), Vec::new());
    for tp in divisors(cluster.gpus_per_node) {
        for pp in divisors(world / tp) {
            for cp in context_degrees(world / tp / pp, req.seq) {
                let dp = world / tp / pp / cp;
                let mut base = context_layout(dp, cp, tp, pp);
                if pp > 1 {
                    // The shapes alone: micro-batches are tried below.
                    base = base.with_microbatches(1);
                }
                if let Err(reason) = base.check_model(model, req.global_batch) {
                    let cp = if cp > 1 {
                        format!(" cp={cp}")
                    } else {
                        String::new()
                    };
                    refused.push(format!("tp={tp} pp={pp}{cp} dp={dp}: {reason}"));
                    continue;
                }
                out.extend(variants(model, req, context_layout(dp, cp, tp, pp)));
                // HSDP: the same ranks as dp_replicate × dp, ZeRO sharded over dp × cp.
                for r in divisors(dp).filter(|&r| r > 1 && dp / r * cp > 1) {
                    out.extend(variants(model, req, hsdp_layout(r, dp / r, cp, tp, pp)));
                    // ep inside each replica.
                    for ep in expert_degrees(model, dp / r * cp).filter(|&e| e > 1) {
                        let l = hsdp_layout(r, dp / r, cp, tp, pp).with_degree(Axis::Ep, ep);
                        out.extend(variants(model, req, l));
                    }
                }
                // ep: a mixture of experts' experts over ep consecutive dp × cp ranks.
                for ep in expert_degrees(model, dp * cp).filter(|&e| e > 1) {
                    out.extend(variants(model, req, expert_layout(dp, cp, ep, tp, pp)));
                }
            }
        }
    }
    (out, refused)
}

/// The searched variants of `base` (its degrees): each schedule and micro-batch count (with
/// a pipeline), ZeRO stage (with more than one replica; only 1–3 under HSDP, whose DDP is
/// plain dp's), ± sequence parallelism (tp > 1), ± recompute of every block, each requested
/// precision.
fn variants(model: &ModelSpec, req: &Request, base: ParallelDims) -> Vec<ParallelDims> {
    let (dp, tp, pp) = (base.data_replicas(), base.tp(), base.pp());
    let schedules: Vec<Option<ScheduleKind>> = if pp > 1 {
        SEARCHED_SCHEDULES.into_iter().map(Some).collect()
    } else {
        vec![None]
    };
    let stages: &[ZeroStage] = if base.dp_replicate() > 1 {
        &ZeroStage::ALL[1..]
    } else if base.replicas() > 1 {
        &ZeroStage::ALL
    } else {
        &ZeroStage::ALL[..1]
    };
    let mut out = Vec::new();
    for schedule in schedules {
        for m in microbatch_counts(pp, req.global_batch / dp) {
            let mut l = base.clone();
            if let Some(kind) = schedule {
                l = l.with_schedule(kind).with_microbatches(m);
            }
            if schedule.is_some_and(|s| !schedule_fits(s, pp, m))
                || l.check_model(model, req.global_batch).is_err()
            {
                continue;
            }
            for &zero in stages {
                // Sequence parallelism with tp > 1, not for a mixture of experts.
                let sp_ok = tp > 1 && model.moe().is_none();
                for sp in [false, true].into_iter().filter(|&s| !s || sp_ok) {
                    let l = l.clone().with_zero(zero).with_sequence_parallel(sp);
                    if l.check_sequence(req.seq).is_err() {
                        continue;
                    }
                    for ac in [Recompute::Off, Recompute::Every(1)] {
                        for &precision in &req.precisions {
                            out.push(l.clone().with_recompute(ac).with_precision(precision));
                        }
                    }
                }
            }
        }
    }
    out
}

/// Costs every candidate (ranks' shapes computed once per tp, pp, schedule and ep).
pub fn estimate_all(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    req: &Request,
) -> (Vec<Estimate>, Vec<String>) {
    let (layouts, refused) = candidates(model, cluster, req);
    let mut shapes = Vec::new();
    let mut key = None;
    let estimates = layouts
        .iter()
        .map(|l| {
            let k = (l.tp(), l.pp(), l.pp_options.schedule, l.ep());
            if key != Some(k) {
                shapes = rank_shapes(model, l, req.seq);
                key = Some(k);
            }
            estimate(model, cluster, req, l, &shapes)
        })
        .collect();
    (estimates, refused)
}

/// Ranks the layouts of `model` on `cluster` for `req`: the feasible ones fastest first (ties:
/// fewer bytes), with the reasons for the first. `Err(Infeasible)` when nothing fits, saying
/// what does not fit where.
pub fn plan(model: &ModelSpec, cluster: &ClusterSpec, req: &Request) -> Result<Plan, PlanError> {
    let (all, refused) = estimate_all(model, cluster, req);
    let capacity = cluster.device.memory as f64 * req.memory_fraction;
    if all.is_empty() {
        return Err(PlanError::Infeasible {
            reason: format!(
                "no layout of {} ranks can split the model and the batch: {}",
                cluster.world(),
                refused.join("; ")
            ),
        });
    }
    let mut ranked: Vec<Estimate> = all
        .iter()
        .filter(|e| e.bytes() <= capacity)
        .cloned()
        .collect();
    if ranked.is_empty() {
        let smallest = all
            .iter()
            .min_by(|a, b| a.bytes().total_cmp(&b.bytes()))
            .expect("candidates");
        let m = &smallest.memory;
        return Err(PlanError::Infeasible {
            reason: format!(
                "the smallest layout ({}) needs {} per rank ({}), but a {} rank may use {} ({} of {}); \
                 {} ranks are too few for {} parameters at this batch",
                smallest.layout,
                format_bytes(smallest.bytes()),
                m.describe(),
                cluster.device.name,
                format_bytes(capacity),
                req.memory_fraction,
                format_bytes(cluster.device.memory as f64),
                cluster.world(),
                model.num_params(),
            ),
        });
    }
    ranked.sort_by(|a, b| {
        a.time
            .total()
            .total_cmp(&b.time.total())
            .then(a.time.dp_hidden.total_cmp(&b.time.dp_hidden))
            .then(a.bytes().total_cmp(&b.bytes()))
    });
    let why = explain(model, cluster, req, &ranked, &all, capacity);
    Ok(Plan { ranked, why })
}

/// Whether a layout belongs to a family.
type Member = fn(&ParallelDims) -> bool;

/// The families the reasons compare the winner with.
const FAMILIES: [(&str, Member); 6] = [
    ("DDP", |l| {
        l.tp() == 1 && l.pp() == 1 && l.cp() == 1 && l.zero == ZeroStage::Zero0
    }),
    ("ZeRO alone", |l| {
        l.tp() == 1
            && l.pp() == 1
            && l.cp() == 1
            && l.zero != ZeroStage::Zero0
            && l.dp_replicate() == 1
    }),
    ("with tensor parallelism", |l| l.tp() > 1),
    ("with a pipeline", |l| l.pp() > 1),
    ("with context parallelism", |l| l.cp() > 1),
    ("HSDP (dp_replicate replicas of ZeRO shards)", |l| {
        l.dp_replicate() > 1
    }),
];

/// Why the first of `ranked` won: its memory against the device, the part of the step that
/// bounds it, each family's best (or why none of it fits) and the runner-up.
pub fn explain(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    req: &Request,
    ranked: &[Estimate],
    all: &[Estimate],
    capacity: f64,
) -> Vec<String> {
    let top = &ranked[0];
    let t = &top.time;
    let mut why = vec![
        format!(
            "memory: {} of {} per rank (Ψ = {} parameters over {} ranks), the peak {}",
            format_bytes(top.bytes()),
            format_bytes(capacity),
            model.num_params(),
            cluster.world(),
            top.memory.describe(),
        ),
        format!(
            "time: {:.3} ms = compute {:.3} + kernel launches {:.3} + bubble {:.3} + tp {:.3} + pp {:.3} + cp ring {:.3}{} + dp exposed {:.3} + replicas {:.3} + optimizer {:.3}; bound by {}",
            top.step_ms(),
            t.compute * 1e3,
            t.launch * 1e3,
            t.bubble * 1e3,
            t.tp_comm * 1e3,
            t.pp_comm * 1e3,
            t.cp_comm * 1e3,
            match model.moe() {
                Some(_) => format!(" + ep all-to-all {:.3}", t.ep_comm * 1e3),
                None => String::new(),
            },
            t.dp_comm * 1e3,
            t.replica_comm * 1e3,
            t.optimizer * 1e3,
            t.bound().0
        ),
    ];
    for (name, member) in FAMILIES {
        why.push(family_line(
            name, member, top, ranked, all, capacity, cluster,
        ));
    }
    if model.moe().is_some() {
        let member: Member = |l| l.ep() > 1;
        let name = "with expert parallelism";
        why.push(family_line(
            name, member, top, ranked, all, capacity, cluster,
        ));
        why.push(expert_line(model, cluster, req, top));
    }
    if cluster.gpus_per_node > 1 || cluster.nodes > 1 {
        why.push(format!(
            "rule: tp ≤ {} devices per node, so tensor-parallel groups stay on {} ({:.0} GB/s); \
             the dp and pp groups that leave a node use {} ({:.0} GB/s)",
            cluster.gpus_per_node,
            cluster.intra.name,
            cluster.intra.bandwidth / 1e9,
            cluster.inter.name,
            cluster.inter.bandwidth / 1e9
        ));
    }
    if top.layout.is_hsdp() {
        why.push(hsdp_line(cluster, &top.layout));
    }
    if let Some(next) = ranked.get(1) {
        why.push(format!(
            "runner-up: {} at {:.3} ms (+{:.1} %)",
            next.layout,
            next.step_ms(),
            (next.time.total() / top.time.total() - 1.0) * 100.0
        ));
    }
    let _ = req;
    why
}

/// A mixture of experts' winner: its experts per rank, where its ep group's all-to-alls
/// run and what they cost (not hidden), and the group its experts' gradients are reduced in.
fn expert_line(model: &ModelSpec, cluster: &ClusterSpec, req: &Request, top: &Estimate) -> String {
    let l = &top.layout;
    let experts = model.moe().map_or(0, |m| m.experts);
    if l.ep() == 1 {
        return format!(
            "experts: all {experts} on every rank (ep=1, no all-to-all); their gradients \
             reduced with the rest"
        );
    }
    let local = crate::experts::expert_group_local_peers(cluster, l);
    let link = if local + 1 == l.ep() {
        &cluster.intra
    } else {
        &cluster.inter
    };
    let tokens =
        (req.global_batch / l.data_replicas() / l.microbatches() * req.seq) as f64 / l.cp() as f64;
    let bytes = crate::experts::all_to_all_bytes(model, l, tokens);
    format!(
        "experts: {} of {experts} per rank (ep={}); its all-to-alls send {} a rank per \
         layer and micro-batch each, {:.3} ms a step on {} ({} of {} peers in the node), not \
         hidden; expert gradients reduced over the {} ranks holding the same experts",
        experts / l.ep(),
        l.ep(),
        format_bytes(bytes),
        top.time.ep_comm * 1e3,
        link.name,
        local,
        l.ep() - 1,
        l.expert_replicas()
    )
}

/// Where an HSDP winner's groups run: the shard group (dp × cp) and the replica group.
fn hsdp_line(cluster: &ClusterSpec, l: &ParallelDims) -> String {
    let n = l.shard_ranks();
    let shard = cluster.group_link(n, l.tp());
    let replica = cluster.group_link(l.dp_replicate(), n * l.tp());
    format!(
        "HSDP: ZeRO-{} shards over dp × cp = {n} ranks on {} ({:.0} GB/s); the {} replicas \
         all-reduce each rank's gradient {} on {} ({:.0} GB/s)",
        l.zero.index(),
        shard.name,
        shard.bandwidth / 1e9,
        l.dp_replicate(),
        if l.zero == ZeroStage::Zero1 {
            "(the whole vector)"
        } else {
            "shard"
        },
        replica.name,
        replica.bandwidth / 1e9
    )
}

fn family_line(
    name: &str,
    member: Member,
    top: &Estimate,
    ranked: &[Estimate],
    all: &[Estimate],
    capacity: f64,
    cluster: &ClusterSpec,
) -> String {
    if member(&top.layout) {
        return format!("{name}: the winner is one");
    }
    if let Some(best) = ranked.iter().find(|e| member(&e.layout)) {
        return format!(
            "{name}: fastest that fits is {} at {:.3} ms (+{:.1} %)",
            best.layout,
            best.step_ms(),
            (best.time.total() / top.time.total() - 1.0) * 100.0
        );
    }
    match all
        .iter()
        .filter(|e| member(&e.layout))
        .min_by(|a, b| a.bytes().total_cmp(&b.bytes()))
    {
        Some(small) => format!(
            "{name}: none fits: the smallest ({}) needs {} > {}",
            small.layout,
            format_bytes(small.bytes()),
            format_bytes(capacity)
        ),
        None if name.contains("tensor") && cluster.gpus_per_node == 1 => {
            format!("{name}: not tried: one device per node (tp stays inside a node)")
        }
        None => format!(
            "{name}: not possible with {} ranks and this model and batch",
            cluster.world()
        ),
    }
}
