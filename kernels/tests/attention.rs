//! The fused attention against its plain-Burn reference ([`fallback::attention`]: kv heads
//! repeated by `select`, a materialized masked softmax, Burn's autodiff): the output and the
//! gradient of every input, on Flex with autodiff, causal or not, queries as many as the keys
//! or the last few of them, every grouping of query heads per kv head, sequence lengths that
//! are not multiples of the kernel's tile, head widths 32 and 64; sliding windows (Mistral's)
//! narrower and wider than a tile, at offsets (ring attention's blocks), and queries that see
//! no key of a call (output 0, log-sum-exp −∞, finite gradients).

mod common;

use bonfire_kernels::attention::AttentionBackend;
use bonfire_kernels::{Mask, attention, attention_with_lse, fallback};
use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Tensor, TensorData};
use common::host;

/// One case: batch 2, `h` query heads, `h_kv` kv heads, `tq` queries, `tk` keys, width `dh`.
#[derive(Clone, Copy, Debug)]
struct Case {
    h: usize,
    h_kv: usize,
    tq: usize,
    tk: usize,
    dh: usize,
    mask: Mask,
}

/// `n` values in [-2, 2) from a multiplicative hash, varied by `seed`.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 4001)
        .map(|x| x as f32 / 1000.0 - 2.0)
        .collect()
}

fn leaf(shape: [usize; 4], seed: u32, device: &Device) -> Tensor<4> {
    let n = shape.iter().product();
    Tensor::<4>::from_data(TensorData::new(values(n, seed), shape), device).require_grad()
}

impl Case {
    /// Tracked `q`, `k`, `v` and a constant output weight `w` of the case's shapes, from the
    /// seeds `seed..seed + 4`.
    fn inputs(&self, seed: u32, device: &Device) -> [Tensor<4>; 4] {
        let (q, kv) = (
            [2, self.h, self.tq, self.dh],
            [2, self.h_kv, self.tk, self.dh],
        );
        [
            leaf(q, seed, device),
            leaf(kv, seed + 1, device),
            leaf(kv, seed + 2, device),
            leaf(q, seed + 3, device).detach(),
        ]
    }
}

/// The largest difference between `a` and `b` relative to `b`'s largest magnitude is at most
/// `tol`.
fn close(what: &str, case: Case, a: Tensor<4>, b: Tensor<4>, tol: f32) {
    let (a, b) = (host(a), host(b));
    assert_eq!(a.len(), b.len(), "{what}: sizes differ");
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    assert!(scale > 0.0, "{what}: the reference is all zeros");
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(
        worst <= tol * scale,
        "{what} {case:?}: largest difference {worst} > {tol} x {scale}"
    );
}

/// `f` and the reference on the same inputs: outputs and the gradients of `q`, `k`, `v` (of
/// the output weighted by a fixed tensor) agree within `tol` relative.
fn same_as_reference(
    case: Case,
    f: impl Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>,
    tol: f32,
) {
    let device = Device::flex().autodiff();
    let scale = 1.0 / (case.dh as f64).sqrt();
    let [q, k, v, w] = case.inputs(1, &device);
    let causal = case.mask;
    let ours = f(q.clone(), k.clone(), v.clone());
    let (rq, rk, rv) = (
        q.clone().detach().require_grad(),
        k.clone().detach().require_grad(),
        v.clone().detach().require_grad(),
    );
    let reference = fallback::attention(rq.clone(), rk.clone(), rv.clone(), scale, causal);
    close("output", case, ours.clone(), reference.clone(), tol);
    let g = (ours * w.clone()).sum().backward();
    let rg = (reference * w).sum().backward();
    for (name, x, r) in [("dq", &q, &rq), ("dk", &k, &rk), ("dv", &v, &rv)] {
        close(name, case, x.grad(&g).unwrap(), r.grad(&rg).unwrap(), tol);
    }
}

fn fused(case: Case) {
    let scale = 1.0 / (case.dh as f64).sqrt();
    same_as_reference(case, |q, k, v| attention(q, k, v, scale, case.mask), 1e-5);
}

