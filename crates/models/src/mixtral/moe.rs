//! The Mixtral's sparse mixture-of-experts feed-forward ([`SparseMoe`], transformers'
//! `MixtralSparseMoeBlock`, Qwen3-MoE's too; in the layers a family keeps dense, a SwiGLU MLP
//! in its place): a router picks each token's top k of E experts,
//! and only those run on it, weighted by the router's probabilities — renormalized over the k
//! (the Mixtral; Qwen3-MoE when `norm_topk_prob`) or as they are. Dropless: each expert
//! takes every token routed to it, however many (none too).
//!
//! The tokens are grouped by expert with expert parallelism's primitives
//! ([`bonfire_ep::permute`]: the order computed on the device, only the E counts
//! read to the host through the data plane), each expert runs on its consecutive rows, and
//! [`bonfire_ep::unpermute`] adds each token's outputs back weighted. An expert
//! with no token is skipped: the rows of the fused parameters that are its own get a zero
//! gradient.

use super::router::{Router, Scoring};
use crate::decoder_layer::FeedForward;
use crate::llama::model::{Mlp, swiglu, swiglu_mlp};
use bonfire_ep::{permute, run_experts, unpermute};
use bonfire_tp::ParallelLinear;
use burn::module::{Module, Param};
use burn::tensor::{Device, Int, Tensor};

/// The experts of one layer, stored fused as transformers 5 stores them.
#[derive(Module, Debug)]
pub struct Experts {
    /// `[E, 2F, d]`: rows `0..F` of expert e are its gate projection, `F..2F` its up
    /// projection.
    pub gate_up_proj: Param<Tensor<3>>,
    /// `[E, d, F]`: each expert's down projection.
    pub down_proj: Param<Tensor<3>>,
}

impl Experts {
    /// `e` N(0, 0.02) experts of width `f` on `d`.
    pub fn new(e: usize, d: usize, f: usize, device: &Device) -> Self {
        let normal = |shape: [usize; 3]| {
            Param::from_tensor(bonfire_module::params::normal(shape, 0.0, 0.02, device))
        };
        Self {
            gate_up_proj: normal([e, 2 * f, d]),
            down_proj: normal([e, d, f]),
        }
    }

    /// Expert `e` on its tokens `x` `[c, d]`: `down_e(SiLU(g_e x) ⊙ u_e x)`.
    pub fn expert(&self, e: usize, x: Tensor<2>) -> Tensor<2> {
        let [_, two_f, d] = self.gate_up_proj.dims();
        let f = two_f / 2;
        let dtype = x.dtype();
        let gate_up = self.gate_up_proj.val().narrow(0, e, 1).reshape([two_f, d]);
        let down = self.down_proj.val().narrow(0, e, 1).reshape([d, f]);
        let (gate_up, down) = (gate_up.cast(dtype), down.cast(dtype));
        let h = bonfire_kernels::matmul(x, gate_up.transpose());
        let act = swiglu(h.clone().narrow(1, 0, f), h.narrow(1, f, f));
        bonfire_kernels::matmul(act, down.transpose())
    }
}

/// What a layer's router chose, per token, for the load-balancing loss.
#[derive(Debug, Clone)]
pub struct Routing {
    /// `[B, T, E]`: the router probabilities p_e of each token (with their gradient).
    pub probs: Tensor<3>,
    /// `[B, T, E]`: 1 where expert e is among the token's top k, else 0 (no gradient).
    pub counts: Tensor<3>,
    /// Whether the layer routed (a dense layer reports zeros, and counts in no balance).
    pub sparse: bool,
}

/// A mixture-of-experts model's feed-forward in one layer (transformers' `mlp`): the sparse
/// block — the [`Router`] `gate` and the [`Experts`], with DeepSeek's `shared_experts` (a
/// SwiGLU MLP every token goes through) beside them — or, in a layer the family keeps dense
/// (Qwen3-MoE's `mlp_only_layers`, DeepSeek's first layers), a SwiGLU MLP. The parts carry
/// transformers' names: a sparse layer's `gate`, `experts`, `shared_experts`, a dense one's
/// `gate_proj`, `up_proj`, `down_proj`.
#[derive(Module, Debug)]
pub struct SparseMoe {
    /// The router (a sparse layer).
    pub gate: Option<Router>,
    /// The experts (a sparse layer).
    pub experts: Option<Experts>,
    /// DeepSeek's shared experts: one SwiGLU MLP of `n_shared_experts` experts' width.
    pub shared_experts: Option<Mlp>,
    /// A dense layer's projections `[F, d]`.
    pub gate_proj: Option<ParallelLinear>,
    /// A dense layer's projections `[F, d]`.
    pub up_proj: Option<ParallelLinear>,
    /// A dense layer's output projection `[d, F]`.
    pub down_proj: Option<ParallelLinear>,
    num_experts: usize,
    top_k: usize,
}

