//! NCCL on real GPUs. Every test here is `#[ignore]`d and named `gpu_*`: the CPU-only
//! `cargo xtask test` never runs them; `cargo xtask test-multi-gpu` does, on a machine with
//! NVIDIA GPUs, libcuda and libnccl (see docs/multi-process.md). Each visible GPU is one rank,
//! driven by one thread of this process.
#![cfg(feature = "nccl")]

use bonfire_comm::nccl::{NcclComm, UniqueId, launch_on_every_gpu, probe};
use bonfire_comm::rendezvous::Rendezvous;
use bonfire_comm::testing::conformance::run_dtype;
use bonfire_comm::{DType, ProcessGroup, ReduceOp, bf16, f16};
use std::time::{Duration, Instant};

fn gpus() -> usize {
    let libs = probe().unwrap_or_else(|e| panic!("GPU tests need CUDA and NCCL: {e}"));
    assert!(libs.devices >= 1, "no CUDA device visible");
    println!("NCCL {} with {} GPU(s)", libs.nccl_version, libs.devices);
    libs.devices
}

/// The dtype suites of the shared conformance suite (host buffers staged through the GPU).
fn conformance(pg: &ProcessGroup) -> Result<usize, String> {
    let mut checks = 0;
    checks += run_dtype::<f32>(pg)?;
    checks += run_dtype::<f64>(pg)?;
    checks += run_dtype::<f16>(pg)?;
    checks += run_dtype::<bf16>(pg)?;
    checks += run_dtype::<i32>(pg)?;
    checks += run_dtype::<i64>(pg)?;
    checks += run_dtype::<u8>(pg)?;
    // Sub-groups: even and odd GPUs.
    let (n, me) = (pg.size(), pg.rank());
    let members: Vec<usize> = (0..n).filter(|r| r % 2 == me % 2).collect();
    let sub = pg.new_group(&members).map_err(|e| e.to_string())?;
    checks += run_dtype::<f32>(&sub)?;
    // A mismatch is reported on every rank and the group stays usable.
    if n > 1 {
        let len = if me == 0 { 4 } else { 5 };
        match pg.all_reduce(&mut vec![1.0f32; len], ReduceOp::Sum) {
            Err(bonfire_comm::CommError::Mismatch { .. }) => checks += 1,
            other => return Err(format!("expected a mismatch, got {other:?}")),
        }
        let mut v = vec![1.0f32; 3];
        pg.all_reduce(&mut v, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        checks += 1;
    }
    Ok(checks)
}

#[test]
#[ignore = "needs NVIDIA GPUs: cargo xtask test-multi-gpu"]
fn gpu_conformance_on_every_visible_gpu() {
    gpus();
    let (_, results) = launch_on_every_gpu("gpu", Duration::from_secs(60), conformance)
        .unwrap_or_else(|e| panic!("{e}"));
    for (rank, r) in results.into_iter().enumerate() {
        let checks = r.unwrap_or_else(|e| panic!("GPU rank {rank}: {e}"));
        println!("GPU rank {rank}: {checks} checks passed");
    }
}

#[test]
#[ignore = "needs NVIDIA GPUs: cargo xtask test-multi-gpu"]
fn gpu_tcp_rendezvous_bootstrap_and_device_pointer_all_reduce() {
    use cudarc::driver::result as cu;
    let n = gpus();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    std::thread::scope(|s| {
        for rank in 0..n {
            s.spawn(move || {
                let rv = Rendezvous {
                    master_addr: "127.0.0.1".into(),
                    master_port: port,
                    rank,
                    size: n,
                    key: 0,
                    timeout: Duration::from_secs(60),
                };
                let id = UniqueId::share_tcp(&rv).unwrap();
                let comm = NcclComm::init(&id, rank, n, rank).unwrap();
                // Device buffers, as a Burn CUDA tensor would hold them: no host staging.
                let len = 1 << 20;
                let host = vec![(rank + 1) as f32; len];
                let mut back = vec![0f32; len];
                // SAFETY: allocations of `len` f32 on this rank's device, freed below.
                unsafe {
                    let dev = cu::malloc_sync(len * 4).unwrap();
                    cu::memcpy_htod_async(dev, &host, comm.stream()).unwrap();
                    comm.all_reduce_device(dev, dev, len, DType::F32, ReduceOp::Sum, comm.stream())
                        .unwrap();
                    cu::memcpy_dtoh_async(&mut back, dev, comm.stream()).unwrap();
                    comm.wait_own(Instant::now() + Duration::from_secs(60))
                        .unwrap();
                    cu::free_sync(dev).unwrap();
                }
                let want = (n * (n + 1) / 2) as f32;
                assert!(back.iter().all(|&x| x == want), "rank {rank}: {}", back[0]);
            });
        }
    });
}

/// `v` in a fresh device allocation.
fn upload(v: &[f32]) -> u64 {
    use cudarc::driver::result as cu;
    // SAFETY: a fresh allocation of `v.len()` f32, filled synchronously.
    unsafe {
        let dev = cu::malloc_sync(v.len().max(1) * 4).unwrap();
        cu::memcpy_htod_sync(dev, v).unwrap();
        dev
    }
}

fn download(dev: u64, len: usize) -> Vec<f32> {
    use cudarc::driver::result as cu;
    let mut v = vec![0f32; len];
    // SAFETY: `dev` holds `len` f32 written by a finished call.
    unsafe { cu::memcpy_dtoh_sync(&mut v, dev).unwrap() };
    v
}

fn buf(ptr: u64, len: usize) -> bonfire_comm::DeviceBuf {
    bonfire_comm::DeviceBuf::new(ptr, len, DType::F32)
}

fn err(e: bonfire_comm::CommError) -> String {
    e.to_string()
}

/// Device and host send/recv between ring neighbours (even ranks send first: NCCL's sends
/// are rendezvous).
fn neighbours(pg: &ProcessGroup) -> Result<(), String> {
    let (n, me) = (pg.size(), pg.rank());

    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let out = upload(&[me as f32; 64]);
    let inbox = upload(&[0.0; 64]);
    // SAFETY: `out` is a device allocation of 64 f32 (`upload`), live for the test; the peer
    // receives 64.
    let send = || unsafe { pg.device_send(buf(out, 64), next, 7) };
    // SAFETY: `inbox` is a device allocation of 64 f32, live for the test; the peer sends 64.
    let recv = || unsafe { pg.device_recv(buf(inbox, 64), prev, 7) };
    if me % 2 == 0 {
        send().and_then(|_| recv())
    } else {
        recv().and_then(|_| send())
    }
    .map_err(err)?;
    if download(inbox, 64).iter().any(|&x| x != prev as f32) {
        return Err("device send/recv".into());
    }
    let mut host = vec![0f64; 8];
    let send = || pg.send(&[me as f64; 8], next, 3);
    if me % 2 == 0 {
        send().and_then(|_| pg.recv(&mut host, prev, 3))
    } else {
        pg.recv(&mut host, prev, 3).and_then(|_| send())
    }
    .map_err(err)?;
    if host.iter().any(|&x| x != prev as f64) {
        return Err("host send/recv over NCCL".into());
    }
    Ok(())
}

/// One rank's checks of the device-buffer API of a [`ProcessGroup`] over NCCL: all-reduce,
/// broadcast, uneven all-gather and reduce-scatter on device memory, and device and host
/// send/recv between neighbours (even ranks send first: NCCL's sends are rendezvous).
fn device_buffers(pg: &ProcessGroup) -> Result<(), String> {
    use bonfire_comm::DeviceCollective;
    let (n, me) = (pg.size(), pg.rank());
    // All-reduce (out of place) and broadcast.
    let (a, b) = (upload(&vec![(me + 1) as f32; 1000]), upload(&[0.0; 1000]));
    // SAFETY: (every call below) buffers allocated above with the stated lengths.
    unsafe {
        let call = DeviceCollective::AllReduce {
            send: buf(a, 1000),
            recv: buf(b, 1000),
            op: ReduceOp::Sum,
        };
        pg.device_collective(call).map_err(err)?;
    }
    let want = (n * (n + 1) / 2) as f32;
    if download(b, 1000).iter().any(|&x| x != want) {
        return Err("device all-reduce".into());
    }
    // SAFETY: `a` and `b` are device allocations of 1000 f32 each, live for the test.
    unsafe {
        let call = DeviceCollective::Broadcast {
            send: buf(a, 1000),
            recv: buf(b, 1000),
            root: n - 1,
        };
        pg.device_collective(call).map_err(err)?;
    }
    if download(b, 1000).iter().any(|&x| x != n as f32) {
        return Err("device broadcast".into());
    }
    // Uneven all-gather: rank r contributes r + 1 values of r.
    let counts: Vec<usize> = (1..=n).collect();
    let total: usize = counts.iter().sum();
    let (piece, all) = (upload(&vec![me as f32; me + 1]), upload(&vec![0.0; total]));
    // SAFETY: `piece` holds `me + 1` f32 and `all` the sum of `counts`, as uploaded above.
    unsafe {
        let call = DeviceCollective::AllGather {
            send: buf(piece, me + 1),
            recv: buf(all, total),
            counts: Some(&counts),
        };
        pg.device_collective(call).map_err(err)?;
    }
    let want: Vec<f32> = (0..n).flat_map(|r| vec![r as f32; r + 1]).collect();
    if download(all, total) != want {
        return Err("device uneven all-gather".into());
    }
    // Reduce-scatter of the gathered vector back: every rank's piece times n.
    // SAFETY: `all` holds the sum of `counts` f32 and `piece` this rank's `me + 1`, as uploaded
    // above.
    unsafe {
        let call = DeviceCollective::ReduceScatter {
            send: buf(all, total),
            recv: buf(piece, me + 1),
            op: ReduceOp::Sum,
            counts: Some(&counts),
        };
        pg.device_collective(call).map_err(err)?;
    }
    if download(piece, me + 1)
        .iter()
        .any(|&x| x != (me * n) as f32)
    {
        return Err("device uneven reduce-scatter".into());
    }
    if n > 1 {
        neighbours(pg)?;
    }
    Ok(())
}

#[test]
#[ignore = "needs NVIDIA GPUs: cargo xtask test-multi-gpu"]
fn gpu_device_buffers_through_the_process_group() {
    let n = gpus();
    let id = UniqueId::new().unwrap();
    std::thread::scope(|s| {
        for rank in 0..n {
            s.spawn(move || {
                let comm = NcclComm::init(&id, rank, n, rank).unwrap();
                let pg = comm.into_group("gpu-device");
                pg.set_timeout(Duration::from_secs(60));
                assert!(pg.takes_device_buffers());
                device_buffers(&pg).unwrap_or_else(|e| panic!("GPU rank {rank}: {e}"));
            });
        }
    });
}
