//! HSDP in the planner (issue 30, point 6): a `dp_replicate` axis outside dp, ZeRO 1–3
//! sharded over the dp × cp *shard group* only, the replicas holding the same shards and
//! all-reducing each rank's reduced gradient across them (the shard, Ψ/(dp·cp) values;
//! stage 1 the whole vector). The search tries it, the record line names it, a rank holds
//! Ψ/(dp·cp) of what ZeRO shards, the shard group's collectives run on its own link (inside a
//! node when it fits one) and the replicas' all-reduce on theirs — and so on two nodes with a
//! slow link between them ZeRO-3's gathers stay inside the nodes. No machine is measured here
//! (`examples/tests/planner_heldout.rs` measures HSDP layouts' bytes).

use bonfire_plan::cost::replica_all_reduce;
use bonfire_plan::memory::state_bytes;
use bonfire_plan::time::all_reduce;
mod common;
use bonfire_layout::{MixedPrecision, ParallelDims, ZeroStage};
use bonfire_plan::{
    ClusterSpec, Estimate, LinkSpec, MemoryParts, ModelSpec, PlannedLayout, Request, candidates,
    context_layout, estimate, hsdp_layout, plan, rank_memory, rank_shapes,
};
use common::{bf16, cluster};

fn h100s(nodes: usize, intra: &str, inter: &str) -> ClusterSpec {
    cluster(nodes, 8, "h100", intra, inter)
}

/// `l` under ZeRO `zero` in bf16 (what [`bf16`] requests).
fn z(l: ParallelDims, zero: ZeroStage) -> ParallelDims {
    l.with_zero(zero).with_precision(MixedPrecision::bf16())
}

fn memory(model: &ModelSpec, req: &Request, layout: &ParallelDims) -> MemoryParts {
    rank_memory(model, req, layout, &rank_shapes(model, layout, req.seq), 0)
}

fn cost(model: &ModelSpec, cluster: &ClusterSpec, req: &Request, l: &ParallelDims) -> Estimate {
    estimate(model, cluster, req, l, &rank_shapes(model, l, req.seq))
}

/// The search tries every dp_replicate > 1 dividing the data-parallel ranks with ZeRO 1–3
/// (never with ZeRO-0, plain DDP over the same ranks, nor without a dp or cp axis left to
/// shard over), and the record line leads with `dp_replicate=` when it is above 1.
#[test]
fn the_search_tries_dp_replicate_with_zero_and_records_it() {
    let model = ModelSpec::preset("gpt-bench").unwrap();
    let (layouts, _) = candidates(&model, &h100s(2, "nvlink", "ib"), &bf16(64, 128));
    let hsdp: Vec<&ParallelDims> = layouts.iter().filter(|l| l.dp_replicate() > 1).collect();
    assert!(hsdp.iter().all(|l| l.zero != ZeroStage::Zero0));
    assert!(hsdp.iter().all(|l| l.shard_ranks() > 1));
    let has = |r, dp, cp, tp, pp, zero| {
        hsdp.iter().any(|l| {
            (l.dp_replicate(), l.dp(), l.cp(), l.tp(), l.pp(), l.zero) == (r, dp, cp, tp, pp, zero)
        })
    };
    for zero in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
        assert!(has(2, 8, 1, 1, 1, zero), "{zero:?}");
        assert!(has(4, 4, 1, 1, 1, zero), "{zero:?}");
        assert!(has(8, 2, 1, 1, 1, zero), "{zero:?}");
    }
    // Combined with the other axes: tp inside the node, a pipeline, cp as the shard group.
    assert!(has(2, 4, 1, 2, 1, ZeroStage::Zero3));
    assert!(has(2, 2, 1, 1, 4, ZeroStage::Zero1));
    assert!(has(8, 1, 2, 1, 1, ZeroStage::Zero2));
    assert!(!has(16, 1, 1, 1, 1, ZeroStage::Zero3));
    let l = hsdp_layout(2, 8, 1, 1, 1).with_zero(ZeroStage::Zero3);
    assert!(
        l.record().starts_with("dp_replicate=2 dp=8 cp=1 zero=3 "),
        "{}",
        l.record()
    );
    let plain = context_layout(16, 1, 1, 1).with_zero(ZeroStage::Zero3);
    assert!(
        plain.record().starts_with("dp=16 cp=1 zero=3 "),
        "{}",
        plain.record()
    );
    // The batch splits over dp_replicate × dp replicas; a shard group of one is refused.
    let e = hsdp_layout(2, 2, 1, 1, 1)
        .check_model(&model, 6)
        .unwrap_err();
    assert!(e.contains("dp_replicate=2 × dp=2"), "{e}");
    assert!(hsdp_layout(2, 2, 1, 1, 1).check_model(&model, 8).is_ok());
    let lone = hsdp_layout(2, 1, 1, 1, 1).with_zero(ZeroStage::Zero2);
    assert!(
        lone.check_model(&model, 8)
            .unwrap_err()
            .contains("to shard over")
    );
}