impl SparseMoe {
    /// A fresh block of `e` experts of width `f` on `d`, routing each token to `top_k`, their
    /// weights renormalized over the k (the Mixtral's router).
    pub fn new(d: usize, f: usize, e: usize, top_k: usize, device: &Device) -> Self {
        let scoring = Scoring::Softmax { renormalize: true };
        Self::routed(d, f, (e, top_k), scoring, None, device)
    }

    /// A fresh block of `e` experts of width `f` on `d` routing `top_k` a token as `scoring`
    /// says, with `shared` shared experts' MLP (its width) beside them.
    pub fn routed(
        d: usize,
        f: usize,
        (e, top_k): (usize, usize),
        scoring: Scoring,
        shared: Option<usize>,
        device: &Device,
    ) -> Self {
        Self {
            gate: Some(Router::new(d, e, scoring, device)),
            experts: Some(Experts::new(e, d, f, device)),
            shared_experts: shared.map(|w| Mlp::new(d, w, device)),
            gate_proj: None,
            up_proj: None,
            down_proj: None,
            num_experts: e,
            top_k,
        }
    }

    /// A dense layer of a model with `e` experts a layer: a fresh SwiGLU MLP of width `f`.
    pub fn dense(d: usize, f: usize, e: usize, device: &Device) -> Self {
        let Mlp {
            gate_proj,
            up_proj,
            down_proj,
        } = Mlp::new(d, f, device);
        Self {
            gate: None,
            experts: None,
            shared_experts: None,
            gate_proj: Some(gate_proj),
            up_proj: Some(up_proj),
            down_proj: Some(down_proj),
            num_experts: e,
            top_k: 0,
        }
    }

    /// Experts a layer of the model has (E; a dense layer's model's too).
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Whether this layer routes to experts (else it is dense).
    pub fn is_sparse(&self) -> bool {
        self.gate.is_some()
    }

    /// Experts per token (k).
    pub fn top_k(&self) -> usize {
        self.top_k
    }
}

/// Each token's k chosen experts `[N, k]` (slot j: the expert of rank j) and their weights
/// `[N, k]` taken from `weights` `[N, E]`.
fn chosen_experts(ranks: Tensor<2>, weights: Tensor<2>, k: usize) -> (Tensor<2, Int>, Tensor<2>) {
    let e = ranks.dims()[1];
    let index = Tensor::<1, Int>::arange(0..e as i64, &ranks.device())
        .float()
        .unsqueeze_dim::<2>(0);
    let (mut ids, mut ws) = (Vec::with_capacity(k), Vec::with_capacity(k));
    for slot in 0..k {
        let at = ranks.clone().equal_elem(slot as f64).float();
        ids.push((at.clone() * index.clone()).sum_dim(1));
        ws.push((weights.clone() * at).sum_dim(1));
    }
    (Tensor::cat(ids, 1).int(), Tensor::cat(ws, 1))
}

impl FeedForward for SparseMoe {
    type Routing = Routing;

    /// `x` `[B, T, d]`: the weighted sum of each token's chosen experts, and the routing (a
    /// dense layer: its MLP, and zeros).
    fn forward_routed(&self, x: Tensor<3>) -> (Tensor<3>, Routing) {
        let (Some(gate), Some(bank)) = (&self.gate, &self.experts) else {
            return self.dense_forward(x);
        };
        let [b, t, d] = x.dims();
        let n = b * t;
        let e = gate.experts();
        let dtype = x.dtype();
        // The router's scores, choice and weights in f32 (as transformers computes them),
        // whatever the compute dtype; the experts in the compute dtype.
        let choice = gate.route(x.clone().reshape([n, d]), self.top_k);
        let routing = Routing {
            probs: choice.scores.reshape([b, t, e]),
            counts: choice.chosen.reshape([b, t, e]),
            sparse: true,
        };
        let (experts, weights) = chosen_experts(choice.ranks, choice.weights, self.top_k);
        let (grouped, perm) = permute(x.clone().reshape([n, d]), experts, e);
        if let Some(bias) = &gate.e_score_correction_bias {
            // Each expert's rows, for the balancing bias's update after the step.
            let loads = perm.counts().iter().map(|&c| c as f64);
            bonfire_module::state::record(bias.id, loads);
        }
        let rows = run_experts(grouped, perm.counts(), |i, rows| bank.expert(i, rows))
            .unwrap_or_else(|err| panic!("expert parallelism: {err}"));
        let out = unpermute(rows, &perm, weights.cast(dtype)).reshape([b, t, d]);
        match &self.shared_experts {
            Some(shared) => (out + shared.forward(x), routing),
            None => (out, routing),
        }
    }
}

