//! Expert parallelism (ep) in the planner (issue 30, point 6): a mixture of experts
//! (`Arch::Mixtral`, preset `mixtral-8x7b`) holds `E/ep` experts a rank, their state
//! data-parallel (and ZeRO-sharded) over the dp·cp/ep ranks holding the same experts, the
//! rest over dp × cp; every rank computes `k·tokens` routed rows (dropless, balanced loads);
//! each MoE layer exchanges `tokens·k·d·(ep−1)/ep` values a rank in each of its four
//! all-to-alls a micro-batch (dispatch and combine, forward and backward), not hidden, on the
//! links the group of ep consecutive dp × cp ranks spans. The search tries ep only for a
//! mixture of experts, only dividing E and dp·cp. No machine is measured here.

mod common;
use bonfire_layout::{MixedPrecision, ParallelDims, ZeroStage};
use bonfire_plan::cost::replica_all_reduce;
use bonfire_plan::experts::{all_to_all_bytes, ep_per_layer, expert_group_local_peers};
use bonfire_plan::memory::{ZERO_STEP_GRADIENT_COPIES, rank_state, state_bytes};
use bonfire_plan::time::all_to_all;
use bonfire_plan::{
    ClusterSpec, Estimate, LinkSpec, ModelSpec, PlannedLayout, Request, candidates, context_layout,
    estimate, expert_degrees, expert_layout, hsdp_layout, plan, rank_memory, rank_shapes,
};
use common::{bf16, h100s};

fn mixtral() -> ModelSpec {
    ModelSpec::preset("mixtral-8x7b").unwrap()
}

fn cost(model: &ModelSpec, cluster: &ClusterSpec, req: &Request, l: &ParallelDims) -> Estimate {
    estimate(model, cluster, req, l, &rank_shapes(model, l, req.seq))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs())
}

/// Mixtral 8x7B's shape: 46.7 B parameters, 45.1 B of them experts (3·E·d·F a layer), and
/// its active FLOPs a token are the router's and k = 2 experts', whatever ep.
#[test]
fn mixtral_parameters_and_active_flops() {
    let m = mixtral();
    let (d, f, e, k) = (4096.0, 14_336.0, 8.0, 2.0);
    assert_eq!(m.num_params(), 46_702_792_704);
    assert_eq!(m.block_expert_params(), 3 * 8 * 4096 * 14_336);
    let attention = 2.0 * (2.0 * d * d + 2.0 * d * 1024.0) + 4.0 * 4096.0 * d;
    let block = m.piece_flops_per_token(1, 1, 4096);
    assert_eq!(block, attention + 2.0 * d * e + k * 6.0 * d * f);
    // tp splits the attention only: the experts' FLOPs stay on every tp rank.
    assert_eq!(
        m.piece_flops_per_token(2, 1, 4096),
        attention / 2.0 + 2.0 * d * e + k * 6.0 * d * f
    );
    // Routed rows: k·(2d + 3F) + 2E a token beside the attention's.
    assert_eq!(m.moe_activation_elems(), k * (2.0 * d + 3.0 * f) + 2.0 * e);
    let shapes = |ep| rank_shapes(&m, &expert_layout(8, 1, ep, 1, 1), 4096);
    assert_eq!(shapes(1)[0].flops, shapes(8)[0].flops);
}

