//! MPI conformance and failure tests. Runs under `mpirun` (one process per rank, so
//! `harness = false`: MPI initialises once per process). `cargo xtask test` launches it:
//!
//! ```text
//! mpirun -np 2 --oversubscribe target/debug/deps/mpi_conformance-<hash>            # all checks
//! mpirun -np 2 --oversubscribe target/debug/deps/mpi_conformance-<hash> fail-panic  # expected to fail
//! ```
//!
//! Modes (first argument): `conformance` (default), and the failure scenarios `fail-panic`,
//! `fail-exit`, `fail-mismatch`, `fail-timeout`, each of which must end the job with a
//! non-zero exit and a clear message within seconds (checked by xtask).

use bonfire_comm::mpi::MpiWorld;
use bonfire_comm::{CommError, DType, Element, ProcessGroup, ReduceOp, bf16, f16};
use std::time::{Duration, Instant};

type Check = Result<(), String>;

fn ensure(cond: bool, what: impl FnOnce() -> String) -> Check {
    if cond { Ok(()) } else { Err(what()) }
}

fn err<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> String {
    move |e| format!("{what}: {e}")
}

/// Value of element `i` on rank `r` (small integers: exact in every dtype).
fn val(r: usize, i: usize) -> f64 {
    ((r * 3 + i) % 7 + 1) as f64
}

fn expected_reduce(op: ReduceOp, n: usize, i: usize, dtype: DType) -> f64 {
    let vals: Vec<f64> = (0..n).map(|r| val(r, i)).collect();
    match op {
        ReduceOp::Sum => vals.iter().sum(),
        ReduceOp::Avg => {
            let s: f64 = vals.iter().sum();
            match dtype {
                DType::I32 | DType::I64 | DType::U8 => (s as i64 / n as i64) as f64,
                _ => s / n as f64,
            }
        }
        ReduceOp::Max => vals.iter().cloned().fold(f64::MIN, f64::max),
        ReduceOp::Min => vals.iter().cloned().fold(f64::MAX, f64::min),
        ReduceOp::Product => vals.iter().product(),
    }
}

fn same<T: Element>(a: T, b: f64) -> bool {
    a == T::from_f64(b)
}

