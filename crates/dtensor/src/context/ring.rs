//! [`ring_attention`]: a rank's queries over the whole sequence's keys, the key/value blocks
//! travelling around the cp ring, merged with an online softmax.

use super::ContextSplit;
use crate::functional::ring_shift_start;
use bonfire_comm::ProcessGroup;
use bonfire_kernels::exp;
use burn::tensor::{DType, Device, Int, Tensor};

/// The base tag of the ring's messages (step `s` uses `RING_TAG + s`).
pub const RING_TAG: u64 = 0x5249_4e47_0000;

/// Added to the scores of a masked (query, key) pair: `exp` of it is 0 against any real
/// score, and it stays finite in every float type Bonfire computes in but f16 (where it
/// rounds to −∞, whose `exp` is 0 as well).
const MASKED: f32 = -1e30;

/// Attention of this rank's queries over every rank's keys and values in the cp `group`:
/// `softmax(q·kᵀ/√hd + mask)·v`, the mask causal on the tokens' positions in the whole
/// sequence when `causal`.
///
/// `q` is `[B, H, T/cp, hd]`, this rank's tokens of the sequence as `split` gives them;
/// `k` and `v` are `[B, H_kv, T/cp, hd]` with `H_kv` dividing `H` (query head `j` attends with
/// kv head `⌊j·H_kv/H⌋`: the `H_kv` heads travel, repeated only where they are used). The
/// `cp − 1` steps of the ring each send this rank's current K/V block to the next rank and
/// receive the previous rank's, the transfer running while the current block is computed
/// ([`ring_shift_start`]); a block entirely in the future of every local query is not
/// computed. No rank holds more than one `[T/cp, T/cp]` block of scores per head at a time in
/// forward (backward keeps one per block, `T/cp × T` per head, never `T × T`). Backward
/// (autodiff) sends each block's dK/dV back around the ring to the rank that owns it.
pub fn ring_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    group: &ProcessGroup,
    split: &ContextSplit,
    causal: bool,
) -> Tensor<4> {
    let (me, cp) = (group.rank(), group.size());
    assert_eq!(
        cp,
        split.cp(),
        "the split is for {} ranks, the group has {cp}",
        split.cp()
    );
    let [_, h, t, hd] = q.dims();
    let hkv = k.dims()[1];
    assert!(
        hkv > 0 && h % hkv == 0,
        "{h} query heads over {hkv} kv heads"
    );
    assert_eq!(
        t,
        split.local_len(),
        "queries of {t} tokens, the split gives {}",
        split.local_len()
    );
    let device = q.device();
    // Query head j attends with kv head ⌊j·hkv/h⌋ (computed on the device).
    let heads = (Tensor::<1, Int>::arange(0..h as i64, &device) * hkv as i64).div_scalar(h as i64);
    let q = q * (1.0 / (hd as f64).sqrt());
    // 16-bit inputs: scores, the softmax and its sums in f32 (as the one-device fused softmax
    // does under autocast), the output back in the input's dtype.
    let dtype = q.dtype();
    let q_pos = split.positions(me);
    let mut kv = Tensor::cat(vec![k, v], 1);
    // (running max, running sum, running numerator) of the online softmax.
    let mut state: Option<Softmax> = None;
    // Blocks not computed still enter the graph with a zero weight: backward must run every
    // ring step on every rank (its peers wait for the gradients it sends back).
    let mut skipped: Option<Tensor<1>> = None;
    for step in 0..cp {
        // The next block travels while this one is computed.
        let next = (step + 1 < cp)
            .then(|| ring_shift_start(kv.clone(), group, RING_TAG + step as u64 + 1));
        let owner = (me + cp - step) % cp;
        let k_pos = split.positions(owner);
        let bias = match (causal, Future::of(&q_pos, &k_pos)) {
            (true, Future::All) => None,
            (true, Future::Some) => Some(Some(causal_bias(split, me, owner, &device))),
            _ => Some(None),
        };
        match bias {
            None => {
                let zero = kv.clone().sum().mul_scalar(0.0);
                skipped = Some(skipped.map_or(zero.clone(), |s| s + zero));
            }
            Some(bias) => {
                let kb = kv.clone().narrow(1, 0, hkv).select(1, heads.clone());
                let vb = kv.clone().narrow(1, hkv, hkv).select(1, heads.clone());
                state = Some(merge(state, q.clone(), kb, vb, bias));
            }
        }
        if let Some(next) = next {
            kv = next.finish();
        }
    }
    let (_, l, acc) = state.expect("a query attends at least to itself");
    let out = (acc / l).cast(dtype);
    match skipped {
        Some(zero) => out + zero.unsqueeze::<4>(),
        None => out,
    }
}

/// The running (max, sum, numerator) of the online softmax over the blocks seen so far.
type Softmax = (Tensor<4>, Tensor<4>, Tensor<4>);

/// `state` with one more block of keys and values (scores shifted by `bias`) merged in.
fn merge(
    state: Option<Softmax>,
    q: Tensor<4>,
    kb: Tensor<4>,
    vb: Tensor<4>,
    bias: Option<Tensor<4>>,
) -> Softmax {
    let wide = |t: Tensor<4>| match t.dtype() {
        DType::F16 | DType::BF16 => t.cast(DType::F32),
        _ => t,
    };
    let mut scores = wide(q.matmul(kb.swap_dims(2, 3)));
    let vb = wide(vb);
    if let Some(bias) = bias {
        scores = scores + bias;
    }
    // The shift by the running max only keeps exp finite: it cancels in the quotient, so it
    // needs no gradient.
    let block_max = scores.clone().detach().max_dim(3);
    // The block's probabilities: kept once (for this exp and the product with the values).
    match state {
        None => {
            let p = exp(scores - block_max.clone());
            (block_max, p.clone().sum_dim(3), p.matmul(vb))
        }
        Some((m, l, acc)) => {
            let m_new = m.clone().max_pair(block_max);
            let alpha = (m - m_new.clone()).exp();
            let p = exp(scores - m_new.clone());
            let l = l * alpha.clone() + p.clone().sum_dim(3);
            (m_new, l, acc * alpha + p.matmul(vb))
        }
    }
}

/// How much of a block of keys lies in the future of a rank's queries.
enum Future {
    /// No key is after any query.
    None,
    /// Some keys are after some queries.
    Some,
    /// Every key is after every query: the block contributes nothing.
    All,
}

impl Future {
    fn of(q_pos: &[usize], k_pos: &[usize]) -> Self {
        let (q_min, q_max) = (q_pos.iter().min(), q_pos.iter().max());
        let (k_min, k_max) = (k_pos.iter().min(), k_pos.iter().max());
        if k_max <= q_min {
            Future::None
        } else if k_min > q_max {
            Future::All
        } else {
            Future::Some
        }
    }
}

/// `[1, 1, Tq, Tk]`: 0 where rank `owner`'s key is at or before rank `me`'s query, [`MASKED`]
/// after (built on the device from the chunks' positions).
fn causal_bias(split: &ContextSplit, me: usize, owner: usize, device: &Device) -> Tensor<4> {
    let q = split.position_ids(me, device).unsqueeze_dim::<2>(1);
    let k = split.position_ids(owner, device).unsqueeze_dim::<2>(0);
    let t = split.local_len();
    let after = k.expand([t, t]).greater(q.expand([t, t]));
    (after.float() * MASKED).unsqueeze::<4>()
}