/// A rank's expert part of the state is `1/ep` of all experts' exactly without ZeRO (and for
/// the parameters and gradients under ZeRO-1), the rest unchanged; ZeRO shards the experts
/// over the dp·cp/ep ranks holding the same experts, at ZeRO-3 their values too (as Bonfire's
/// engine gathers a layer's experts over their replicas).
/// Activations do not change with ep (balanced loads).
#[test]
fn expert_state_is_divided_by_ep_exactly() {
    let m = mixtral();
    let req = bf16(64, 4096);
    let p = MixedPrecision::bf16();
    let experts = m.block_expert_params() * m.n_layers;
    let dense = m.num_params() - experts;
    let at = |ep: usize, zero| {
        let l = expert_layout(8, 1, ep, 1, 1)
            .with_zero(zero)
            .with_precision(p);
        let shapes = rank_shapes(&m, &l, req.seq);
        assert_eq!(shapes[0].expert_params, experts / ep);
        assert_eq!(shapes[0].params, dense + experts / ep);
        rank_memory(&m, &req, &l, &shapes, 0)
    };
    for ep in [1, 2, 4, 8] {
        let zero0 = at(ep, ZeroStage::Zero0);
        let d = state_bytes(ZeroStage::Zero0, dense, 8, p, false).total();
        let e = state_bytes(ZeroStage::Zero0, experts, 8, p, false).total();
        assert!(close(zero0.state.total() - d, e / ep as f64), "ep={ep}");
        assert_eq!(zero0.activations, at(1, ZeroStage::Zero0).activations);
        let zero1 = at(ep, ZeroStage::Zero1).state;
        let (d1, e1) = (
            state_bytes(ZeroStage::Zero1, dense, 8, p, false),
            state_bytes(ZeroStage::Zero1, experts, 8, p, false),
        );
        assert!(close(zero1.params - d1.params, e1.params / ep as f64));
        assert!(close(zero1.grads - d1.grads, e1.grads / ep as f64));
        assert!(close(zero1.optim, d1.optim + e1.optim), "ep={ep}");
        // ZeRO-3 shards a rank's experts over the 8/ep ranks holding them (values too: the
        // engine gathers a layer's experts over their replicas), the rest over all 8.
        let zero3 = at(ep, ZeroStage::Zero3).state.total();
        let d3 = state_bytes(ZeroStage::Zero3, dense, 8, p, false).total();
        let by_hand = state_bytes(ZeroStage::Zero3, experts / ep, 8 / ep, p, false);
        assert!(close(zero3 - d3, by_hand.total()), "ep={ep}");
        let l = expert_layout(8, 1, ep, 1, 1).with_zero(ZeroStage::Zero3);
        assert!(close(
            rank_state(&l.with_precision(p), dense + experts / ep, experts / ep).total() - d3,
            by_hand.total()
        ));
    }
}

/// Each all-to-all sends `tokens·k·d·(ep−1)/ep` values a rank; a layer makes four a
/// micro-batch (six recomputing), none without ep or for a dense model; a step's ep time is
/// micro-batches × MoE layers × that.
/// Under ep > 1, ZeRO 1–2 reduce the experts' own flat vector inside backward after the
/// other parameters (their gradients and its packed copy beside the dense whole gradient),
/// and the step copies only the dense gradients: the larger of the two moments (measured on
/// the held-out Mixtral rows, `examples/tests/planner_heldout.rs`). At ep = 1 the step's
/// copies of every gradient, as before.
#[test]
fn zero_under_ep_reduces_the_experts_apart() {
    let m = mixtral();
    let req = bf16(64, 4096);
    let experts = m.block_expert_params() * m.n_layers;
    let dense = m.num_params() - experts;
    for zero in [ZeroStage::Zero1, ZeroStage::Zero2] {
        for ep in [1, 2, 8] {
            let l = expert_layout(8, 1, ep, 1, 1)
                .with_zero(zero)
                .with_precision(MixedPrecision::bf16());
            let shapes = rank_shapes(&m, &l, req.seq);
            let parts = rank_memory(&m, &req, &l, &shapes, 0);
            let (d, e) = (dense as f64 * 4.0, (experts / ep) as f64 * 4.0);
            let want = match ep {
                1 => ZERO_STEP_GRADIENT_COPIES * (d + e),
                _ => (d + 2.0 * e - parts.state.grads).max(ZERO_STEP_GRADIENT_COPIES * d),
            };
            assert!(close(parts.sum_transient, want), "{zero:?} ep={ep}");
        }
    }
}