fn typed<T: Element>(pg: &ProcessGroup) -> Check {
    let (n, me) = (pg.size(), pg.rank());
    let dtype = T::DTYPE;
    let len = 37;
    for op in ReduceOp::ALL {
        // Products overflow u8 beyond a few ranks: compare with wrapping expectations only
        // where exact.
        let mut buf: Vec<T> = (0..len).map(|i| T::from_f64(val(me, i))).collect();
        pg.all_reduce(&mut buf, op).map_err(err("all_reduce"))?;
        for (i, &x) in buf.iter().enumerate() {
            let want = expected_reduce(op, n, i, dtype);
            if dtype == DType::U8 && want > 255.0 {
                continue;
            }
            ensure(same(x, want), || {
                format!("all_reduce {dtype} {op} [{i}]: got {x:?}, want {want}")
            })?;
        }
        for root in [0, n - 1] {
            let orig: Vec<T> = (0..len).map(|i| T::from_f64(val(me, i))).collect();
            let mut buf = orig.clone();
            pg.reduce(&mut buf, op, root).map_err(err("reduce"))?;
            for (i, &x) in buf.iter().enumerate() {
                let want = if me == root {
                    expected_reduce(op, n, i, dtype)
                } else {
                    val(me, i)
                };
                if dtype == DType::U8 && want > 255.0 {
                    continue;
                }
                ensure(same(x, want), || {
                    format!("reduce {dtype} {op} root {root} [{i}]: got {x:?}, want {want}")
                })?;
            }
        }
        // Even and uneven reduce-scatter.
        let piece = 5;
        let send: Vec<T> = (0..piece * n).map(|i| T::from_f64(val(me, i))).collect();
        let mut recv = vec![T::zeroed(); piece];
        pg.reduce_scatter(&send, &mut recv, op)
            .map_err(err("reduce_scatter"))?;
        for (j, &x) in recv.iter().enumerate() {
            let want = expected_reduce(op, n, me * piece + j, dtype);
            if dtype == DType::U8 && want > 255.0 {
                continue;
            }
            ensure(same(x, want), || {
                format!("reduce_scatter {dtype} {op} [{j}]: got {x:?}, want {want}")
            })?;
        }
        let counts: Vec<usize> = (0..n).map(|r| r + 1).collect();
        let total: usize = counts.iter().sum();
        let send: Vec<T> = (0..total).map(|i| T::from_f64(val(me, i))).collect();
        let mut recv = vec![T::zeroed(); counts[me]];
        pg.reduce_scatter_uneven(&send, &mut recv, &counts, op)
            .map_err(err("reduce_scatter_uneven"))?;
        let start: usize = counts[..me].iter().sum();
        for (j, &x) in recv.iter().enumerate() {
            let want = expected_reduce(op, n, start + j, dtype);
            if dtype == DType::U8 && want > 255.0 {
                continue;
            }
            ensure(same(x, want), || {
                format!("reduce_scatter_uneven {dtype} {op} [{j}]: got {x:?}, want {want}")
            })?;
        }
    }
    // Broadcast from every root.
    for root in 0..n {
        let mut buf: Vec<T> = (0..len).map(|i| T::from_f64(val(me, i))).collect();
        pg.broadcast(&mut buf, root).map_err(err("broadcast"))?;
        ensure(
            buf.iter().enumerate().all(|(i, &x)| same(x, val(root, i))),
            || format!("broadcast {dtype} root {root}: got {buf:?}"),
        )?;
    }
    // All-gather, even and uneven.
    let send: Vec<T> = (0..3).map(|i| T::from_f64(val(me, i))).collect();
    let mut recv = vec![T::zeroed(); 3 * n];
    pg.all_gather(&send, &mut recv).map_err(err("all_gather"))?;
    for r in 0..n {
        for i in 0..3 {
            ensure(same(recv[r * 3 + i], val(r, i)), || {
                format!("all_gather {dtype}: {recv:?}")
            })?;
        }
    }
    let counts: Vec<usize> = (0..n).map(|r| (r * 2) % 5).collect();
    let send: Vec<T> = (0..counts[me]).map(|i| T::from_f64(val(me, i))).collect();
    let mut recv = vec![T::zeroed(); counts.iter().sum()];
    pg.all_gather_uneven(&send, &mut recv, &counts)
        .map_err(err("all_gather_uneven"))?;
    let mut at = 0;
    for (r, &c) in counts.iter().enumerate() {
        for i in 0..c {
            ensure(same(recv[at + i], val(r, i)), || {
                format!("all_gather_uneven {dtype}: {recv:?}")
            })?;
        }
        at += c;
    }
    // All-to-all, even and uneven: piece j from rank i holds 10·i + j (+ k).
    let code = |i: usize, j: usize, k: usize| ((10 * i + j + k) % 100) as f64;
    let piece = 2;
    let send: Vec<T> = (0..n * piece)
        .map(|x| T::from_f64(code(me, x / piece, x % piece)))
        .collect();
    let mut recv = vec![T::zeroed(); n * piece];
    pg.all_to_all(&send, &mut recv).map_err(err("all_to_all"))?;
    for x in 0..n * piece {
        ensure(same(recv[x], code(x / piece, me, x % piece)), || {
            format!("all_to_all {dtype}: {recv:?}")
        })?;
    }
    let cnt = |i: usize, j: usize| (i + 2 * j) % 3;
    let send_counts: Vec<usize> = (0..n).map(|j| cnt(me, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|i| cnt(i, me)).collect();
    let send: Vec<T> = (0..n)
        .flat_map(|j| (0..cnt(me, j)).map(move |k| T::from_f64(code(me, j, k))))
        .collect();
    let mut recv = vec![T::zeroed(); recv_counts.iter().sum()];
    pg.all_to_all_uneven(&send, &send_counts, &mut recv, &recv_counts)
        .map_err(err("all_to_all_uneven"))?;
    let want: Vec<T> = (0..n)
        .flat_map(|i| (0..cnt(i, me)).map(move |k| T::from_f64(code(i, me, k))))
        .collect();
    ensure(recv == want, || {
        format!("all_to_all_uneven {dtype}: {recv:?} != {want:?}")
    })?;
    // Point-to-point ring, both directions, two tags.
    let right = (me + 1) % n;
    let left = (me + n - 1) % n;
    let msg: Vec<T> = (0..9).map(|i| T::from_f64(val(me, i))).collect();
    pg.send(&msg, right, 5).map_err(err("send"))?;
    pg.send(&msg[..4], left, 70000).map_err(err("send"))?;
    let mut got = vec![T::zeroed(); 9];
    pg.recv(&mut got, left, 5).map_err(err("recv"))?;
    ensure(
        got.iter().enumerate().all(|(i, &x)| same(x, val(left, i))),
        || format!("recv {dtype} from {left}: {got:?}"),
    )?;
    let mut got = vec![T::zeroed(); 4];
    pg.recv(&mut got, right, 70000).map_err(err("recv"))?;
    ensure(
        got.iter().enumerate().all(|(i, &x)| same(x, val(right, i))),
        || format!("recv {dtype} tag 70000 from {right}: {got:?}"),
    )?;
    Ok(())
}

fn all_dtypes(pg: &ProcessGroup) -> Check {
    typed::<f32>(pg)?;
    typed::<f64>(pg)?;
    typed::<f16>(pg)?;
    typed::<bf16>(pg)?;
    typed::<i32>(pg)?;
    typed::<i64>(pg)?;
    typed::<u8>(pg)?;
    Ok(())
}

fn extras(pg: &ProcessGroup) -> Check {
    let (n, me) = (pg.size(), pg.rank());
    pg.barrier().map_err(err("barrier"))?;
    // Large all-reduces: the ring path (≥ 16 MiB f32) and MPI's own (f64, smaller), with Avg.
    let len = (17 << 20) / 4 + 3;
    let mut big: Vec<f32> = (0..len).map(|i| (i % 1000) as f32 + me as f32).collect();
    pg.all_reduce(&mut big, ReduceOp::Sum)
        .map_err(err("big all_reduce"))?;
    let extra: f32 = (0..n).map(|r| r as f32).sum();
    for i in (0..len).step_by(4099).chain([len - 1]) {
        let want = n as f32 * (i % 1000) as f32 + extra;
        ensure(big[i] == want, || {
            format!("big all_reduce [{i}]: {} != {want}", big[i])
        })?;
    }
    let mut big: Vec<f32> = (0..len).map(|i| (i % 10) as f32 * n as f32).collect();
    pg.all_reduce(&mut big, ReduceOp::Avg)
        .map_err(err("big all_reduce avg"))?;
    ensure(
        (0..len)
            .step_by(997)
            .all(|i| big[i] == (i % 10) as f32 * n as f32),
        || "big all_reduce avg".into(),
    )?;
    let mut big: Vec<f32> = (0..len)
        .map(|i| if i % n == me { 5.0 } else { 1.0 })
        .collect();
    pg.all_reduce(&mut big, ReduceOp::Max)
        .map_err(err("big all_reduce max"))?;
    ensure(big.iter().all(|&x| x == 5.0), || {
        "big all_reduce max".into()
    })?;
    // Async forms keep their order and overlap with the caller.
    let w1 = pg.all_reduce_async(vec![me as f64 + 1.0; 1000], ReduceOp::Sum);
    let w2 = pg.all_gather_async(vec![me as i32; 2]);
    let w3 = pg.broadcast_async(vec![me as u8; 3], n - 1);
    let w4 = pg.reduce_scatter_async(vec![1i64; 2 * n], ReduceOp::Sum);
    let w5 = pg.all_to_all_async(vec![me as f32; n]);
    let w6 = pg.barrier_async();
    let tot: f64 = (1..=n).map(|r| r as f64).sum();
    ensure(
        w1.wait().map_err(err("async all_reduce"))? == vec![tot; 1000],
        || "async all_reduce".into(),
    )?;
    let g = w2.wait().map_err(err("async all_gather"))?;
    ensure(
        g == (0..n).flat_map(|r| [r as i32; 2]).collect::<Vec<_>>(),
        || format!("async all_gather {g:?}"),
    )?;
    ensure(
        w3.wait().map_err(err("async bcast"))? == vec![(n - 1) as u8; 3],
        || "async broadcast".into(),
    )?;
    ensure(
        w4.wait().map_err(err("async rs"))? == vec![n as i64; 2],
        || "async reduce_scatter".into(),
    )?;
    let a = w5.wait().map_err(err("async a2a"))?;
    ensure(a == (0..n).map(|r| r as f32).collect::<Vec<_>>(), || {
        format!("async all_to_all {a:?}")
    })?;
    w6.wait().map_err(err("async barrier"))?;
    let sw = pg.send_async(vec![me as u64 as f32; 5], (me + 1) % n, 9);
    let rw = pg.recv_async(vec![0f32; 5], (me + n - 1) % n, 9);
    let got = rw.wait().map_err(err("recv_async"))?;
    sw.wait().map_err(err("send_async"))?;
    ensure(got == vec![((me + n - 1) % n) as f32; 5], || {
        format!("recv_async {got:?}")
    })?;
    // Sub-groups: evens and odds (disjoint, concurrently), then a reversed full group.
    let mine: Vec<usize> = (0..n).filter(|r| r % 2 == me % 2).collect();
    let sub = pg.new_group(&mine).map_err(err("new_group"))?;
    ensure(
        sub.rank() == mine.iter().position(|&r| r == me).unwrap(),
        || "sub rank".into(),
    )?;
    ensure(sub.backend_name() == "mpi", || "sub backend".into())?;
    let mut v = vec![me as i64; 4];
    sub.all_reduce(&mut v, ReduceOp::Sum)
        .map_err(err("sub all_reduce"))?;
    let want: i64 = mine.iter().map(|&r| r as i64).sum();
    ensure(v == vec![want; 4], || {
        format!("sub all_reduce {v:?} != {want}")
    })?;
    typed::<f32>(&sub)?;
    let rev: Vec<usize> = (0..n).rev().collect();
    let rg = pg.new_group(&rev).map_err(err("new_group rev"))?;
    ensure(rg.rank() == n - 1 - me, || "reversed rank".into())?;
    ensure(rg.world_ranks() == rev, || "reversed world ranks".into())?;
    let mut b = vec![me as f32; 2];
    rg.broadcast(&mut b, 0).map_err(err("rev broadcast"))?;
    ensure(b == vec![(n - 1) as f32; 2], || {
        format!("reversed broadcast {b:?}")
    })?;
    // A mismatch is reported on every rank with both views; the group stays usable.
    if n == 1 {
        return Ok(());
    }
    let r = if me == 0 {
        pg.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
    } else {
        pg.all_reduce(&mut [1.0f32; 5], ReduceOp::Sum)
    };
    match r {
        Err(CommError::Mismatch { local, remote, .. }) => {
            ensure(local != remote, || "same views".into())?
        }
        other => return Err(format!("expected a mismatch, got {other:?}")),
    }
    let r = if me == 0 {
        pg.broadcast(&mut [0u8; 4], 0)
    } else {
        pg.reduce(&mut [0u8; 4], ReduceOp::Sum, 0)
    };
    ensure(matches!(r, Err(CommError::Mismatch { .. })), || {
        format!("kind mismatch: {r:?}")
    })?;
    // Uneven all-to-all whose counts disagree: CountMismatch everywhere, group usable.
    let mut send_counts = vec![1usize; n];
    if me == 0 {
        send_counts[n - 1] = 2;
    }
    let send = vec![0i32; send_counts.iter().sum()];
    let mut recv = vec![0i32; n];
    let r = pg.all_to_all_uneven(&send, &send_counts, &mut recv, &vec![1; n]);
    ensure(
        matches!(r, Err(CommError::CountMismatch { sender: 0, .. })),
        || format!("count mismatch: {r:?}"),
    )?;
    // Invalid arguments are local and leave the group usable.
    let r = pg.broadcast(&mut [0f32; 2], n);
    ensure(matches!(r, Err(CommError::InvalidArgument { .. })), || {
        format!("bad root: {r:?}")
    })?;
    let mut v = vec![1u8; 3];
    pg.all_reduce(&mut v, ReduceOp::Sum)
        .map_err(err("after errors"))?;
    ensure(v == vec![n as u8; 3], || {
        "group unusable after errors".into()
    })?;
    Ok(())
}

fn conformance(world: &MpiWorld) -> Check {
    let pg = world.group();
    let started = Instant::now();
    // The suite every backend passes, then MPI-specific checks (ring path, tags ≥ 32768...).
    let checks = bonfire_comm::testing::conformance::run_all(pg)
        .map_err(|e| format!("shared conformance suite: {e}"))?;
    all_dtypes(pg)?;
    extras(pg)?;
    if pg.rank() == 0 {
        println!(
            "mpi conformance: {} ranks OK ({checks} shared checks + MPI checks) in {:.2}s \
             ({}; MPI_THREAD_MULTIPLE: {})",
            pg.size(),
            started.elapsed().as_secs_f64(),
            world.library_version(),
            world.thread_multiple()
        );
    }
    Ok(())
}

/// Panics with the error's message (Display, which carries both views and the recorder).
fn must(r: Result<(), CommError>, what: &str) {
    if let Err(e) = r {
        panic!("{what}: {e}");
    }
}

fn main() {
    let mode = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "conformance".into());
    let world = MpiWorld::init().expect("MPI init");
    let pg = world.group().clone();
    let me = pg.rank();
    let last = pg.size() - 1;
    match mode.as_str() {
        "conformance" => {
            if let Err(e) = conformance(&world) {
                eprintln!("mpi conformance FAILED on rank {me}: {e}");
                bonfire_comm::mpi::abort_job(1);
            }
        }
        "fail-panic" => {
            pg.barrier().unwrap();
            if me == last {
                panic!("rank {me} panics on purpose");
            }
            let r = pg.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum);
            eprintln!("rank {me}: all_reduce returned {r:?} (the job should be aborted)");
            std::thread::sleep(Duration::from_secs(60));
        }
        "fail-exit" => {
            pg.barrier().unwrap();
            if me == last {
                eprintln!("rank {me}: returning early without the last all_reduce");
                drop(world);
                return;
            }
            let r = pg.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum);
            eprintln!(
                "rank {me}: all_reduce returned {}",
                match &r {
                    Ok(()) => "Ok".to_string(),
                    Err(e) => e.to_string(),
                }
            );
            must(r, "a peer exited early");
        }
        "fail-mismatch" => {
            pg.barrier().unwrap();
            let r = if me == last {
                pg.all_gather(&[1.0f32; 3], &mut vec![0.0; 3 * (last + 1)])
            } else {
                pg.all_reduce(&mut [1.0f32; 3], ReduceOp::Sum)
            };
            must(r, "collectives must match");
        }
        "fail-timeout" => {
            pg.set_timeout(Duration::from_secs(2));
            if me != last {
                let r = pg.barrier();
                must(r, "a peer never arrived");
            } else {
                std::thread::sleep(Duration::from_secs(60));
            }
        }
        other => {
            eprintln!("unknown mode {other}");
            std::process::exit(2);
        }
    }
    drop(world);
}
