//! [`ring_attention`]: a rank's queries over the whole sequence's keys, the key/value blocks
//! travelling around the cp ring. In f32 each block runs the fused attention
//! ([`attention_with_lse`]) over the pairs of query and key chunks it needs — wholly visible,
//! causal on the diagonal, or skipped — and the blocks merge by their log-sum-exps; in 16-bit
//! types each block's scores are materialized in f32 and merged with an online softmax.

use super::ContextSplit;
use bonfire_comm::ProcessGroup;
use bonfire_dtensor::functional::ring_shift_start;
use bonfire_kernels::{attention_with_lse, exp};
use burn::tensor::{DType, Device, Int, Tensor};
use std::ops::Range;

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
/// computed. In f32 no scores are kept: each block runs [`attention_with_lse`] over the chunk
/// pairs it needs (wholly visible, causal, skipped), merged by the log-sum-exps. In 16-bit
/// types no rank holds more than one `[T/cp, T/cp]` block of scores per head at a time in
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
    let cp = group.size();
    assert_eq!(
        cp,
        split.cp(),
        "the split is for {} ranks, the group has {cp}",
        split.cp()
    );
    let [_, h, t, _] = q.dims();
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
    if [q.dtype(), k.dtype(), v.dtype()] == [DType::F32; 3] {
        return ring_fused(q, k, v, group, split, causal);
    }
    ring_materialized(q, k, v, group, split, causal)
}

/// [`ring_attention`] in f32: at each ring step, the fused attention over the chunk pairs
/// [`block_calls`] gives; each local query chunk's parts merged at the end by their
/// log-sum-exps ([`merge_parts`]).
fn ring_fused(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    group: &ProcessGroup,
    split: &ContextSplit,
    causal: bool,
) -> Tensor<4> {
    let me = group.rank();
    let [_, _, t, hd] = q.dims();
    let hkv = k.dims()[1];
    let scale = 1.0 / (hd as f64).sqrt();
    let chunks = split.chunks(me).len();
    let n = t / chunks;
    let mut parts: Vec<Vec<(Tensor<4>, Tensor<3>)>> = vec![Vec::new(); chunks];
    let used = each_block(k, v, group, |owner, kv| {
        let calls = block_calls(split, me, owner, causal);
        for call in &calls {
            let qc = q.clone().narrow(2, call.q.start * n, call.q.len() * n);
            let keys = |at: usize| kv.clone().narrow(1, at, hkv).narrow(2, 0, call.keys * n);
            let (out, lse) = attention_with_lse(qc, keys(0), keys(hkv), scale, call.causal);
            for (i, c) in call.q.clone().enumerate() {
                let part = (
                    out.clone().narrow(2, i * n, n),
                    lse.clone().narrow(2, i * n, n),
                );
                parts[c].push(part);
            }
        }
        !calls.is_empty()
    });
    used.into_output(Tensor::cat(parts.into_iter().map(merge_parts).collect(), 2))
}

/// One fused attention call of a ring step: the local query chunks `q` over the first `keys`
/// chunks of the block's owner, causal on the last of them (the queries' own chunk) when
/// `causal`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Call {
    q: Range<usize>,
    keys: usize,
    causal: bool,
}

/// The calls that cover rank `me`'s queries over rank `owner`'s keys. A key chunk is wholly
/// visible to a query chunk before it, causal on the diagonal (the same chunk, so the same
/// length: the fused op's "queries are the last `Tq` of the keys"), skipped after it; a
/// rank's chunks are in position order, so each query chunk sees a prefix of the owner's
/// chunks, the diagonal (if any) last. Adjacent query chunks that see the same prefix share
/// a call. With the balanced split that is at most two calls a step (all queries over the
/// owner's first chunk when it is behind `me`; the second query chunk over both key chunks
/// when ahead; and at `owner = me` the first chunk causally over itself, the second over
/// both, causal on its own).
fn block_calls(split: &ContextSplit, me: usize, owner: usize, causal: bool) -> Vec<Call> {
    let (q_chunks, k_chunks) = (split.chunks(me), split.chunks(owner));
    let mut calls: Vec<Call> = Vec::new();
    for (i, qc) in q_chunks.iter().enumerate() {
        let (keys, diagonal) = match causal {
            false => (k_chunks.len(), false),
            true => {
                let seen = k_chunks.iter().filter(|kc| kc.start <= qc.start).count();
                (seen, seen > 0 && k_chunks[seen - 1] == *qc)
            }
        };
        if keys == 0 {
            continue;
        }
        match calls.last_mut() {
            Some(c) if c.q.end == i && c.keys == keys && c.causal == diagonal => c.q.end = i + 1,
            _ => calls.push(Call {
                q: i..i + 1,
                keys,
                causal: diagonal,
            }),
        }
    }
    calls
}

/// One query chunk's output from its parts `(outᵢ, lseᵢ)` over disjoint sets of keys:
/// `Σᵢ exp(lseᵢ − lse)·outᵢ` with `lse = log Σᵢ exp(lseᵢ)` (shifted by the detached max, which
/// cancels).
fn merge_parts(parts: Vec<(Tensor<4>, Tensor<3>)>) -> Tensor<4> {
    if parts.len() == 1 {
        return parts.into_iter().next().expect("one part").0;
    }
    let (outs, lses): (Vec<_>, Vec<_>) = parts.into_iter().unzip();
    let lse = Tensor::stack::<4>(lses, 0);
    let m = lse.clone().detach().max_dim(0);
    let e = exp(lse - m);
    let w = e.clone() / e.sum_dim(0);
    (Tensor::stack::<5>(outs, 0) * w.unsqueeze_dim::<5>(4))
        .sum_dim(0)
        .squeeze_dim::<4>(0)
}

