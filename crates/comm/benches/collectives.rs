//! `cargo xtask bench comm`: bus bandwidth of the in-process collectives next to the
//! single-thread memcpy bandwidth of the same size, measured in the same run.
//!
//! busbw follows nccl-tests: all_reduce algbw·2(n−1)/n, all_gather and reduce_scatter
//! algbw·(n−1)/n, where algbw = size / time and size is the all_reduce buffer, the gathered
//! buffer, or the reduce-scatter input. ratio = busbw / memcpy.

use bonfire_comm::testing::bench::parse_size;
use bonfire_comm::{ProcessGroup, ReduceOp, ThreadWorld};
use clap::Parser;
use std::hint::black_box;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "Collective bandwidth of the in-process backend")]
struct Args {
    /// Number of rank threads.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Message sizes in bytes (suffixes K and M are powers of two).
    #[arg(long, value_delimiter = ',', default_value = "4K,256K,4M,64M")]
    sizes: Vec<String>,
    /// Collectives to measure.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "all_reduce,all_gather,reduce_scatter"
    )]
    ops: Vec<String>,
    /// Target duration of one timed round, in milliseconds.
    #[arg(long, default_value_t = 150)]
    round_ms: u64,
    /// Timed rounds per measurement; the best round is reported (for memcpy too).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Accepted for `cargo bench` compatibility.
    #[arg(long, hide = true)]
    bench: bool,
}

/// Iterations per round of `bytes` (about `--round-ms` per round).
fn iterations(bytes: usize, args: &Args) -> usize {
    let round = Duration::from_millis(args.round_ms);
    bonfire_comm::testing::bench::iterations(bytes, round, Duration::from_micros(2), 50_000)
}

/// Best time of one single-thread memcpy of `bytes`.
fn memcpy_time(bytes: usize, args: &Args) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let iters = iterations(bytes, args);
    dst.copy_from_slice(&src);
    (0..args.rounds)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                dst.copy_from_slice(black_box(&src));
                black_box(&mut dst);
            }
            t.elapsed().as_secs_f64() / iters as f64
        })
        .fold(f64::MAX, f64::min)
}

/// Best time of one collective on `bytes`, as seen by rank 0 between two barriers.
fn collective_time(op: &str, bytes: usize, args: &Args) -> f64 {
    let n = args.ranks;
    let iters = iterations(bytes, args);
    let times = ThreadWorld::new(n)
        .launch(|pg: ProcessGroup| {
            let elems = bytes / 4;
            let (mut a, mut b) = match op {
                "all_reduce" => (vec![1.0f32; elems], vec![]),
                "all_gather" => (vec![1.0f32; elems / n], vec![0.0f32; elems / n * n]),
                "reduce_scatter" => (vec![1.0f32; elems / n * n], vec![0.0f32; elems / n]),
                other => panic!("unknown op {other}"),
            };
            let mut once = || {
                match op {
                    "all_reduce" => pg.all_reduce(&mut a, ReduceOp::Sum),
                    "all_gather" => pg.all_gather(&a, &mut b),
                    _ => pg.reduce_scatter(&a, &mut b, ReduceOp::Sum),
                }
                .expect("collective failed")
            };
            for _ in 0..3 {
                once();
            }
            (0..args.rounds)
                .map(|_| {
                    pg.barrier().unwrap();
                    let t = Instant::now();
                    for _ in 0..iters {
                        once();
                    }
                    pg.barrier().unwrap();
                    t.elapsed().as_secs_f64() / iters as f64
                })
                .fold(f64::MAX, f64::min)
        })
        .expect("bench ranks failed");
    times[0]
}

fn main() {
    let args = Args::parse();
    let n = args.ranks;
    for size in &args.sizes {
        let bytes = parse_size(size).expect("--sizes");
        let memcpy_gbps = bytes as f64 / memcpy_time(bytes, &args) / 1e9;
        for op in &args.ops {
            let t = collective_time(op, bytes, &args);
            let algbw = bytes as f64 / t / 1e9;
            let factor = match op.as_str() {
                "all_reduce" => 2.0 * (n as f64 - 1.0) / n as f64,
                _ => (n as f64 - 1.0) / n as f64,
            };
            let busbw = algbw * factor;
            println!(
                "bench comm op={op} backend=threads ranks={n} bytes={bytes} busbw_gbps={busbw:.2} \
                 memcpy_gbps={memcpy_gbps:.2} ratio={:.2}",
                busbw / memcpy_gbps
            );
        }
    }
}