#[test]
fn all_to_all_bytes_and_time_by_formula() {
    let m = mixtral();
    let cluster = h100s(4, 8);
    let req = bf16(64, 4096);
    let l = expert_layout(32, 1, 8, 1, 1).with_precision(MixedPrecision::bf16());
    // 64 sequences over dp 32: 2 sequences, 8192 tokens a rank and micro-batch.
    let tokens = 8192.0;
    let bytes = all_to_all_bytes(&m, &l, tokens);
    assert_eq!(bytes, 8192.0 * 2.0 * 4096.0 * 7.0 / 8.0 * 2.0);
    let nvlink = &cluster.intra;
    let one = bytes / nvlink.bandwidth + 7.0 * nvlink.latency + nvlink.call;
    assert!(close(
        all_to_all(bytes, 8, 7, &cluster.intra, &cluster.inter),
        one
    ));
    assert!(close(ep_per_layer(&m, &cluster, &l, tokens), 4.0 * one));
    let recompute = l
        .clone()
        .with_recompute(bonfire_layout::Recompute::Every(1));
    assert!(close(
        ep_per_layer(&m, &cluster, &recompute, tokens),
        6.0 * one
    ));
    let e = cost(&m, &cluster, &req, &l);
    assert!(close(e.time.ep_comm, 32.0 * 4.0 * one));
    // No ep, or a dense model: nothing sent.
    let plain = context_layout(32, 1, 1, 1).with_precision(MixedPrecision::bf16());
    assert_eq!(all_to_all_bytes(&m, &plain, tokens), 0.0);
    assert_eq!(cost(&m, &cluster, &req, &plain).time.ep_comm, 0.0);
    let llama = ModelSpec::preset("llama3-8b").unwrap();
    assert_eq!(all_to_all_bytes(&llama, &l, tokens), 0.0);
}

/// ep is refused where E % ep ≠ 0 or ep ∤ dp·cp; the search only tries divisors of both, and
/// under HSDP divisors of the shard group's dp × cp (ep inside each replica).
#[test]
fn ep_is_refused_unless_it_divides_the_experts_and_dp_cp() {
    let m = mixtral();
    let e = expert_layout(6, 1, 3, 1, 1).check_model(&m, 6).unwrap_err();
    assert!(e.contains("ep=3 does not divide the 8 experts"), "{e}");
    let e = expert_layout(6, 1, 4, 1, 1).check_model(&m, 6).unwrap_err();
    assert!(e.contains("ep=4 does not divide dp × cp = 6"), "{e}");
    assert!(expert_layout(6, 1, 2, 1, 1).check_model(&m, 6).is_ok());
    assert!(expert_layout(4, 2, 8, 1, 1).check_model(&m, 4).is_ok());
    let hsdp = hsdp_layout(2, 4, 1, 1, 1)
        .with_degree(bonfire_layout::Axis::Ep, 2)
        .with_zero(ZeroStage::Zero1);
    assert!(hsdp.check_model(&m, 8).is_ok());
    assert_eq!(expert_degrees(&m, 12).collect::<Vec<_>>(), [1, 2, 4]);
    assert_eq!(expert_degrees(&m, 6).collect::<Vec<_>>(), [1, 2]);
    let (layouts, _) = candidates(&m, &h100s(3, 8), &bf16(48, 4096));
    assert!(layouts.iter().any(|l| l.ep() == 8));
    assert!(layouts.iter().any(|l| l.ep() > 1 && l.dp_replicate() > 1));
    for l in &layouts {
        assert_eq!(8 % l.ep(), 0, "{l}");
        assert_eq!(l.dp() * l.cp() % l.ep(), 0, "{l}");
        assert!(!l.tp_options.sequence_parallel, "{l}");
        l.validate(24).unwrap();
    }
}

/// A dense model never gets ep > 1: not searched, and refused if asked.
#[test]
fn a_dense_model_never_gets_ep() {
    for name in ["llama3-8b", "gpt-bench"] {
        let m = ModelSpec::preset(name).unwrap();
        let (layouts, _) = candidates(&m, &h100s(2, 8), &bf16(64, 128));
        assert!(layouts.iter().all(|l| l.ep() == 1), "{name}");
        assert_eq!(expert_degrees(&m, 16).collect::<Vec<_>>(), [1]);
        let e = expert_layout(8, 1, 2, 1, 1).check_model(&m, 8).unwrap_err();
        assert!(e.contains("needs a mixture of experts"), "{e}");
    }
}

