//! All-reduce across MPI processes: every rank prints its result and the bus bandwidth.
//!
//! ```sh
//! cargo build --release -p bonfire-comm --features mpi --example mpi_allreduce
//! mpirun -np 4 target/release/examples/mpi_allreduce            # add --oversubscribe on small machines
//! mpirun -np 4 target/release/examples/mpi_allreduce 16M        # message size (K/M suffixes)
//! ```
//!
//! It joins the job with [`World::from_env`], which picks MPI because `mpirun` set
//! `OMPI_COMM_WORLD_RANK`; started without `mpirun` it runs as a single rank.

use bonfire_comm::testing::bench::parse_size;
use bonfire_comm::{ReduceOp, World};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let bytes = std::env::args()
        .nth(1)
        .map(|s| parse_size(&s).expect("size: a number with optional K/M/G"))
        .unwrap_or(4 << 20);
    let world = World::from_env()?;
    let pg = world.group();
    let (rank, n) = (pg.rank(), pg.size());

    // Correctness: rank r contributes r + 1 everywhere; everyone must get n(n+1)/2.
    let mut v = vec![(rank + 1) as f32; 8];
    pg.all_reduce(&mut v, ReduceOp::Sum)?;
    let want = (n * (n + 1) / 2) as f32;
    assert!(v.iter().all(|&x| x == want), "rank {rank}: {v:?} != {want}");

    // Bandwidth: f32 sum over `bytes`, best of a few rounds.
    let mut buf = vec![1.0f32; bytes / 4];
    let iters = ((2e9 / bytes as f64) as usize).clamp(3, 1000);
    pg.all_reduce(&mut buf, ReduceOp::Sum)?;
    let mut best = f64::MAX;
    for _ in 0..3 {
        pg.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            pg.all_reduce(&mut buf, ReduceOp::Sum)?;
        }
        best = best.min(t.elapsed().as_secs_f64() / iters as f64);
    }
    let busbw = bytes as f64 / best / 1e9 * 2.0 * (n as f64 - 1.0) / n.max(1) as f64;
    // Print in rank order.
    for r in 0..n {
        if r == rank {
            println!(
                "rank {rank}/{n} (local {}, {:?}, backend {}): all_reduce sum = {} (expected {want}); \
                 {bytes} bytes in {:.3} ms, busbw {busbw:.2} GB/s",
                world.local_rank(),
                world.started_by(),
                pg.backend_name(),
                v[0],
                best * 1e3,
            );
        }
        pg.barrier()?;
    }
    Ok(())
}