/// A rank's state is ZeRO's over dp × cp, not over the replicas: HSDP `dp_replicate=2, dp=4`
/// holds what `dp=4` holds (twice `dp=8`'s sharded part), with `dp=8`'s activations (one of
/// eight replicas' sequences); cp joins the shard group.
#[test]
fn hsdp_state_is_sharded_over_dp_times_cp_only() {
    let model = ModelSpec::preset("llama3-8b").unwrap();
    let req = bf16(16, 4096);
    let p = MixedPrecision::bf16();
    let psi = model.num_params();
    for zero in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
        let hsdp = memory(&model, &req, &z(hsdp_layout(2, 4, 1, 1, 1), zero));
        let dp4 = memory(&model, &req, &z(context_layout(4, 1, 1, 1), zero));
        let dp8 = memory(&model, &req, &z(context_layout(8, 1, 1, 1), zero));
        assert_eq!(hsdp.state, state_bytes(zero, psi, 4, p, false), "{zero:?}");
        assert_eq!(hsdp.state, dp4.state, "{zero:?}");
        assert_eq!(hsdp.activations, dp8.activations, "{zero:?}");
        assert!(hsdp.state.optim == 2.0 * dp8.state.optim, "{zero:?}");
    }
    // cp shards too: dp_replicate=2, dp=2, cp=2 shards over 4.
    let cp = z(hsdp_layout(2, 2, 2, 1, 1), ZeroStage::Zero3);
    let m = memory(&model, &req, &cp);
    assert_eq!(m.state, state_bytes(ZeroStage::Zero3, psi, 4, p, false));
    // Without ZeRO dp_replicate is DDP over every replica: the whole state on each.
    let ddp = memory(
        &model,
        &req,
        &z(hsdp_layout(2, 4, 1, 1, 1), ZeroStage::Zero0),
    );
    assert_eq!(ddp.state, state_bytes(ZeroStage::Zero0, psi, 8, p, false));
}

/// The time by formula on 2 nodes of 8 H100s (NVLink inside, IB between): the shard group's
/// collectives are `dp=8` ZeRO's inside one node, the replicas' all-reduce is a ring of 2 over
/// IB of the rank's gradient shard (Ψ/8 values in the reduce dtype; stage 1 all of Ψ), not
/// hidden; the optimizer steps Ψ/8. Without ZeRO it is DDP over 16.
#[test]
fn hsdp_communication_by_formula() {
    let model = ModelSpec::preset("llama3-8b").unwrap();
    let req = bf16(16, 4096);
    let (two, one) = (h100s(2, "nvlink", "ib"), h100s(1, "nvlink", "ib"));
    let psi = model.num_params() as f64;
    let ib = LinkSpec::preset("ib").unwrap();
    let rb = 4.0; // bf16 parameters, gradients reduced in f32
    for zero in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
        let hsdp = z(hsdp_layout(2, 8, 1, 1, 1), zero);
        let t = cost(&model, &two, &req, &hsdp).time;
        let shard = if zero == ZeroStage::Zero1 { 1.0 } else { 8.0 };
        let expected = all_reduce(psi / shard * rb, 2, &ib);
        assert!((t.replica_comm / expected - 1.0).abs() < 1e-12, "{zero:?}");
        assert_eq!(t.replica_comm, replica_all_reduce(&two, &hsdp, psi, 0.0));
        // The shard group's traffic is a one-node dp=8's, on NVLink.
        let dp8 = cost(
            &model,
            &one,
            &bf16(8, 4096),
            &z(context_layout(8, 1, 1, 1), zero),
        );
        let moved = |t: &bonfire_plan::time::StepTime| t.dp_comm + t.dp_hidden;
        assert!(
            (moved(&t) / moved(&dp8.time) - 1.0).abs() < 1e-12,
            "{zero:?}"
        );
        assert_eq!(t.optimizer, dp8.time.optimizer);
        let dp16 = cost(&model, &two, &req, &z(context_layout(16, 1, 1, 1), zero)).time;
        assert!((t.optimizer / dp16.optimizer - 2.0).abs() < 1e-12);
        assert_eq!(dp16.replica_comm, 0.0);
    }
    // Replicas that fit a node all-reduce on its link.
    let inside = z(hsdp_layout(2, 4, 1, 1, 1), ZeroStage::Zero2);
    let nvlink = LinkSpec::preset("nvlink").unwrap();
    let expected = all_reduce(psi / 4.0 * rb, 2, &nvlink);
    assert!((replica_all_reduce(&one, &inside, psi, 0.0) / expected - 1.0).abs() < 1e-12);
    // ZeRO-0: DDP over dp_replicate × dp.
    let ddp = cost(
        &model,
        &two,
        &req,
        &z(hsdp_layout(2, 8, 1, 1, 1), ZeroStage::Zero0),
    )
    .time;
    let dp16 = cost(
        &model,
        &two,
        &req,
        &z(context_layout(16, 1, 1, 1), ZeroStage::Zero0),
    )
    .time;
    assert_eq!((ddp.replica_comm, ddp.total()), (0.0, dp16.total()));
}

