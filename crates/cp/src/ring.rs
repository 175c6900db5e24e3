//! [`ring_attention`]: a rank's queries over the whole sequence's keys, the key/value blocks
//! travelling around the cp ring. In f32 each block runs the fused attention
//! ([`attention_with_lse`]) over the pairs of query and key chunks it needs — wholly visible,
//! causal on the diagonal, windowed where a sliding window cuts them, or skipped — and the
//! blocks merge by their log-sum-exps; in 16-bit types each block's scores are materialized in
//! f32 and merged with an online softmax.
//!
//! A sliding window `W` (Mistral's: query `i` sees keys `i − W < j ≤ i`) crosses chunks: a
//! pair of chunks wholly outside every window is skipped (not computed), one wholly inside
//! runs unmasked, and one the window cuts runs [`Mask`]ed at its offset. The load-balanced
//! split is kept: under a window every query sees at most `W` keys wherever it stands, so the
//! two chunks a rank holds cost about the same as any other two.

use super::ContextSplit;
use bonfire_comm::ProcessGroup;
use bonfire_dtensor::functional::ring_shift_start;
use bonfire_kernels::{Mask, attention_with_lse, exp};
use burn::tensor::{DType, Device, Int, Tensor};
use std::ops::Range;

/// The base tag of the ring's messages (step `s` uses `RING_TAG + s`).
pub const RING_TAG: u64 = 0x5249_4e47_0000;

