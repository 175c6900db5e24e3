//! The conformance suite: every collective × reduce op × dtype × size, checked against values
//! computed directly from every rank's (deterministic) input.
//!
//! Call [`run_all`] on every rank of a group; it returns the number of checks made, or the
//! first discrepancy. Inputs are small integers so that sums, products and maxima are exact
//! in every dtype (bf16 included); only averages of 16-bit floats are compared with a
//! tolerance (they round).

use crate::{CommError, Element, ProcessGroup, ReduceOp};
use half::{bf16, f16};

/// Outcome of a suite run on one rank: the number of checks, or the first failure.
pub type Outcome = Result<usize, String>;

/// Element counts exercised by the value checks (0, tiny, odd, multi-block).
pub const SIZES: [usize; 6] = [0, 1, 5, 17, 1000, 4099];

/// Runs the whole suite on `pg`. Every rank of the group must call it.
pub fn run_all(pg: &ProcessGroup) -> Outcome {
    let mut checks = 0;
    checks += run_dtype::<f32>(pg)?;
    checks += run_dtype::<f64>(pg)?;
    checks += run_dtype::<f16>(pg)?;
    checks += run_dtype::<bf16>(pg)?;
    checks += run_dtype::<i32>(pg)?;
    checks += run_dtype::<i64>(pg)?;
    checks += run_dtype::<u8>(pg)?;
    checks += point_to_point(pg)?;
    checks += sub_groups(pg)?;
    checks += async_overlap(pg)?;
    checks += errors_leave_group_usable(pg)?;
    Ok(checks)
}

/// Every collective on one dtype.
pub fn run_dtype<T: Element>(pg: &ProcessGroup) -> Outcome {
    let mut checks = 0;
    checks += all_reduce::<T>(pg)?;
    checks += broadcast_and_reduce::<T>(pg)?;
    checks += all_gather::<T>(pg)?;
    checks += reduce_scatter::<T>(pg)?;
    checks += all_to_all::<T>(pg)?;
    Ok(checks)
}

/// Rank `rank`'s input element `i` for reduce op `op` (salted per call site).
pub fn input(op: ReduceOp, rank: usize, i: usize, salt: usize) -> f64 {
    match op {
        ReduceOp::Product => {
            if (rank + i + salt).is_multiple_of(3) {
                2.0
            } else {
                1.0
            }
        }
        _ => ((rank * 7 + i * 3 + salt) % 11) as f64,
    }
}

fn inputs<T: Element>(op: ReduceOp, rank: usize, len: usize, salt: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f64(input(op, rank, i, salt)))
        .collect()
}

/// The reduction of element `i` over ranks `0..n`, computed in f64 then converted.
fn expected<T: Element>(op: ReduceOp, n: usize, i: usize, salt: usize) -> T {
    let values = (0..n).map(|r| input(op, r, i, salt));
    let v = match op {
        ReduceOp::Sum => values.sum(),
        ReduceOp::Avg => {
            let sum: f64 = values.sum();
            if is_float::<T>() {
                sum / n as f64
            } else {
                (sum as i64 / n as i64) as f64
            }
        }
        ReduceOp::Max => values.fold(f64::MIN, f64::max),
        ReduceOp::Min => values.fold(f64::MAX, f64::min),
        ReduceOp::Product => values.product(),
    };
    T::from_f64(v)
}

fn is_float<T: Element>() -> bool {
    matches!(
        T::DTYPE,
        crate::DType::F32 | crate::DType::F64 | crate::DType::F16 | crate::DType::BF16
    )
}

