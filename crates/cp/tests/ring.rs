//! Ring attention (context parallelism) as the anchors test it: under cp = 2 and 4, causal
//! and not, load-balanced and not, with grouped-query and plain multi-head attention, in f32
//! (the fused per-chunk path) and f64 (the materialized path 16-bit types take), every
//! rank's output and its dq, dk, dv equal full attention computed on one device at the
//! rank's positions; the ring sends and receives `cp − 1` blocks in forward and as many
//! gradients in backward, every one through the overlapped shift. Sliding windows (Mistral's
//! `i − W < j ≤ i`) of 1 token, narrower than a chunk, crossing chunks and ranks, and wider
//! than the sequence, the same.

// The dtensor suites' helpers (ranks as threads, integer-valued data), shared by path.
#[path = "../../dtensor/tests/common/mod.rs"]
mod common;

use bonfire_comm::OpKind;
use bonfire_comm::testing::{Tolerance, assert_close};
use bonfire_cp::{ContextSplit, ring_attention};
use bonfire_dtensor::CommCounter;
use bonfire_dtensor::timing::take_shift_overlap;
use bonfire_kernels::Mask;
use burn::tensor::activation::softmax;
use burn::tensor::{DType, Int, Tensor, TensorData};
use common::*;

/// f32 against f32 computed in another order (online softmax): relative 1e-5, and 1e-6 for
/// elements that cancel.
const TOL: Tolerance = Tolerance::new(1e-5, 1e-6);

/// Smooth values in about [-0.5, 0.5] (integer-valued data would saturate the softmax).
fn smooth(seed: usize, shape: [usize; 4]) -> Tensor<4> {
    tensor(seed, shape, &dev()) * 0.1
}

/// softmax(q·kᵀ/√hd + causal mask)·v on one device, query head j with kv head ⌊j·hkv/h⌋;
/// with a `window` W query i sees only keys i − W < j ≤ i.
fn full_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    causal: bool,
    window: Option<usize>,
) -> Tensor<4> {
    let [_, h, t, hd] = q.dims();
    let hkv = k.dims()[1];
    let heads: Vec<i64> = (0..h).map(|j| (j * hkv / h) as i64).collect();
    let heads = Tensor::<1, Int>::from_data(TensorData::new(heads, [h]), &dev());
    let (k, v) = (k.select(1, heads.clone()), v.select(1, heads));
    let mut scores = q.matmul(k.swap_dims(2, 3)) / (hd as f64).sqrt();
    if causal {
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                let (query, key) = (i / t, i % t);
                if key > query || window.is_some_and(|w| key + w <= query) {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        scores =
            scores + Tensor::<2>::from_data(TensorData::new(mask, [t, t]), &dev()).unsqueeze::<4>();
    }
    softmax(scores, 3).matmul(v)
}

/// Ring attention in `dtype` (f32: the fused per-chunk path; f64, as 16-bit types: the
/// materialized blocks), compared in f32.
fn check(cp: usize, causal: bool, balanced: bool, heads: usize, kv_heads: usize, dtype: DType) {
    check_window(cp, causal, None, balanced, (heads, kv_heads), dtype);
}

/// [`check`] with a sliding `window`.
fn check_window(
    cp: usize,
    causal: bool,
    window: Option<usize>,
    balanced: bool,
    (heads, kv_heads): (usize, usize),
    dtype: DType,
) {
    let (b, t, hd) = (2, 4 * cp, 4);
    let what = format!(
        "cp={cp} causal={causal} window={window:?} balanced={balanced} heads={heads}/{kv_heads} \
         {dtype:?}"
    );
    let split = ContextSplit::new(t, cp, balanced).unwrap();
    let (qs, kvs) = ([b, heads, t, hd], [b, kv_heads, t, hd]);
    let (q, k, v) = (
        smooth(1, qs).require_grad(),
        smooth(2, kvs).require_grad(),
        smooth(3, kvs).require_grad(),
    );
    let w = smooth(4, qs);
    let out = full_attention(q.clone(), k.clone(), v.clone(), causal, window);
    let grads = (out.clone() * w.clone()).sum().backward();
    let reference: Vec<Tensor<4>> = vec![
        out,
        q.grad(&grads).unwrap(),
        k.grad(&grads).unwrap(),
        v.grad(&grads).unwrap(),
    ]
    .into_iter()
    .map(|x| Tensor::from_data(x.into_data(), &dev()))
    .collect();
    let ranks = world(cp, |pg| {
        let r = pg.rank();
        let local = |x: &Tensor<4>| {
            let data = split.local(x.clone().detach(), 2, r).into_data();
            Tensor::<4>::from_data(data, &dev())
        };
        let (ql, kl, vl) = (
            local(&q).require_grad(),
            local(&k).require_grad(),
            local(&v).require_grad(),
        );
        let _ = take_shift_overlap();
        let counter = CommCounter::start();
        let [qd, kd, vd] = [&ql, &kl, &vl].map(|x| x.clone().cast(dtype));
        let mask = Mask::from(causal).with_window(window);
        let out = ring_attention(qd, kd, vd, &pg, &split, mask).cast(DType::F32);
        let forward_sends = counter.count(OpKind::Send);
        let grads = (out.clone() * local(&w)).sum().backward();
        let sends = (
            forward_sends,
            counter.count(OpKind::Send),
            counter.count(OpKind::Recv),
            // Every shift, forward and backward, went through the overlapped halves.
            take_shift_overlap().shifts,
        );
        let got = [
            out,
            ql.grad(&grads).unwrap(),
            kl.grad(&grads).unwrap(),
            vl.grad(&grads).unwrap(),
        ];
        (got.map(vec_of), sends)
    });
    for (r, (got, sends)) in ranks.into_iter().enumerate() {
        for (name, (g, want)) in ["output", "dq", "dk", "dv"]
            .iter()
            .zip(got.iter().zip(&reference))
        {
            let want = vec_of(split.local(want.clone(), 2, r));
            assert_close(&format!("{what} rank {r} {name}"), g, &want, TOL);
        }
        assert_eq!(
            sends,
            (cp - 1, 2 * (cp - 1), 2 * (cp - 1), 2 * (cp - 1)),
            "{what} rank {r}: sends"
        );
    }
}

#[test]
fn ring_attention_equals_full_attention_causal_and_balanced() {
    for dtype in [DType::F32, DType::F64] {
        for cp in [2, 4] {
            check(cp, true, true, 4, 2, dtype);
        }
    }
}

#[test]
fn ring_attention_equals_full_attention_without_balance_or_mask() {
    for dtype in [DType::F32, DType::F64] {
        for cp in [2, 4] {
            check(cp, true, false, 4, 2, dtype);
            check(cp, false, true, 4, 4, dtype);
            check(cp, false, false, 4, 1, dtype);
        }
    }
}

#[test]
fn ring_attention_with_a_sliding_window_equals_full_attention() {
    for dtype in [DType::F32, DType::F64] {
        for cp in [2, 4] {
            // Chunks of 2 tokens (balanced) or 4: windows inside a chunk, across chunks and
            // ranks, and past the sequence.
            for window in [1, 2, 3, 5, 4 * cp + 1] {
                check_window(cp, true, Some(window), true, (4, 2), dtype);
            }
            check_window(cp, true, Some(3), false, (4, 1), dtype);
        }
    }
}