/// An ep group of ep consecutive dp × cp ranks, `tp` apart: inside a node while `ep·tp`
/// consecutive ranks stay in one — with 4 devices a node, ep = 8 spans two and 4 of each
/// rank's 7 peers are across the inter-node link, which costs more than NVLink alone. Also
/// a group cut by a node boundary that the span rule alone would miss.
#[test]
fn an_inter_node_ep_group_costs_more_than_an_intra_node_one() {
    let m = mixtral();
    let req = bf16(64, 4096);
    let l = expert_layout(16, 1, 8, 1, 1).with_precision(MixedPrecision::bf16());
    let (eight, four) = (h100s(2, 8), h100s(4, 4));
    assert_eq!(expert_group_local_peers(&eight, &l), 7);
    assert_eq!(expert_group_local_peers(&four, &l), 3);
    let (inside, across) = (cost(&m, &eight, &req, &l), cost(&m, &four, &req, &l));
    // On the wire 4/7 of the bytes at 50 GB/s against all of them at 450: 5.1 ×.
    assert!(
        across.time.ep_comm > 4.5 * inside.time.ep_comm,
        "{} vs {}",
        across.time.ep_comm,
        inside.time.ep_comm
    );
    // tp stretches the group: ep 4 × tp 2 fills a node of 8, ep 8 × tp 2 does not.
    let tp2 = |ep| expert_layout(8, 1, ep, 2, 1);
    assert_eq!(expert_group_local_peers(&eight, &tp2(4)), 3);
    assert_eq!(expert_group_local_peers(&eight, &tp2(8)), 3);
    // pp 2 × dp 4 on nodes of 6: the second stage's group is ranks 4–7, cut by the node
    // boundary at 6 although its span (4) fits a node.
    let cut = expert_layout(4, 1, 4, 1, 2);
    assert_eq!(expert_group_local_peers(&h100s(2, 6), &cut), 1);
    assert_eq!(expert_group_local_peers(&h100s(1, 8), &cut), 3);
}

/// Mixtral 8x7B on 4 and 8 nodes of 8 H100s (NVLink, IB), 256 and 512 sequences of 4096
/// tokens in bf16: the first choice splits the experts (ep > 1) inside a node, with no tp
/// (the experts would be computed on every tp rank), fits 90 % of 80 GB, and its reasons say
/// where the all-to-alls run; Megatron-LM's recommended training layout for the model (TP 1,
/// PP 4, EP 8, `examples/mixtral/README.md`) is in the list within 15 %.
#[test]
fn mixtral_8x7b_picks_a_sane_layout() {
    let m = mixtral();
    for (nodes, batch) in [(4, 256), (8, 512)] {
        let cluster = h100s(nodes, 8);
        let p = plan(&m, &cluster, &bf16(batch, 4096)).unwrap();
        let top = &p.ranked[0];
        let l = &top.layout;
        assert!(l.ep() > 1 && l.tp() == 1, "{l}");
        assert_eq!(expert_group_local_peers(&cluster, l), l.ep() - 1, "{l}");
        assert!(top.bytes() <= 0.9 * 80.0 * (1u64 << 30) as f64);
        assert!(top.time.ep_comm > 0.0);
        assert!(
            l.record().contains(&format!(" ep={} ", l.ep())),
            "{}",
            l.record()
        );
        let why = p.why.join("\n");
        assert!(why.contains("per rank (ep="), "{why}");
        assert!(why.contains("not hidden"), "{why}");
        let megatron = p
            .ranked
            .iter()
            .find(|e| (e.layout.tp(), e.layout.pp(), e.layout.ep()) == (1, 4, 8))
            .expect("TP 1, PP 4, EP 8 fits");
        assert!(megatron.time.total() < 1.15 * top.time.total());
    }
}