impl SparseMoe {
    /// A dense layer on `x` `[B, T, d]`: `down(SiLU(gate(x)) ⊙ up(x))`, and a routing of zeros.
    fn dense_forward(&self, x: Tensor<3>) -> (Tensor<3>, Routing) {
        fn part(p: &Option<ParallelLinear>) -> &ParallelLinear {
            p.as_ref().expect("a dense layer's projection")
        }
        let [b, t, _] = x.dims();
        let parts = [&self.gate_proj, &self.up_proj, &self.down_proj].map(part);
        let y = swiglu_mlp(parts, x);
        let zeros = Tensor::<3>::zeros([b, t, self.num_experts], &y.device());
        let routing = Routing {
            probs: zeros.clone(),
            counts: zeros,
            sparse: false,
        };
        (y, routing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mixtral::router::top_k_mask;
    use burn::tensor::Distribution;
    use burn::tensor::activation::softmax;

    fn device() -> Device {
        Device::flex().autodiff()
    }

    fn rows(t: Tensor<2>) -> Vec<f32> {
        t.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap()
    }

    fn router(moe: &SparseMoe) -> &Router {
        moe.gate.as_ref().unwrap()
    }

    fn experts(moe: &SparseMoe) -> &Experts {
        moe.experts.as_ref().unwrap()
    }

    /// The gradients of (`out` · `r`).sum() for the router and both expert tensors.
    fn grads_of(moe: &SparseMoe, out: Tensor<2>, r: Tensor<2>) -> Vec<Vec<f32>> {
        let grads = (out * r).sum().backward();
        let flat = |t: Option<Tensor<3>>| {
            t.unwrap()
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .unwrap()
        };
        vec![
            rows(router(moe).weight.val().grad(&grads).unwrap()),
            flat(experts(moe).gate_up_proj.val().grad(&grads)),
            flat(experts(moe).down_proj.val().grad(&grads)),
        ]
    }

    /// The grouped dispatch equals every expert on every token weighted by the renormalized
    /// top-k probabilities (zero for the unchosen), outputs and gradients; an expert that no
    /// token chose (expert 3: positive inputs, a negative router row) gets a zero gradient.
    #[test]
    fn dispatch_equals_the_dense_sum_and_an_idle_expert_gets_zero_gradient() {
        let device = device();
        device.seed(3);
        let (d, f, e, k) = (6, 5, 4, 2);
        let mut moe = SparseMoe::new(d, f, e, k, &device);
        let w = router(&moe).weight.val();
        let w = w.slice_assign([3..4, 0..d], Tensor::ones([1, d], &device).neg());
        moe.gate.as_mut().unwrap().weight = Param::from_tensor(w.detach());
        let x = Tensor::<3>::random([2, 5, d], Distribution::Uniform(0.1, 1.0), &device);
        let r = Tensor::<2>::random([10, d], Distribution::Normal(0.0, 1.0), &device);
        let (y, routing) = moe.forward_routed(x.clone());
        let flat = x.reshape([10, d]);
        let p = softmax(router(&moe).logits(flat.clone()), 1);
        let chosen = top_k_mask(p.clone(), k);
        let kept = p * chosen.clone();
        let weights = kept.clone() / kept.sum_dim(1);
        let mut dense = Tensor::<2>::zeros([10, d], &device);
        for expert in 0..e {
            let we = weights.clone().narrow(1, expert, 1);
            dense = dense + experts(&moe).expert(expert, flat.clone()) * we;
        }
        let y = y.reshape([10, d]);
        let close = |what: &str, got: &[f32], want: &[f32]| {
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() < 1e-6, "{what}: {got:?} vs {want:?}");
            }
        };
        close("output", &rows(y.clone()), &rows(dense.clone()));
        let per_sequence = routing.counts.clone().sum_dim(2).sum_dim(1).reshape([2, 1]);
        assert_eq!(rows(per_sequence), vec![10.0, 10.0]);
        let counts = rows(chosen.sum_dim(0));
        assert_eq!(counts[3], 0.0, "{counts:?}");
        let (got, want) = (grads_of(&moe, y, r.clone()), grads_of(&moe, dense, r));
        for (what, (g, w)) in ["router", "gate_up_proj", "down_proj"]
            .iter()
            .zip(got.iter().zip(&want))
        {
            close(what, g, w);
        }
        let per_expert = got[1].len() / e;
        for (expert, rows) in got[1].chunks(per_expert).enumerate() {
            let used = rows.iter().any(|&v| v != 0.0);
            assert_eq!(used, counts[expert] > 0.0, "expert {expert}: {counts:?}");
        }
    }
}
