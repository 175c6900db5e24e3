//! A mixture of experts' router ([`Router`], transformers' `mlp.gate`): logits `[E]` per token
//! from one `[E, d]` weight, then a [`Scoring`] — the Mixtral's and Qwen3-MoE's softmax and
//! top k, or DeepSeek-V3's sigmoid scores chosen within the best groups with its balancing
//! bias (`e_score_correction_bias`: state, not a parameter — no gradient, no optimizer) and
//! weighted by `routed_scaling_factor`. Logits are in the compute dtype; scores, choice and
//! weights in f32.

use burn::module::{Module, Param};
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{DType, Device, Int, Tensor};

/// How a router turns logits into each token's choice and weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scoring {
    /// p = softmax(logits); the k largest p, weighted by p (renormalized over the k when
    /// `renormalize`).
    Softmax {
        /// Divide the k weights by their sum.
        renormalize: bool,
    },
    /// DeepSeek-V3: s = sigmoid(logits); the choice ranks s + bias within the `topk_group`
    /// best of `n_group` groups of experts (a group's score: its two largest s + bias), the
    /// others masked; the k chosen weighted by s (divided by their sum + 1e-20 when
    /// `renormalize`) × `scaling`.
    GroupLimited {
        /// Groups of experts (E divisible by it).
        n_group: usize,
        /// Groups a token may choose from.
        topk_group: usize,
        /// The weights' factor (`routed_scaling_factor`).
        scaling: f64,
        /// Divide the k weights by their sum.
        renormalize: bool,
    },
}

/// What a router chose for `N` tokens.
#[derive(Debug, Clone)]
pub struct Choice {
    /// `[N, E]`: the scores (softmax probabilities, or sigmoid scores), with their gradient.
    pub scores: Tensor<2>,
    /// `[N, E]`: each expert's rank among the token's choice (no gradient).
    pub ranks: Tensor<2>,
    /// `[N, E]`: 1 where the expert is among the token's k, else 0 (no gradient).
    pub chosen: Tensor<2>,
    /// `[N, E]`: the chosen experts' weights, 0 elsewhere.
    pub weights: Tensor<2>,
}

/// A router (see the module docs).
#[derive(Module, Debug)]
pub struct Router {
    /// `[E, d]`.
    pub weight: Param<Tensor<2>>,
    /// DeepSeek-V3's balancing bias `[E]` added to the scores for the choice only: a
    /// parameter that requires no gradient (state).
    pub e_score_correction_bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    scoring: Scoring,
}

impl Router {
    /// A N(0, 0.02) router of `e` experts on `d`, scoring as `scoring` says (with a zero
    /// bias when it is group-limited).
    pub fn new(d: usize, e: usize, scoring: Scoring, device: &Device) -> Self {
        // The draw of a `ParallelLinear` of the same shape (the router was one).
        let weight = bonfire_tp::ParallelLinear::new(d, e, false, device).weight;
        let bias = matches!(scoring, Scoring::GroupLimited { .. })
            .then(|| Param::from_tensor(Tensor::<1>::zeros([e], device)).set_require_grad(false));
        Self {
            weight,
            e_score_correction_bias: bias,
            scoring,
        }
    }

    /// How it scores.
    pub fn scoring(&self) -> Scoring {
        self.scoring
    }

    /// Experts (E).
    pub fn experts(&self) -> usize {
        self.weight.dims()[0]
    }

    /// The logits `[N, E]` of tokens `x` `[N, d]` (a linear layer's product: a zero-bubble
    /// stage defers its weight gradient).
    pub fn logits(&self, x: Tensor<2>) -> Tensor<2> {
        bonfire_module::weight_grad::linear_matmul(x, self.weight.val())
    }

    /// Each token's `k` experts and their weights (see [`Scoring`]).
    pub fn route(&self, x: Tensor<2>, k: usize) -> Choice {
        let logits = self.logits(x).cast(DType::F32);
        match self.scoring {
            Scoring::Softmax { renormalize } => {
                let p = softmax(logits, 1);
                let ranks = expert_ranks(p.clone());
                choose(p, ranks, k, renormalize, 1.0)
            }
            Scoring::GroupLimited {
                n_group,
                topk_group,
                scaling,
                renormalize,
            } => {
                let s = sigmoid(logits);
                let mut choice = s.clone().detach();
                if let Some(b) = &self.e_score_correction_bias {
                    choice = choice + b.val().cast(DType::F32).unsqueeze::<2>();
                }
                let ranks = expert_ranks(group_limited(choice, n_group, topk_group));
                choose(s, ranks, k, renormalize, scaling)
            }
        }
    }
}