/// Compares exactly, except averages of 16-bit floats (which round differently when
/// accumulated in f32) within one unit in the last place of the expected value.
fn same<T: Element>(actual: T, expected: T, op: ReduceOp) -> bool {
    let mantissa_bits = match T::DTYPE {
        crate::DType::F16 => 10,
        crate::DType::BF16 => 7,
        _ => return actual == expected,
    };
    if op != ReduceOp::Avg {
        return actual == expected;
    }
    let (a, e) = (actual.to_f64(), expected.to_f64());
    let ulp = if e == 0.0 {
        0.0
    } else {
        (e.abs().log2().floor() - f64::from(mantissa_bits)).exp2()
    };
    (a - e).abs() <= ulp
}

fn check<T: Element>(
    what: &str,
    pg: &ProcessGroup,
    actual: &[T],
    expected: impl Fn(usize) -> T,
    op: ReduceOp,
) -> Outcome {
    for (i, &a) in actual.iter().enumerate() {
        let e = expected(i);
        if !same(a, e, op) {
            return Err(format!(
                "{what} [{} on {} ranks, rank {}]: element {i} is {a:?}, expected {e:?}",
                T::DTYPE,
                pg.size(),
                pg.rank()
            ));
        }
    }
    Ok(1)
}

fn comm<T>(what: &str, r: Result<T, CommError>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

fn all_reduce<T: Element>(pg: &ProcessGroup) -> Outcome {
    let (n, me) = (pg.size(), pg.rank());
    let mut checks = 0;
    for op in ReduceOp::ALL {
        for (salt, &len) in SIZES.iter().enumerate() {
            let mut buf = inputs::<T>(op, me, len, salt);
            let what = format!("all_reduce op={op} len={len}");
            comm(&what, pg.all_reduce(&mut buf, op))?;
            checks += check(&what, pg, &buf, |i| expected::<T>(op, n, i, salt), op)?;
        }
    }
    Ok(checks)
}

fn broadcast_and_reduce<T: Element>(pg: &ProcessGroup) -> Outcome {
    let (n, me) = (pg.size(), pg.rank());
    let mut checks = 0;
    for root in 0..n {
        for &len in &[0, 3, 1000] {
            let mut buf = inputs::<T>(ReduceOp::Sum, me, len, root);
            let what = format!("broadcast root={root} len={len}");
            comm(&what, pg.broadcast(&mut buf, root))?;
            let want = |i| T::from_f64(input(ReduceOp::Sum, root, i, root));
            checks += check(&what, pg, &buf, want, ReduceOp::Sum)?;
        }
        for op in ReduceOp::ALL {
            let len = 37;
            let mut buf = inputs::<T>(op, me, len, root);
            let what = format!("reduce op={op} root={root} len={len}");
            comm(&what, pg.reduce(&mut buf, op, root))?;
            checks += if me == root {
                check(&what, pg, &buf, |i| expected::<T>(op, n, i, root), op)?
            } else {
                let own = |i| T::from_f64(input(op, me, i, root));
                check(&format!("{what} (non-root unchanged)"), pg, &buf, own, op)?
            };
        }
    }
    Ok(checks)
}

/// Uneven per-rank counts in the torch.chunk style: ⌈len/n⌉ each, the rest on the last
/// ranks, possibly zero.
pub fn chunk_counts(len: usize, n: usize) -> Vec<usize> {
    let per = len.div_ceil(n.max(1));
    (0..n)
        .map(|r| len.saturating_sub(r * per).min(per))
        .collect()
}

fn all_gather<T: Element>(pg: &ProcessGroup) -> Outcome {
    let (n, me) = (pg.size(), pg.rank());
    let mut checks = 0;
    let value = |r: usize, i: usize| T::from_f64(input(ReduceOp::Sum, r, i, 5));
    for &len in &[0, 1, 6, 513] {
        let send: Vec<T> = (0..len).map(|i| value(me, i)).collect();
        let mut recv = vec![T::zeroed(); len * n];
        let what = format!("all_gather len={len}");
        comm(&what, pg.all_gather(&send, &mut recv))?;
        checks += check(
            &what,
            pg,
            &recv,
            |j| value(j / len.max(1), j % len.max(1)),
            ReduceOp::Sum,
        )?;
    }
    for total in [0, 1, 7, 1001] {
        let counts = chunk_counts(total, n);
        let send: Vec<T> = (0..counts[me]).map(|i| value(me, i)).collect();
        let mut recv = vec![T::zeroed(); total];
        let what = format!("all_gather_uneven counts={counts:?}");
        comm(&what, pg.all_gather_uneven(&send, &mut recv, &counts))?;
        let per = total.div_ceil(n.max(1)).max(1);
        checks += check(&what, pg, &recv, |j| value(j / per, j % per), ReduceOp::Sum)?;
    }
    Ok(checks)
}

fn reduce_scatter<T: Element>(pg: &ProcessGroup) -> Outcome {
    let (n, me) = (pg.size(), pg.rank());
    let mut checks = 0;
    for op in ReduceOp::ALL {
        for (salt, &piece) in [0usize, 1, 9, 700].iter().enumerate() {
            let send = inputs::<T>(op, me, piece * n, salt);
            let mut recv = vec![T::zeroed(); piece];
            let what = format!("reduce_scatter op={op} piece={piece}");
            comm(&what, pg.reduce_scatter(&send, &mut recv, op))?;
            let want = |i| expected::<T>(op, n, me * piece + i, salt);
            checks += check(&what, pg, &recv, want, op)?;
        }
        for total in [0, 5, 1003] {
            let counts = chunk_counts(total, n);
            let send = inputs::<T>(op, me, total, total);
            let mut recv = vec![T::zeroed(); counts[me]];
            let what = format!("reduce_scatter_uneven op={op} counts={counts:?}");
            comm(
                &what,
                pg.reduce_scatter_uneven(&send, &mut recv, &counts, op),
            )?;
            let start: usize = counts[..me].iter().sum();
            let want = |i| expected::<T>(op, n, start + i, total);
            checks += check(&what, pg, &recv, want, op)?;
        }
    }
    Ok(checks)
}

fn all_to_all<T: Element>(pg: &ProcessGroup) -> Outcome {
    let (n, me) = (pg.size(), pg.rank());
    let mut checks = 0;
    // Element i of the piece that rank `from` sends to rank `to`.
    let value =
        |from: usize, to: usize, i: usize| T::from_f64(((from * 5 + to * 3 + i) % 13) as f64);
    for piece in [0, 1, 4, 300] {
        let send: Vec<T> = (0..n * piece)
            .map(|j| value(me, j / piece, j % piece))
            .collect();
        let mut recv = vec![T::zeroed(); n * piece];
        let what = format!("all_to_all piece={piece}");
        comm(&what, pg.all_to_all(&send, &mut recv))?;
        checks += check(
            &what,
            pg,
            &recv,
            |j| value(j / piece, me, j % piece),
            ReduceOp::Sum,
        )?;
    }
    // Uneven: rank i sends (i + 2j) % 4 elements to rank j (zero pieces included).
    let count = |from: usize, to: usize| (from + 2 * to) % 4;
    let send_counts: Vec<usize> = (0..n).map(|j| count(me, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|j| count(j, me)).collect();
    let send: Vec<T> = (0..n)
        .flat_map(|j| (0..count(me, j)).map(move |i| (j, i)))
        .map(|(j, i)| value(me, j, i))
        .collect();
    let expected: Vec<T> = (0..n)
        .flat_map(|j| (0..count(j, me)).map(move |i| (j, i)))
        .map(|(j, i)| value(j, me, i))
        .collect();
    let mut recv = vec![T::zeroed(); expected.len()];
    let what = format!("all_to_all_uneven send_counts={send_counts:?}");
    comm(
        &what,
        pg.all_to_all_uneven(&send, &send_counts, &mut recv, &recv_counts),
    )?;
    checks += check(&what, pg, &recv, |j| expected[j], ReduceOp::Sum)?;
    Ok(checks)
}

fn point_to_point(pg: &ProcessGroup) -> Outcome {
    let (n, me) = (pg.size(), pg.rank());
    let next = (me + 1) % n;
    let prev = (me + n - 1) % n;
    let mut checks = 0;
    // A ring, then two tags sent in one order and received in the other.
    let msg = |from: usize, tag: u64| -> Vec<f32> {
        (0..64)
            .map(|i| (from * 100 + i) as f32 + tag as f32)
            .collect()
    };
    for round in 0..3u64 {
        comm("send", pg.send(&msg(me, round), next, round))?;
        let mut got = vec![0f32; 64];
        comm("recv", pg.recv(&mut got, prev, round))?;
        let want = msg(prev, round);
        checks += check("ring send/recv", pg, &got, |i| want[i], ReduceOp::Sum)?;
    }
    comm("send tag 7", pg.send(&msg(me, 7), next, 7))?;
    comm("send tag 9", pg.send(&msg(me, 9), next, 9))?;
    let mut got9 = vec![0f32; 64];
    let mut got7 = vec![0f32; 64];
    comm("recv tag 9", pg.recv(&mut got9, prev, 9))?;
    comm("recv tag 7", pg.recv(&mut got7, prev, 7))?;
    let (want7, want9) = (msg(prev, 7), msg(prev, 9));
    checks += check("recv by tag (9)", pg, &got9, |i| want9[i], ReduceOp::Sum)?;
    checks += check("recv by tag (7)", pg, &got7, |i| want7[i], ReduceOp::Sum)?;
    // Asynchronous receive posted before the matching send.
    let recv = pg.recv_async(vec![0i64; 10], prev, 11);
    let send = pg.send_async(vec![me as i64; 10], next, 11);
    let got = comm("recv_async", recv.wait())?;
    comm("send_async", send.wait())?;
    checks += check("async send/recv", pg, &got, |_| prev as i64, ReduceOp::Sum)?;
    comm("barrier", pg.barrier())?;
    Ok(checks)
}

fn sub_groups(pg: &ProcessGroup) -> Outcome {
    let (n, me) = (pg.size(), pg.rank());
    let mut checks = 0;
    // Even and odd ranks, concurrently.
    let parity: Vec<usize> = (0..n).filter(|r| r % 2 == me % 2).collect();
    let sub = comm("new_group", pg.new_group(&parity))?;
    if sub.rank() != me / 2 || sub.size() != parity.len() {
        return Err(format!(
            "sub-group numbering: rank {me} got rank {} of {} in {parity:?}",
            sub.rank(),
            sub.size()
        ));
    }
    for _ in 0..5 {
        let mut v = vec![me as i64; 33];
        comm("sub all_reduce", sub.all_reduce(&mut v, ReduceOp::Sum))?;
        let want: i64 = parity.iter().map(|&r| r as i64).sum();
        checks += check("sub-group all_reduce", pg, &v, |_| want, ReduceOp::Sum)?;
    }
    // A reversed group renumbers ranks by position.
    let reversed: Vec<usize> = (0..n).rev().collect();
    let rev = comm("new_group reversed", pg.new_group(&reversed))?;
    let mut got = vec![0u8; n];
    comm("reversed all_gather", rev.all_gather(&[me as u8], &mut got))?;
    checks += check(
        "reversed group order",
        pg,
        &got,
        |j| (n - 1 - j) as u8,
        ReduceOp::Sum,
    )?;
    // A group of a sub-group (only its members create it).
    if sub.rank() == 0 {
        let first = comm("nested new_group", sub.new_group(&[0]))?;
        let mut v = vec![1.5f32; 4];
        comm(
            "singleton all_reduce",
            first.all_reduce(&mut v, ReduceOp::Sum),
        )?;
        checks += check("singleton group", pg, &v, |_| 1.5, ReduceOp::Sum)?;
    }
    comm("barrier", pg.barrier())?;
    Ok(checks)
}

fn async_overlap(pg: &ProcessGroup) -> Outcome {
    let n = pg.size();
    let me = pg.rank();
    let mut checks = 0;
    // Several collectives in flight; a blocking one issued after them still runs after them.
    let works: Vec<_> = (0..4)
        .map(|k| pg.all_reduce_async(vec![(me + k) as f64; 1000], ReduceOp::Sum))
        .collect();
    let gathered = pg.all_gather_async(vec![me as i32; 3]);
    let mut after = vec![1u8; 8];
    comm(
        "blocking after async",
        pg.all_reduce(&mut after, ReduceOp::Sum),
    )?;
    checks += check(
        "blocking after async",
        pg,
        &after,
        |_| n as u8,
        ReduceOp::Sum,
    )?;
    for (k, work) in works.into_iter().enumerate() {
        if !work.is_completed() {
            return Err("an async call queued before a blocking one was not complete".into());
        }
        let v = comm("all_reduce_async", work.wait())?;
        let want: f64 = (0..n).map(|r| (r + k) as f64).sum();
        checks += check("all_reduce_async", pg, &v, |_| want, ReduceOp::Sum)?;
    }
    let g = comm("all_gather_async", gathered.wait())?;
    checks += check(
        "all_gather_async",
        pg,
        &g,
        |j| (j / 3) as i32,
        ReduceOp::Sum,
    )?;
    let rs = comm(
        "reduce_scatter_async",
        pg.reduce_scatter_async(vec![1.0f32; 2 * n], ReduceOp::Sum)
            .wait(),
    )?;
    checks += check("reduce_scatter_async", pg, &rs, |_| n as f32, ReduceOp::Sum)?;
    let b = comm(
        "broadcast_async",
        pg.broadcast_async(vec![me as u8; 5], n - 1).wait(),
    )?;
    checks += check("broadcast_async", pg, &b, |_| (n - 1) as u8, ReduceOp::Sum)?;
    let a = comm(
        "all_to_all_async",
        pg.all_to_all_async(vec![me as i64; n]).wait(),
    )?;
    checks += check("all_to_all_async", pg, &a, |j| j as i64, ReduceOp::Sum)?;
    comm("barrier_async", pg.barrier_async().wait())?;
    Ok(checks)
}

fn errors_leave_group_usable(pg: &ProcessGroup) -> Outcome {
    let n = pg.size();
    let mut buf = vec![1.0f32; 4];
    let expect_invalid = |what: &str, r: Result<(), CommError>| match r {
        Err(CommError::InvalidArgument { .. }) => Ok(()),
        other => Err(format!("{what}: expected InvalidArgument, got {other:?}")),
    };
    expect_invalid("root out of range", pg.broadcast(&mut buf, n))?;
    expect_invalid(
        "reduce root out of range",
        pg.reduce(&mut buf, ReduceOp::Sum, n + 3),
    )?;
    let mut small = vec![0f32; 1];
    expect_invalid("all_gather recv too small", pg.all_gather(&buf, &mut small))?;
    let too_many_counts = vec![4; n + 1];
    expect_invalid(
        "uneven counts of wrong length",
        pg.all_gather_uneven(&buf, &mut small, &too_many_counts),
    )?;
    expect_invalid("send to a missing rank", pg.send(&buf, n, 0))?;
    match pg.new_group(&[0, 0]) {
        Err(CommError::InvalidGroup { .. }) => {}
        other => {
            return Err(format!(
                "duplicate ranks: expected InvalidGroup, got {other:?}"
            ));
        }
    }
    // Still usable.
    comm(
        "all_reduce after errors",
        pg.all_reduce(&mut buf, ReduceOp::Sum),
    )?;
    check(
        "all_reduce after errors",
        pg,
        &buf,
        |_| n as f32,
        ReduceOp::Sum,
    )
}