/// The first-ranked layout with these degrees and ZeRO-3 (any recompute), and its rank.
fn rank_of(p: &bonfire_plan::Plan, r: usize, dp: usize) -> Option<(usize, &Estimate)> {
    p.ranked.iter().enumerate().find(|(_, e)| {
        let l = &e.layout;
        (l.dp_replicate(), l.dp(), l.cp(), l.tp(), l.pp(), l.zero)
            == (r, dp, 1, 1, 1, ZeroStage::Zero3)
    })
}

/// The point of HSDP: Llama 3 8B on 2 nodes of 8 H100s with 100 GbE between them, 16
/// sequences of 4096 tokens. ZeRO-3 over all 16 ranks gathers every layer across the slow
/// link (more than the compute can hide); HSDP `dp_replicate=2, dp=8` gathers inside each
/// node on NVLink and sends only its gradient shard across: ranked ahead. With the link
/// between nodes as fast as NVLink the order reverses (dp=16 steps half the optimizer
/// shard, and HSDP's all-reduce is not hidden), and a device too small for a shard of 8
/// leaves only dp=16.
#[test]
fn hsdp_keeps_zero3_gathers_inside_a_node() {
    let model = ModelSpec::preset("llama3-8b").unwrap();
    let req = bf16(16, 4096);
    let slow = plan(&model, &h100s(2, "nvlink", "ethernet"), &req).unwrap();
    let (h, he) = rank_of(&slow, 2, 8).expect("HSDP fits");
    let (f, fe) = rank_of(&slow, 1, 16).expect("dp=16 fits");
    eprintln!(
        "ethernet: HSDP {} #{} {:.1} ms (replicas {:.1}, dp exposed {:.1}); dp=16 {} #{} {:.1} \
         ms (dp exposed {:.1}); first {} {:.1} ms",
        he.layout,
        h + 1,
        he.step_ms(),
        he.time.replica_comm * 1e3,
        he.time.dp_comm * 1e3,
        fe.layout,
        f + 1,
        fe.step_ms(),
        fe.time.dp_comm * 1e3,
        slow.ranked[0].layout,
        slow.ranked[0].step_ms()
    );
    assert!(h < f, "HSDP #{} behind dp=16 #{}", h + 1, f + 1);
    assert!(he.step_ms() < 0.8 * fe.step_ms());
    assert!(slow.why.iter().any(|w| w.starts_with("HSDP (dp_replicate")));
    let fast = plan(&model, &h100s(2, "nvlink", "nvlink"), &req).unwrap();
    let (h, he) = rank_of(&fast, 2, 8).expect("HSDP fits");
    let (f, fe) = rank_of(&fast, 1, 16).expect("dp=16 fits");
    eprintln!(
        "nvlink between nodes: HSDP #{} {:.2} ms, dp=16 #{} {:.2} ms",
        h + 1,
        he.step_ms(),
        f + 1,
        fe.step_ms()
    );
    assert!(f < h, "dp=16 #{} behind HSDP #{}", f + 1, h + 1);
    // A device that holds a shard of 16 but not of 8.
    let mut small = h100s(2, "nvlink", "ethernet");
    let need = |e: &Estimate| e.bytes() / req.memory_fraction;
    small.device.memory = ((need(fe) + need(he)) / 2.0) as usize;
    assert!(need(fe) < need(he));
    let tight = plan(&model, &small, &req).unwrap();
    assert!(rank_of(&tight, 2, 8).is_none());
    assert!(rank_of(&tight, 1, 16).is_some());
}

/// A model too small to hide its reductions (the 5 M-parameter bench GPT) on the same two
/// nodes over 100 GbE: the first choice is HSDP (ZeRO sharded inside each node, only the
/// gradient shard crossing), and the reasons say where its groups run. Over IB, plain dp=16
/// (nothing crosses the nodes but its rings) comes first.
#[test]
fn an_hsdp_winner_says_where_its_groups_run() {
    let model = ModelSpec::preset("gpt-bench").unwrap();
    let p = plan(&model, &h100s(2, "nvlink", "ethernet"), &bf16(64, 128)).unwrap();
    let top = &p.ranked[0];
    eprintln!(
        "first: {} {:.3} ms; why: {:#?}",
        top.layout,
        top.step_ms(),
        p.why
    );
    let l = &top.layout;
    assert_eq!(
        (l.dp_replicate(), l.dp(), l.tp(), l.pp()),
        (2, 8, 1, 1),
        "{l}"
    );
    let line = p
        .why
        .iter()
        .find(|w| w.starts_with("HSDP: ZeRO-"))
        .expect("an HSDP line");
    assert!(
        line.contains("8 ranks on nvlink") && line.contains("on ethernet"),
        "{line}"
    );
    let ib = plan(&model, &h100s(2, "nvlink", "ib"), &bf16(64, 128)).unwrap();
    let l = &ib.ranked[0].layout;
    assert_eq!((l.dp_replicate(), l.dp()), (1, 16), "{l}");
    assert!(!ib.why.iter().any(|w| w.starts_with("HSDP: ")));
}
