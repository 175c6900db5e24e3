//! ZeRO-3 under expert parallelism when a rank's experts get no token: 4 rank threads, ep
//! groups {0, 1} and {2, 3}, the experts' replicas {0, 2} and {1, 3}. The first ep group routes
//! every token to ep rank 0's experts, the second to all four experts, so rank 1 computes no
//! expert while rank 3, holding the same experts, does. Stage 3 gathers the experts per layer
//! over their replicas; the gather's backward is a reduce-scatter that rank 1 must run too
//! (`run_experts` touches its experts on no row). Two SGD steps under ZeRO-3 end with the same
//! parameters as under ZeRO-1 (which gathers nothing), and nothing hangs (a 20 s timeout turns a
//! skipped reduce-scatter into a failure).

use bonfire_comm::{ProcessGroup, ThreadWorld};
use bonfire_dtensor::DeviceMesh;
use bonfire_ep::{ExpertScope, expert_subgroup, permute, run_experts, shard_experts, unpermute};
use bonfire_layout::ZeroStage;
use bonfire_module::DataParallel;
use bonfire_module::layer;
use bonfire_zero::{Zero, ZeroConfig};
use burn::module::{Module, Param};
use burn::optim::SgdConfig;
use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};
use std::time::Duration;

const D: usize = 4;
const E: usize = 4;
const EP: usize = 2;
const TOKENS: usize = 6;

/// A dense projection, then every token through one expert (`[E, D, D]`, stacked by expert).
#[derive(Module, Debug)]
struct Moe {
    dense: Param<Tensor<2>>,
    experts: Param<Tensor<3>>,
}

impl Moe {
    fn new(device: &Device) -> Self {
        device.seed(7);
        let normal = Distribution::Normal(0.0, 0.5);
        Self {
            dense: Param::from_tensor(Tensor::random([D, D], normal, device)),
            experts: Param::from_tensor(Tensor::random([E, D, D], normal, device)),
        }
    }

    /// `x` `[TOKENS, D]` routed to `ids` `[TOKENS, 1]`, through this module's layer copy.
    fn loss(&self, x: Tensor<2>, ids: Tensor<2, Int>) -> Tensor<1> {
        let m = layer(self, &x);
        let h = x.matmul(m.dense.val());
        let (grouped, perm) = permute(h, ids, E);
        let experts = m.experts.val();
        let rows = run_experts(grouped, perm.counts(), |i, rows| {
            rows.matmul(experts.clone().narrow(0, i, 1).reshape([D, D]))
        })
        .unwrap();
        let ones = Tensor::<2>::ones([TOKENS, 1], &rows.device());
        let out = unpermute(rows, &perm, ones);
        (out.clone() * out).mean().reshape([1])
    }
}

/// Rank `r`'s tokens and experts: the first ep group sends every token to experts 0–1 (ep rank
/// 0's), the second to all four. (Values from a formula: the device's random generator is
/// shared by the rank threads.)
fn batch(r: usize, step: usize, device: &Device) -> (Tensor<2>, Tensor<2, Int>) {
    let values: Vec<f32> = (0..TOKENS * D)
        .map(|i| ((i * 7 + r * 13 + step * 29) as f32 * 0.37).sin())
        .collect();
    let x = Tensor::from_data(TensorData::new(values, [TOKENS, D]), device);
    let ids: Vec<i64> = (0..TOKENS)
        .map(|t| {
            if r < EP {
                (t % 2) as i64
            } else {
                (t % E) as i64
            }
        })
        .collect();
    (
        x,
        Tensor::from_data(TensorData::new(ids, [TOKENS, 1]), device),
    )
}

/// Every rank's parameters (dense whole, its experts' slice) after 2 SGD steps at `stage`.
fn train(stage: ZeroStage) -> Vec<Vec<f32>> {
    let device = Device::flex().autodiff();
    let initial = Moe::new(&device);
    ThreadWorld::new(4)
        .timeout(Duration::from_secs(20))
        .launch(|pg: ProcessGroup| {
            let r = pg.rank();
            let ep_group = pg.new_group(&[r / EP * EP, r / EP * EP + 1]).unwrap();
            let replicas = pg.new_group(&[r % EP, r % EP + EP]).unwrap();
            let model = bonfire_module::params::fork(initial.clone(), &device);
            let (model, ids) = shard_experts(model, &["experts".into()], r % EP, EP);
            let experts = expert_subgroup(ids, replicas, EP);
            let mesh = DeviceMesh::one_d(&pg, "dp").unwrap();
            let config = ZeroConfig::new(stage).with_report_no_layers(false);
            let mut z = Zero::on_mesh_with_experts(
                model,
                SgdConfig::new().build(),
                &mesh,
                "dp",
                config,
                experts,
            )
            .unwrap();
            let device = z.device().clone();
            let _scope = ExpertScope { group: ep_group }.enter();
            for step in 0..2 {
                let (x, ids) = batch(r, step, &device);
                z.train_step(0.5, |m: &Moe| m.loss(x, ids)).unwrap();
            }
            z.parameters()
                .unwrap()
                .into_iter()
                .flat_map(|p| p.values)
                .collect()
        })
        .unwrap()
}

#[test]
fn zero3_gathers_experts_a_rank_routes_no_token_to() {
    let want = train(ZeroStage::Zero1);
    let got = train(ZeroStage::Zero3);
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len(), "rank {r}");
        for (a, b) in g.iter().zip(w) {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "rank {r}: {a} vs {b}"
            );
        }
    }
    // The idle rank's experts moved anyway: they are shared with rank 3, which used them.
    let before = Moe::new(&Device::flex().autodiff());
    let initial: Vec<f32> = before
        .experts
        .val()
        .narrow(0, 2, 2)
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap();
    let dense = D * D;
    assert_ne!(
        &got[1][dense..],
        &initial[..],
        "rank 1's experts were stepped"
    );
    assert_eq!(
        got[1][dense..],
        got[3][dense..],
        "replicas hold the same experts"
    );
}
