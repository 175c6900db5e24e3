//! Properties of the in-process backend beyond values: calls allocate nothing once warm, and
//! asynchronous calls really overlap the caller's work.

use bonfire_comm::testing::rank_alloc::{self, RankAllocator};
use bonfire_comm::{ReduceOp, ThreadWorld};
use std::time::{Duration, Instant};

/// Counts each rank thread's allocation calls (other tests run in parallel on threads of
/// no rank).
#[global_allocator]
static HEAP: RankAllocator = RankAllocator;

/// One rank's buffers for a round of every kind of call.
struct Buffers {
    buf: Vec<f32>,
    gathered: Vec<f32>,
    piece: Vec<f32>,
    send: Vec<f32>,
    exchanged: Vec<f32>,
    uneven: Vec<f32>,
    message: Vec<f64>,
}

const COUNTS: [usize; 3] = [5, 0, 7];

impl Buffers {
    fn new(n: usize) -> Self {
        Self {
            buf: vec![1.0; 4096],
            gathered: vec![0.0; 4096 * n],
            piece: vec![0.0; 4096 / n],
            send: vec![0.0; (4096 / n) * n],
            exchanged: vec![0.0; (4096 / n) * n],
            uneven: vec![0.0; COUNTS.iter().sum()],
            message: vec![0.0; 256],
        }
    }

    fn round(&mut self, pg: &bonfire_comm::ProcessGroup) {
        let (n, me) = (pg.size(), pg.rank());
        pg.all_reduce(&mut self.buf, ReduceOp::Sum).unwrap();
        pg.broadcast(&mut self.buf, 1).unwrap();
        pg.reduce(&mut self.buf, ReduceOp::Max, 2).unwrap();
        pg.all_gather(&self.buf, &mut self.gathered).unwrap();
        pg.reduce_scatter(&self.send, &mut self.piece, ReduceOp::Avg)
            .unwrap();
        pg.all_to_all(&self.send, &mut self.exchanged).unwrap();
        pg.all_gather_uneven(&self.buf[..COUNTS[me]], &mut self.uneven, &COUNTS)
            .unwrap();
        pg.send(&[1.0f64; 256], (me + 1) % n, 2).unwrap();
        pg.recv(&mut self.message, (me + n - 1) % n, 2).unwrap();
        pg.barrier().unwrap();
    }
}

#[test]
fn warm_collectives_and_messages_allocate_nothing() {
    let n = COUNTS.len();
    let per_rank = ThreadWorld::new(n)
        .timeout(Duration::from_secs(30))
        .launch(|pg| {
            let mut buffers = Buffers::new(n);
            // Warm up: the first calls create channel entries and pooled message buffers. The
            // message pool grows to the largest number of messages ever in flight at once, so
            // reach that peak (every rank's message in flight) before counting.
            for _ in 0..3 {
                buffers.round(&pg);
            }
            let (me, n) = (pg.rank(), pg.size());
            pg.send(&[1.0f64; 256], (me + 1) % n, 2).unwrap();
            pg.barrier().unwrap();
            pg.recv(&mut buffers.message, (me + n - 1) % n, 2).unwrap();
            // Rank ids of their own: no other test's thread is charged to them.
            let id = 200 + me;
            let _counted = rank_alloc::enter_rank(id);
            let start = rank_alloc::allocations(id);
            for _ in 0..50 {
                buffers.round(&pg);
            }
            rank_alloc::allocations(id) - start
        })
        .unwrap();
    assert_eq!(
        per_rank,
        vec![0; n],
        "allocations per rank over 50 warm rounds"
    );
}

#[test]
fn async_collectives_overlap_the_callers_work() {
    let late = Duration::from_millis(300);
    let outcomes = ThreadWorld::new(2)
        .timeout(Duration::from_secs(30))
        .launch(|pg| {
            if pg.rank() == 1 {
                std::thread::sleep(late);
                let mut v = vec![2.0f32; 1 << 16];
                pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                return (true, Duration::ZERO);
            }
            let started = Instant::now();
            let work = pg.all_reduce_async(vec![1.0f32; 1 << 16], ReduceOp::Sum);
            // The call returned at once; the caller keeps working while the peer is late.
            let issued_in = started.elapsed();
            let mut pending_seen = false;
            while started.elapsed() < late / 2 {
                pending_seen |= !work.is_completed();
                std::hint::black_box((0..1000).sum::<u64>());
            }
            let v = work.wait().unwrap();
            (pending_seen && v.iter().all(|&x| x == 3.0), issued_in)
        })
        .unwrap();
    let (ok, issued_in) = outcomes[0];
    assert!(
        ok,
        "the async all_reduce must be pending while the caller works, then correct"
    );
    assert!(
        issued_in < Duration::from_millis(50),
        "issuing took {issued_in:?}"
    );
}
