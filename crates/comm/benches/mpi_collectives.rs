//! `cargo xtask bench comm --backend mpi`: bus bandwidth of Bonfire's MPI all_reduce next to
//! OpenMPI's own `MPI_Allreduce` (in place, same buffer, same run). Run under `mpirun`:
//!
//! ```text
//! mpirun -np 2 target/release/deps/mpi_collectives-<hash> [--sizes 4K,64M] [--rounds 5]
//! ```
//!
//! busbw follows nccl-tests: all_reduce algbw·2(n−1)/n with algbw = size / time.
//! ratio = ours / OpenMPI. Each figure is the best of `rounds` timed rounds; rounds of the two
//! implementations alternate so that both see the same machine state.

use bonfire_comm::mpi::MpiWorld;
use bonfire_comm::testing::bench::parse_size;
use bonfire_comm::{ProcessGroup, ReduceOp};
use mpi::ffi;
use std::os::raw::{c_int, c_void};
use std::time::{Duration, Instant};

struct Args {
    sizes: Vec<usize>,
    rounds: usize,
    round: Duration,
}

fn parse_args() -> Args {
    let mut args = Args {
        sizes: "4K,64K,256K,1M,4M,16M,32M,64M"
            .split(',')
            .map(|s| parse_size(s).expect("size"))
            .collect(),
        rounds: 5,
        round: Duration::from_millis(150),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--sizes" => {
                args.sizes = it
                    .next()
                    .expect("--sizes LIST")
                    .split(',')
                    .map(|s| parse_size(s).expect("size"))
                    .collect()
            }
            "--rounds" => args.rounds = it.next().expect("--rounds N").parse().expect("number"),
            "--round-ms" => {
                args.round =
                    Duration::from_millis(it.next().expect("--round-ms N").parse().expect("number"))
            }
            _ => {} // `--bench` and friends from cargo
        }
    }
    args
}

/// Iterations per round so that a round lasts about `round`.
fn iterations(bytes: usize, round: Duration) -> usize {
    bonfire_comm::testing::bench::iterations(bytes, round, Duration::from_micros(5), 20_000)
}

/// Seconds per call of the best round; every rank runs the same loop, rank 0's time is used.
fn best_round(pg: &ProcessGroup, iters: usize, rounds: usize, mut once: impl FnMut()) -> f64 {
    once();
    (0..rounds)
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
}

fn main() {
    let args = parse_args();
    let world = MpiWorld::init().expect("MPI init (run under mpirun)");
    let pg = world.group().clone();
    let n = pg.size();
    for &bytes in &args.sizes {
        let len = bytes / 4;
        let mut buf = vec![1.0f32; len];
        let iters = iterations(bytes, args.round);
        let (mut ours, mut theirs) = (f64::MAX, f64::MAX);
        for _ in 0..args.rounds {
            ours = ours.min(best_round(&pg, iters, 1, || {
                pg.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            }));
            theirs = theirs.min(best_round(&pg, iters, 1, || {
                // SAFETY: MPI is initialised; OpenMPI's MPI_IN_PLACE is (void*)1.
                unsafe {
                    ffi::MPI_Allreduce(
                        std::ptr::without_provenance::<c_void>(1),
                        buf.as_mut_ptr() as *mut c_void,
                        len as c_int,
                        ffi::RSMPI_FLOAT,
                        ffi::RSMPI_SUM,
                        ffi::RSMPI_COMM_WORLD,
                    );
                }
            }));
        }
        let factor = 2.0 * (n as f64 - 1.0) / n as f64;
        let busbw = bytes as f64 / ours / 1e9 * factor;
        let mpi_busbw = bytes as f64 / theirs / 1e9 * factor;
        if pg.rank() == 0 {
            println!(
                "bench comm op=all_reduce backend=mpi ranks={n} bytes={bytes} busbw_gbps={busbw:.2} \
                 openmpi_busbw_gbps={mpi_busbw:.2} ratio={:.2}",
                busbw / mpi_busbw
            );
        }
    }
    drop(world);
}