/// [`ring_attention`] in 16-bit types: each block's scores materialized in f32 and merged
/// with an online softmax ([`merge`]).
fn ring_materialized(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    group: &ProcessGroup,
    split: &ContextSplit,
    causal: bool,
) -> Tensor<4> {
    let me = group.rank();
    let [_, h, _, hd] = q.dims();
    let hkv = k.dims()[1];
    let device = q.device();
    // Query head j attends with kv head ⌊j·hkv/h⌋ (computed on the device).
    let heads = (Tensor::<1, Int>::arange(0..h as i64, &device) * hkv as i64).div_scalar(h as i64);
    let q = q * (1.0 / (hd as f64).sqrt());
    // 16-bit inputs: scores, the softmax and its sums in f32 (as the one-device fused softmax
    // does under autocast), the output back in the input's dtype.
    let dtype = q.dtype();
    let q_pos = split.positions(me);
    // (running max, running sum, running numerator) of the online softmax.
    let mut state: Option<Softmax> = None;
    let used = each_block(k, v, group, |owner, kv| {
        let k_pos = split.positions(owner);
        let bias = match (causal, Future::of(&q_pos, &k_pos)) {
            (true, Future::All) => return false,
            (true, Future::Some) => Some(causal_bias(split, me, owner, &device)),
            _ => None,
        };
        let kb = kv.clone().narrow(1, 0, hkv).select(1, heads.clone());
        let vb = kv.clone().narrow(1, hkv, hkv).select(1, heads.clone());
        state = Some(merge(state.take(), q.clone(), kb, vb, bias));
        true
    });
    let (_, l, acc) = state.expect("a query attends at least to itself");
    used.into_output((acc / l).cast(dtype))
}

/// Walks the ring: `visit(owner, kv)` with each rank's K/V block (`[B, 2·H_kv, T/cp, hd]`,
/// keys then values), this rank's own first, the next block's transfer posted before the
/// current one is visited ([`ring_shift_start`]); `visit` says whether it used the block.
fn each_block(
    k: Tensor<4>,
    v: Tensor<4>,
    group: &ProcessGroup,
    mut visit: impl FnMut(usize, &Tensor<4>) -> bool,
) -> Blocks {
    let (me, cp) = (group.rank(), group.size());
    let mut kv = Tensor::cat(vec![k, v], 1);
    let mut skipped: Option<Tensor<1>> = None;
    for step in 0..cp {
        let next = (step + 1 < cp)
            .then(|| ring_shift_start(kv.clone(), group, RING_TAG + step as u64 + 1));
        if !visit((me + cp - step) % cp, &kv) {
            let zero = kv.clone().sum().mul_scalar(0.0);
            skipped = Some(skipped.map_or(zero.clone(), |s| s + zero));
        }
        if let Some(next) = next {
            kv = next.finish();
        }
    }
    Blocks { skipped }
}

/// What [`each_block`] leaves: the blocks no query used, as a zero.
struct Blocks {
    skipped: Option<Tensor<1>>,
}

impl Blocks {
    /// `out` with the unused blocks entering the graph with weight 0: backward must run every
    /// ring step on every rank (its peers wait for the gradients it sends back).
    fn into_output(self, out: Tensor<4>) -> Tensor<4> {
        match self.skipped {
            Some(zero) => out + zero.unsqueeze::<4>(),
            None => out,
        }
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
        let bias = bias.cast(scores.dtype());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn call(q: Range<usize>, keys: usize, causal: bool) -> Call {
        Call { q, keys, causal }
    }

    #[test]
    fn balanced_blocks_need_at_most_two_calls_and_cover_the_causal_pairs() {
        for cp in [2, 3, 4] {
            let split = ContextSplit::new(8 * cp, cp, true).unwrap();
            for me in 0..cp {
                // Keys seen, counted over every call of every step: each query sees exactly
                // the keys at or before it (chunk granularity: the diagonal is causal).
                let mut seen = 0;
                for owner in 0..cp {
                    let calls = block_calls(&split, me, owner, true);
                    assert!(!calls.is_empty() && calls.len() <= 2, "{cp} {me} {owner}");
                    for c in &calls {
                        let (qc, kc) = (split.chunks(me), split.chunks(owner));
                        for q in &qc[c.q.clone()] {
                            for (j, k) in kc[..c.keys].iter().enumerate() {
                                assert!(k.start <= q.start);
                                assert_eq!(c.causal && j == c.keys - 1, k == q);
                                seen += 1;
                            }
                        }
                    }
                }
                // Query chunk r sees chunks 0..=r, chunk 2cp−1−r sees 0..=2cp−1−r.
                assert_eq!(seen, (me + 1) + (2 * cp - me), "cp {cp} rank {me}");
            }
        }
        let split = ContextSplit::new(16, 2, true).unwrap();
        assert_eq!(
            block_calls(&split, 0, 0, true),
            [call(0..1, 1, true), call(1..2, 2, true)]
        );
        assert_eq!(block_calls(&split, 0, 1, true), [call(1..2, 2, false)]);
        assert_eq!(block_calls(&split, 1, 0, true), [call(0..2, 1, false)]);
        assert_eq!(block_calls(&split, 1, 0, false), [call(0..2, 2, false)]);
    }

    #[test]
    fn unbalanced_blocks_ahead_are_skipped() {
        let split = ContextSplit::new(12, 3, false).unwrap();
        assert_eq!(block_calls(&split, 1, 0, true), [call(0..1, 1, false)]);
        assert_eq!(block_calls(&split, 1, 1, true), [call(0..1, 1, true)]);
        assert_eq!(block_calls(&split, 1, 2, true), []);
        assert_eq!(block_calls(&split, 1, 2, false), [call(0..1, 1, false)]);
    }
}