/// Attention of this rank's queries over every rank's keys and values in the cp `group`:
/// `softmax(q·kᵀ/√hd + mask)·v`, the `mask` on the tokens' positions in the whole sequence:
/// causal or not, with a sliding window or not (its `offset` must be unset: the positions
/// are the split's).
///
/// `q` is `[B, H, T/cp, hd]`, this rank's tokens of the sequence as `split` gives them;
/// `k` and `v` are `[B, H_kv, T/cp, hd]` with `H_kv` dividing `H` (query head `j` attends with
/// kv head `⌊j·H_kv/H⌋`: the `H_kv` heads travel, repeated only where they are used). The
/// `cp − 1` steps of the ring each send this rank's current K/V block to the next rank and
/// receive the previous rank's, the transfer running while the current block is computed
/// ([`ring_shift_start`]); a block entirely in the future of every local query is not
/// computed. In f32 no scores are kept: each block runs [`attention_with_lse`] over the chunk
/// pairs it needs (wholly visible, causal, windowed, skipped), merged by the log-sum-exps. In 16-bit
/// types no rank holds more than one `[T/cp, T/cp]` block of scores per head at a time in
/// forward (backward keeps one per block, `T/cp × T` per head, never `T × T`). Backward
/// (autodiff) sends each block's dK/dV back around the ring to the rank that owns it.
pub fn ring_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    group: &ProcessGroup,
    split: &ContextSplit,
    mask: impl Into<Mask>,
) -> Tensor<4> {
    let mask = mask.into();
    assert!(
        mask.offset.is_none(),
        "ring attention places the queries itself"
    );
    assert!(
        mask.window.is_none() || mask.causal,
        "a sliding window needs the causal mask"
    );
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
        return ring_fused(q, k, v, group, split, mask);
    }
    ring_materialized(q, k, v, group, split, mask)
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
    mask: Mask,
) -> Tensor<4> {
    let me = group.rank();
    let [_, _, t, hd] = q.dims();
    let hkv = k.dims()[1];
    let scale = 1.0 / (hd as f64).sqrt();
    let chunks = split.chunks(me).len();
    let n = t / chunks;
    let mut parts: Vec<Vec<(Tensor<4>, Tensor<3>)>> = vec![Vec::new(); chunks];
    let used = each_block(k, v, group, |owner, kv| {
        let calls = block_calls(split, me, owner, mask);
        for call in &calls {
            let qc = q.clone().narrow(2, call.q.start * n, call.q.len() * n);
            let (k0, kn) = (call.k.start * n, call.k.len() * n);
            let keys = |at: usize| kv.clone().narrow(1, at, hkv).narrow(2, k0, kn);
            let (out, lse) = attention_with_lse(qc, keys(0), keys(hkv), scale, call.mask);
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

/// One fused attention call of a ring step: the local query chunks `q` over the owner's key
/// chunks `k` under `mask` (causal on the queries' own chunk, windowed at an offset where a
/// sliding window cuts the pair, else none).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Call {
    q: Range<usize>,
    k: Range<usize>,
    mask: Mask,
}

/// How much of a key chunk a query chunk sees under `mask` (a causal mask, its window).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sight {
    /// No pair: every key after every query, or before every query's window.
    Nothing,
    /// Some pairs: the mask to apply, its offset the queries' start past the keys'.
    Part(Mask),
    /// Every pair.
    All,
}

/// What query positions `q` see of key positions `k` (each a contiguous chunk).
fn sight(q: &Range<usize>, k: &Range<usize>, mask: Mask) -> Sight {
    let (q_last, k_last) = (q.end - 1, k.end - 1);
    if !mask.causal {
        return Sight::All;
    }
    if k.start > q_last {
        return Sight::Nothing;
    }
    let w = mask.window.unwrap_or(usize::MAX);
    if k_last.saturating_add(w) <= q.start {
        return Sight::Nothing;
    }
    if k_last <= q.start && q_last - k.start < w {
        return Sight::All;
    }
    Sight::Part(mask.at(q.start - k.start))
}

/// The calls that cover rank `me`'s queries over rank `owner`'s keys.
///
/// Without a window: a key chunk is wholly visible to a query chunk before it, causal on the
/// diagonal (the same chunk, so the same length: the fused op's "queries are the last `Tq` of
/// the keys"), skipped after it; a rank's chunks are in position order, so each query chunk
/// sees a prefix of the owner's chunks, the diagonal (if any) last. Adjacent query chunks that
/// see the same prefix share a call. With the balanced split that is at most two calls a step
/// (all queries over the owner's first chunk when it is behind `me`; the second query chunk
/// over both key chunks when ahead; and at `owner = me` the first chunk causally over itself,
/// the second over both, causal on its own).
///
/// With a window: one call per pair of chunks that sees anything ([`sight`]), masked where
/// the window cuts it; pairs wholly outside every window are not computed.
fn block_calls(split: &ContextSplit, me: usize, owner: usize, mask: Mask) -> Vec<Call> {
    let (q_chunks, k_chunks) = (split.chunks(me), split.chunks(owner));
    if mask.window.is_some() {
        let mut calls = Vec::new();
        for (i, qc) in q_chunks.iter().enumerate() {
            for (j, kc) in k_chunks.iter().enumerate() {
                let mask = match sight(qc, kc, mask) {
                    Sight::Nothing => continue,
                    Sight::All => Mask::FULL,
                    Sight::Part(m) => m,
                };
                calls.push(Call {
                    q: i..i + 1,
                    k: j..j + 1,
                    mask,
                });
            }
        }
        return calls;
    }
    let mut calls: Vec<Call> = Vec::new();
    for (i, qc) in q_chunks.iter().enumerate() {
        let (keys, diagonal) = match mask.causal {
            false => (k_chunks.len(), false),
            true => {
                let seen = k_chunks.iter().filter(|kc| kc.start <= qc.start).count();
                (seen, seen > 0 && k_chunks[seen - 1] == *qc)
            }
        };
        if keys == 0 {
            continue;
        }
        let mask = Mask::from(diagonal);
        match calls.last_mut() {
            Some(c) if c.q.end == i && c.k == (0..keys) && c.mask == mask => c.q.end = i + 1,
            _ => calls.push(Call {
                q: i..i + 1,
                k: 0..keys,
                mask,
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
    mask: Mask,
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
    // (running max, running sum, running numerator) of the online softmax.
    let mut state: Option<Softmax> = None;
    let used = each_block(k, v, group, |owner, kv| {
        let pairs: Vec<Sight> = (split.chunks(me).iter())
            .flat_map(|qc| {
                split
                    .chunks(owner)
                    .into_iter()
                    .map(|kc| sight(qc, &kc, mask))
            })
            .collect();
        let bias = if pairs.iter().all(|s| *s == Sight::Nothing) {
            return false;
        } else if pairs.iter().all(|s| *s == Sight::All) {
            None
        } else {
            Some(block_bias(split, me, owner, mask, &device))
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

/// `[1, 1, Tq, Tk]`: 0 where rank `owner`'s key is visible to rank `me`'s query under `mask`
/// (at or before it; within its window), `MASKED` elsewhere (built on the device from the
/// chunks' positions).
fn block_bias(
    split: &ContextSplit,
    me: usize,
    owner: usize,
    mask: Mask,
    device: &Device,
) -> Tensor<4> {
    let (q, k) = (
        split.position_ids(me, device),
        split.position_ids(owner, device),
    );
    mask.bias_at(q, k).unsqueeze::<4>()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(q: Range<usize>, keys: usize, causal: bool) -> Call {
        Call {
            q,
            k: 0..keys,
            mask: causal.into(),
        }
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
                    let calls = block_calls(&split, me, owner, Mask::CAUSAL);
                    assert!(!calls.is_empty() && calls.len() <= 2, "{cp} {me} {owner}");
                    for c in &calls {
                        let (qc, kc) = (split.chunks(me), split.chunks(owner));
                        for q in &qc[c.q.clone()] {
                            for (j, k) in kc[c.k.clone()].iter().enumerate() {
                                assert!(k.start <= q.start);
                                assert_eq!(c.mask.causal && j == c.k.len() - 1, k == q);
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
            block_calls(&split, 0, 0, Mask::CAUSAL),
            [call(0..1, 1, true), call(1..2, 2, true)]
        );
        assert_eq!(
            block_calls(&split, 0, 1, Mask::CAUSAL),
            [call(1..2, 2, false)]
        );
        assert_eq!(
            block_calls(&split, 1, 0, Mask::CAUSAL),
            [call(0..2, 1, false)]
        );
        assert_eq!(
            block_calls(&split, 1, 0, Mask::FULL),
            [call(0..2, 2, false)]
        );
    }

    #[test]
    fn unbalanced_blocks_ahead_are_skipped() {
        let split = ContextSplit::new(12, 3, false).unwrap();
        assert_eq!(
            block_calls(&split, 1, 0, Mask::CAUSAL),
            [call(0..1, 1, false)]
        );
        assert_eq!(
            block_calls(&split, 1, 1, Mask::CAUSAL),
            [call(0..1, 1, true)]
        );
        assert_eq!(block_calls(&split, 1, 2, Mask::CAUSAL), []);
        assert_eq!(
            block_calls(&split, 1, 2, Mask::FULL),
            [call(0..1, 1, false)]
        );
    }

    /// With a window, exactly the pairs of chunks holding a visible (query, key) pair are
    /// computed — brute force over the positions says which — unmasked when every pair is
    /// visible; the others (most of them, at W = 3 over chunks of 4) are not computed.
    #[test]
    fn windowed_blocks_compute_only_pairs_a_window_reaches() {
        let (cp, w) = (4, 3);
        let split = ContextSplit::new(32, cp, true).unwrap();
        let mask = Mask::CAUSAL.with_window(Some(w));
        let (mut computed, mut skipped) = (0, 0);
        for me in 0..cp {
            for owner in 0..cp {
                let calls = block_calls(&split, me, owner, mask);
                let (qc, kc) = (split.chunks(me), split.chunks(owner));
                for (i, q) in qc.iter().enumerate() {
                    for (j, k) in kc.iter().enumerate() {
                        let visible = |a: usize, c: usize| c <= a && c + w > a;
                        let pairs = q.clone().flat_map(|a| k.clone().map(move |c| (a, c)));
                        let seen = pairs.clone().filter(|&(a, c)| visible(a, c)).count();
                        let call = calls
                            .iter()
                            .find(|c| c.q == (i..i + 1) && c.k == (j..j + 1));
                        assert_eq!(call.is_some(), seen > 0, "{me} {owner} {q:?} {k:?}");
                        if let Some(call) = call {
                            assert_eq!(call.mask.is_full(), seen == pairs.count());
                            computed += 1;
                        } else {
                            skipped += 1;
                        }
                    }
                }
            }
        }
        assert_eq!((computed, skipped), (15, 49));
    }
}