/// The JSON description: `arch: mixtral` with `n_experts` and `experts_per_token`; each
/// missing or impossible one named; expert fields refused on a dense model.
#[test]
fn mixtral_from_json() {
    let base = r#""vocab_size": 32000, "d_model": 4096, "n_heads": 32, "n_kv_heads": 8,
        "n_layers": 32, "seq_len": 32768, "d_ff": 14336"#;
    let json = |extra: &str| format!("{{{base}, {extra}}}");
    let m = ModelSpec::from_json(
        "m.json",
        &json(r#""arch": "mixtral", "n_experts": 8, "experts_per_token": 2"#),
    )
    .unwrap();
    assert_eq!(m.num_params(), mixtral().num_params());
    assert_eq!(m.moe(), mixtral().moe());
    let err = |extra: &str| ModelSpec::from_json("m.json", &json(extra)).unwrap_err();
    let e = err(r#""arch": "mixtral", "experts_per_token": 2"#).to_string();
    assert!(e.contains("n_experts"), "{e}");
    let e = err(r#""arch": "mixtral", "n_experts": 2, "experts_per_token": 3"#).to_string();
    assert!(e.contains("experts_per_token"), "{e}");
    let e = err(r#""arch": "llama", "n_experts": 8"#).to_string();
    assert!(
        e.contains("n_experts") && e.contains("unknown field"),
        "{e}"
    );
}

/// DeepSeek-V3's published training layout (arXiv:2412.19437, §3.2: 2048 H800 GPUs, 16-way
/// pipeline (DualPipe), 64-way expert parallelism over 8 nodes, ZeRO-1 data parallelism, no
/// tensor parallelism) on its preset (`deepseek-v3-671b`: latent attention, 3 dense layers,
/// 256 routed experts and a shared one a layer, 671 B parameters; no multi-token-prediction
/// module), H800s as H100s with the report's 160 GB/s NVLink, 16,384 sequences of 4096 in
/// bf16 (not FP8). The published degrees fit and are in the list, behind groups inside a
/// node: their 64-way all-to-alls send 56 of every 63 shares over IB, which the planner does
/// not hide (DualPipe overlaps them; node-limited routing caps a token at 4 nodes — neither
/// modelled).
#[test]
fn deepseek_v3_published_layout_fits_behind_intra_node_ep() {
    let mut m = ModelSpec::preset("deepseek-v3-671b").unwrap();
    m.attention = bonfire_plan::AttentionKind::Flash;
    let mut cluster = h100s(256, 8);
    cluster.intra = LinkSpec {
        name: "nvlink-h800".into(),
        bandwidth: 160e9,
        ..cluster.intra
    };
    let p = plan(&m, &cluster, &bf16(16_384, 4096)).unwrap();
    let top = &p.ranked[0];
    assert!(
        top.layout.ep() > 1 && top.layout.tp() == 1,
        "{}",
        top.layout
    );
    assert_eq!(
        expert_group_local_peers(&cluster, &top.layout),
        top.layout.ep() - 1
    );
    let published = |l: &ParallelDims| {
        (l.pp(), l.dp(), l.cp(), l.tp(), l.ep(), l.zero) == (16, 128, 1, 1, 64, ZeroStage::Zero1)
    };
    let (rank, e) = p
        .ranked
        .iter()
        .enumerate()
        .find(|(_, e)| published(&e.layout))
        .unwrap();
    println!(
        "first: {} {:?} {:?}",
        top.layout,
        top.memory.total(),
        top.time
    );
    println!(
        "published: #{rank} of {}: {} {:?} {:?}",
        p.ranked.len(),
        e.layout,
        e.memory.total(),
        e.time
    );
    assert_eq!(expert_group_local_peers(&cluster, &e.layout), 7);
    assert!(e.time.ep_comm > 2.0 * top.time.ep_comm);
    assert!(e.time.total() > top.time.total());
}

/// HSDP with ep (ep inside each replica, as the engine runs it): a rank's state is the dense
/// part sharded over the shard group and its experts over the dp·cp/ep ranks holding them,
/// and the all-reduce across the replicas carries both shards.
#[test]
fn hsdp_with_ep_shards_the_experts_inside_a_replica() {
    let m = mixtral();
    let p = MixedPrecision::bf16();
    let l = hsdp_layout(2, 4, 1, 1, 1)
        .with_degree(bonfire_layout::Axis::Ep, 2)
        .with_zero(ZeroStage::Zero2)
        .with_precision(p);
    let experts = m.block_expert_params() * m.n_layers;
    let dense = m.num_params() - experts;
    let shapes = rank_shapes(&m, &l, 4096);
    assert_eq!(shapes[0].expert_params, experts / 2);
    let got = rank_state(&l, dense + experts / 2, experts / 2).total();
    let want = state_bytes(ZeroStage::Zero2, dense, 4, p, false).total()
        + state_bytes(ZeroStage::Zero2, experts / 2, 2, p, false).total();
    assert!(close(got, want), "{got} vs {want}");
    let cluster = h100s(1, 8);
    let with = replica_all_reduce(&cluster, &l, dense as f64, (experts / 2) as f64);
    let without = replica_all_reduce(&cluster, &l, dense as f64, 0.0);
    // Shards of Ψ_d/4 and Ψ_e/2/2: the experts' share of the volume is Ψ_e/4 against Ψ_d/4.
    let ratio = (with - without) / without;
    assert!(
        ratio > 0.8 * experts as f64 / dense as f64 && ratio < 1.2 * experts as f64 / dense as f64,
        "{ratio}"
    );
}