fn both(h: usize, h_kv: usize, tq: usize, tk: usize, dh: usize) {
    for causal in [true, false] {
        fused(Case {
            h,
            h_kv,
            tq,
            tk,
            dh,
            mask: causal.into(),
        });
    }
}

#[test]
fn one_kv_head_per_query_head() {
    both(3, 3, 37, 37, 32);
    both(2, 2, 130, 130, 64);
}

#[test]
fn two_query_heads_per_kv_head() {
    both(4, 2, 37, 37, 64);
    both(4, 2, 130, 130, 32);
}

#[test]
fn four_query_heads_per_kv_head() {
    both(8, 2, 130, 130, 32);
    both(4, 1, 37, 37, 64);
}

#[test]
fn one_kv_head_for_all_queries() {
    both(3, 1, 37, 37, 32);
    both(4, 1, 130, 130, 64);
}

#[test]
fn queries_are_the_last_positions_when_fewer_than_keys() {
    both(2, 2, 37, 130, 64);
    both(4, 2, 5, 37, 32);
    both(4, 1, 64, 130, 32);
}

#[test]
fn a_single_query_and_a_single_tile() {
    both(2, 1, 1, 5, 32);
    both(2, 2, 64, 64, 32);
}

/// The extension's whole-tensor Burn math (what a CubeCL device runs, and Flex for dtypes
/// other than f32), called directly in f64 through the same autodiff node.
#[test]
fn the_extensions_burn_math_matches_the_reference() {
    let extension = |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, causal: bool| {
        let scale = 1.0 / (q.dims()[3] as f64).sqrt();
        let [q, k, v] = [q, k, v].map(|t| t.cast(burn::tensor::DType::F64));
        let (out, _) = <Dispatch as AttentionBackend>::attention_forward(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            scale,
            causal.into(),
        );
        Tensor::<4>::from_dispatch(out).cast(burn::tensor::DType::F32)
    };
    for causal in [true, false] {
        let case = Case {
            h: 4,
            h_kv: 2,
            tq: 37,
            tk: 130,
            dh: 32,
            mask: causal.into(),
        };
        same_as_reference(case, |q, k, v| extension(q, k, v, causal), 1e-5);
    }
}

/// The op inside a small graph under autodiff: its output merged over heads and multiplied
/// by a tracked weight; the gradients of the inputs and of the weight match the reference's.
#[test]
fn gradients_flow_through_a_graph_around_the_op() {
    let device = Device::flex().autodiff();
    let (h, h_kv, t, dh) = (4, 2, 37, 32);
    let run = |f: &dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>| {
        let (q, k, v) = (
            leaf([2, h, t, dh], 5, &device),
            leaf([2, h_kv, t, dh], 6, &device),
            leaf([2, h_kv, t, dh], 7, &device),
        );
        let weight = leaf([2, 1, h * dh, 8], 8, &device);
        let y = f(q.clone(), k.clone(), v.clone())
            .swap_dims(1, 2)
            .reshape([2, 1, t, h * dh]);
        let loss = y.matmul(weight.clone()).powf_scalar(2.0).sum();
        let g = loss.backward();
        [&q, &k, &v, &weight].map(|x| x.grad(&g).unwrap())
    };
    let scale = 1.0 / (dh as f64).sqrt();
    let ours = run(&|q, k, v| attention(q, k, v, scale, true));
    let reference = run(&|q, k, v| fallback::attention(q, k, v, scale, true));
    let case = Case {
        h,
        h_kv,
        tq: t,
        tk: t,
        dh,
        mask: Mask::CAUSAL,
    };
    for (name, (a, b)) in ["dq", "dk", "dv", "dweight"]
        .iter()
        .zip(ours.into_iter().zip(reference))
    {
        close(name, case, a, b, 1e-5);
    }
}