/// The choice's scores `[N, E]` with every expert outside each token's `topk_group` best
/// groups set to −∞ (a group's score: the sum of its two largest).
fn group_limited(choice: Tensor<2>, n_group: usize, topk_group: usize) -> Tensor<2> {
    let [n, e] = choice.dims();
    let per = e / n_group;
    let grouped = choice.clone().reshape([n * n_group, per]);
    let top2 = expert_ranks(grouped.clone()).lower_elem(2.0).float();
    let group_scores = (grouped * top2).sum_dim(1).reshape([n, n_group]);
    let kept = expert_ranks(group_scores)
        .lower_elem(topk_group as f64)
        .float(); // [N, G]
    let kept = kept
        .unsqueeze_dim::<3>(2)
        .repeat_dim(2, per)
        .reshape([n, e]);
    choice.mask_fill(kept.equal_elem(0.0), f32::NEG_INFINITY)
}

/// The `k` experts of rank below `k` and their weights: `scores` there (÷ their sum + 1e-20
/// when `renormalize`: the 1e-20 is DeepSeek's, and changes no softmax sum) × `scaling`.
fn choose(
    scores: Tensor<2>,
    ranks: Tensor<2>,
    k: usize,
    renormalize: bool,
    scaling: f64,
) -> Choice {
    let chosen = ranks.clone().lower_elem(k as f64).float();
    let kept = scores.clone() * chosen.clone();
    let mut weights = match renormalize {
        true => kept.clone() / kept.sum_dim(1).add_scalar(1e-20),
        false => kept,
    };
    if scaling != 1.0 {
        weights = weights.mul_scalar(scaling);
    }
    Choice {
        scores,
        ranks,
        chosen,
        weights,
    }
}

/// `[N, E]`: expert e's rank among token n's experts — the number of experts with a larger
/// p, or an equal p and a lower index (ties: the lower index first). No gradient.
pub fn expert_ranks(p: Tensor<2>) -> Tensor<2> {
    let [_, e] = p.dims();
    let device = p.device();
    let p = p.detach();
    let mine = p.clone().unsqueeze_dim::<3>(2); // [N, E, 1]: p_e
    let other = p.unsqueeze_dim::<3>(1); // [N, 1, E]: p_e'
    let idx = Tensor::<1, Int>::arange(0..e as i64, &device);
    // lower[e, e'] = 1 where e' < e.
    let lower = idx
        .clone()
        .unsqueeze_dim::<2>(0)
        .lower(idx.unsqueeze_dim::<2>(1))
        .float()
        .unsqueeze_dim::<3>(0);
    let ahead = other.clone().greater(mine.clone()).float() + other.equal(mine).float() * lower;
    ahead.sum_dim(2).squeeze_dim::<2>(2)
}

/// `[N, E]` 1 where expert e is among token n's `k` most probable (its rank below `k`), else
/// 0. No gradient.
pub fn top_k_mask(p: Tensor<2>, k: usize) -> Tensor<2> {
    expert_ranks(p).lower_elem(k as f64).float()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    fn rows(t: Tensor<2>) -> Vec<f32> {
        t.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap()
    }

    /// Ties go to the lower index; exactly k experts per token.
    #[test]
    fn top_k_breaks_ties_by_the_lower_index() {
        let p = Tensor::<2>::from_data(
            TensorData::new(
                vec![
                    0.25f32, 0.25, 0.25, 0.25, //
                    0.1, 0.3, 0.3, 0.3, //
                    0.4, 0.1, 0.4, 0.1, //
                    0.1, 0.2, 0.3, 0.4,
                ],
                [4, 4],
            ),
            &Device::flex(),
        );
        let want = [
            1.0, 1.0, 0.0, 0.0, //
            0.0, 1.0, 1.0, 0.0, //
            1.0, 0.0, 1.0, 0.0, //
            0.0, 0.0, 1.0, 1.0,
        ];
        assert_eq!(rows(top_k_mask(p, 2)), want);
    }
}