/// `attention_with_lse` (f32: the fused node; f64: the extension's Burn math through the
/// same node) against its plain-Burn reference: the output, the log-sum-exp and the
/// gradients of `q`, `k`, `v` of a loss that weights both — the log-sum-exp's gradient
/// enters the backward as a shift of `D`.
fn with_lse_matches_the_reference(case: Case, dtype: burn::tensor::DType) {
    let device = Device::flex().autodiff();
    let Case {
        h, tq, dh, mask, ..
    } = case;
    let causal = mask;
    let scale = 1.0 / (dh as f64).sqrt();
    let run = |f: &dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> (Tensor<4>, Tensor<3>)| {
        let [q, k, v, w] = case.inputs(11, &device);
        let w_lse = leaf([2, h, tq, 1], 15, &device).detach();
        let (out, lse) = f(q.clone(), k.clone(), v.clone());
        let lse = lse.unsqueeze_dim::<4>(3);
        let loss = (out.clone() * w).sum() + (lse.clone() * w_lse).sum();
        let g = loss.backward();
        let grads = [&q, &k, &v].map(|x| x.grad(&g).unwrap());
        (out, lse, grads)
    };
    let ours = run(&|q, k, v| match dtype {
        DType::F32 => attention_with_lse(q, k, v, scale, causal),
        _ => {
            // The extension called directly (the public function takes other dtypes to the
            // reference).
            let [q, k, v] = [q, k, v].map(|t| t.cast(dtype).into_dispatch());
            let packed =
                <Dispatch as AttentionBackend>::attention_forward_packed(q, k, v, scale, causal);
            let packed = Tensor::<4>::from_dispatch(packed).cast(DType::F32);
            let lse = packed.clone().narrow(3, dh, 1).reshape([2, h, tq]);
            (packed.narrow(3, 0, dh), lse)
        }
    });
    let reference = run(&|q, k, v| fallback::attention_with_lse(q, k, v, scale, causal));
    close("output", case, ours.0, reference.0, 1e-5);
    close("lse", case, ours.1, reference.1, 1e-5);
    for (name, (a, b)) in ["dq", "dk", "dv"]
        .iter()
        .zip(ours.2.into_iter().zip(reference.2))
    {
        close(name, case, a, b, 1e-5);
    }
}

#[test]
fn the_log_sum_exp_is_an_output_with_its_gradient() {
    for dtype in [DType::F32, DType::F64] {
        for (h, h_kv, tq, tk) in [(4, 2, 37, 37), (2, 2, 64, 130), (4, 1, 5, 37)] {
            for causal in [true, false] {
                let case = Case {
                    h,
                    h_kv,
                    tq,
                    tk,
                    dh: 32,
                    mask: causal.into(),
                };
                with_lse_matches_the_reference(case, dtype);
            }
        }
    }
}

/// Sliding windows (query i sees keys i − W < j ≤ i): narrower than a tile (whole tiles of a
/// row masked before its window), wider, wider than the sequence, with fewer queries than
/// keys, and at an offset past the keys (a ring block of earlier keys), output and gradients
/// against the reference, with the log-sum-exp too.
#[test]
fn sliding_windows_match_the_reference() {
    for (h, h_kv, tq, tk, mask) in [
        (2, 1, 130, 130, Mask::CAUSAL.with_window(Some(2))),
        (4, 2, 130, 130, Mask::CAUSAL.with_window(Some(5))),
        (2, 2, 150, 150, Mask::CAUSAL.with_window(Some(70))),
        (2, 1, 37, 37, Mask::CAUSAL.with_window(Some(100))),
        (4, 2, 20, 90, Mask::CAUSAL.with_window(Some(30))),
        (2, 1, 37, 37, Mask::CAUSAL.with_window(Some(50)).at(40)),
    ] {
        let case = Case {
            h,
            h_kv,
            tq,
            tk,
            dh: 32,
            mask,
        };
        fused(case);
        with_lse_matches_the_reference(case, DType::F32);
        with_lse_matches_the_reference(case, DType::F64);
    }
}

/// A query that sees no key of the call (a ring block wholly before its window): output 0,
/// log-sum-exp −∞, and the gradients finite; the rows that see keys as the reference.
#[test]
fn a_query_that_sees_no_key_gets_zero_and_minus_infinity() {
    let device = Device::flex().autodiff();
    // Queries at positions 40..47 over keys 0..37, W = 8: query a sees keys 33 + a.., none
    // from a = 4 on.
    let (tq, tk, dh) = (8, 37, 32);
    let mask = Mask::CAUSAL.with_window(Some(8)).at(40);
    let case = Case {
        h: 2,
        h_kv: 1,
        tq,
        tk,
        dh,
        mask,
    };
    let [q, k, v, w] = case.inputs(3, &device);
    let scale = 1.0 / (dh as f64).sqrt();
    let (out, lse) = attention_with_lse(q.clone(), k.clone(), v.clone(), scale, mask);
    let (o, l) = (host(out.clone()), host(lse.clone().unsqueeze_dim::<4>(3)));
    for (row, lse) in l.iter().enumerate() {
        let a = row % tq;
        let sees = a < 4;
        assert_eq!(lse.is_finite(), sees, "query {a}: lse {lse}");
        let zero = o[row * dh..][..dh].iter().all(|&x| x == 0.0);
        assert_eq!(zero, !sees, "query {a}");
    }
    let g = ((out * w).sum() + lse.narrow(2, 0, 4).sum()).backward();
    for x in [&q, &k, &v] {
        assert!(host(x.grad(&g).unwrap()).iter().all(|g| g.is_finite()));
    }
}

/// The models' `q`, `k`, `v` are heads split from `[B, T, heads·dh]` projections (a reshape
/// and a swap: rows `heads·dh` apart), which the Flex kernels read in place and answer in the
/// same layout: the output and every gradient equal, bit for bit, those of the same values
/// laid out contiguous — with the output merged back and weighted as the models do, so the
/// gradients flow through the merge and the split — causal, windowed and grouped.
#[test]
fn heads_split_from_projections_give_the_contiguous_results() {
    let device = Device::flex().autodiff();
    let (b, t, dh) = (2, 70, 32);
    for (h, h_kv, mask) in [
        (4, 4, Mask::CAUSAL),
        (4, 2, Mask::CAUSAL.with_window(Some(20))),
        (2, 1, Mask::FULL),
    ] {
        // `split` takes `[B, T, heads·dh]` leaves to `[B, heads, T, dh]` views; `contiguous`
        // takes the same values to leaves already `[B, heads, T, dh]`.
        let projection = |heads: usize, seed: u32| {
            let n = b * t * heads * dh;
            Tensor::<3>::from_data(
                TensorData::new(values(n, seed), [b, t, heads * dh]),
                &device,
            )
            .require_grad()
        };
        let split =
            |x: &Tensor<3>, heads: usize| x.clone().reshape([b, t, heads, dh]).swap_dims(1, 2);
        let contiguous = |x: &Tensor<3>, heads: usize| {
            let data = split(x, heads).detach().into_data();
            Tensor::<4>::from_data(data, &device).require_grad()
        };
        let (q, k, v) = (
            projection(h, 11),
            projection(h_kv, 12),
            projection(h_kv, 13),
        );
        let weight = projection(h, 14).detach();
        let run = |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>| {
            let y = attention(q, k, v, 1.0 / (dh as f64).sqrt(), mask);
            let merged = y.clone().swap_dims(1, 2).reshape([b, t, h * dh]);
            (y, (merged * weight.clone()).sum().backward())
        };
        let (ours, g) = run(split(&q, h), split(&k, h_kv), split(&v, h_kv));
        let (cq, ck, cv) = (
            contiguous(&q, h),
            contiguous(&k, h_kv),
            contiguous(&v, h_kv),
        );
        let (want, cg) = run(cq.clone(), ck.clone(), cv.clone());
        let same = |what: &str, a: Tensor<4>, b: Tensor<4>| {
            let (a, b) = (host(a), host(b));
            let differ = a
                .iter()
                .zip(&b)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            assert_eq!(
                differ,
                0,
                "{what}, h {h} h_kv {h_kv} {mask:?}: {differ} of {} differ",
                b.len()
            );
        };
        same("output", ours, want);
        for (name, x, heads, c) in [
            ("dq", &q, h, &cq),
            ("dk", &k, h_kv, &ck),
            ("dv", &v, h_kv, &cv),
        ] {
            let got = x
                .grad(&g)
                .unwrap()
                .reshape([b, t, heads, dh])
                .swap_dims(1, 2);
            same(name, got, c.grad(&cg).unwrap());
        }
    }
}
