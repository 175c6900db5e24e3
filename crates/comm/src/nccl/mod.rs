//! The NCCL backend (feature `nccl`): GPU collectives through `cudarc`'s NCCL bindings,
//! loaded at run time (`dynamic-loading`), so the crate builds and its CPU-side logic runs
//! on machines with no CUDA at all.
//!
//! - [`probe`] checks that `libcuda.so.1` and `libnccl.so.2` can be loaded (the same names
//!   `cudarc` will try) *before* `cudarc` is touched: `cudarc` panics on a missing library,
//!   Bonfire returns [`CommError::Backend`] with what is missing and how to fix it.
//! - Bootstrap: rank 0 creates an [`UniqueId`] and shares it over an existing
//!   [`ProcessGroup`] (e.g. the MPI world: [`UniqueId::share_over`]) or over a TCP
//!   rendezvous at `MASTER_ADDR:MASTER_PORT` ([`UniqueId::share_tcp`], torchrun-style).
//!   [`NcclComm::from_env`] does the whole thing from the launch environment.
//! - [`NcclComm`] owns one communicator on one device with its own CUDA stream. Its
//!   `*_device` methods take raw device pointers and a caller stream: this is the path from
//!   Burn CUDA tensors to NCCL (no host staging) that `bonfire-dtensor`'s `Cube` backend uses
//!   — see `docs/multi-process.md`.
//! - [`NcclComm::into_group`] wraps it as a [`ProcessGroup`]: host buffers staged through
//!   device scratch (so the conformance suite, mismatch detection and timeouts work exactly
//!   as on the other backends), and device buffers taken as they are
//!   ([`ProcessGroup::device_collective`], `device_send`, `device_recv`), the path of Burn
//!   CUDA tensors through `bonfire-dtensor`'s data plane.
//!
//! Failure semantics: NCCL calls are enqueued on a stream; the host polls the stream and
//! `ncclCommGetAsyncError` against the group's timeout and, on timeout or error, calls
//! `ncclCommAbort` (the communicator cannot be reused) and returns the error.
//!
//! Everything that needs a GPU is compiled in CI (`cargo xtask check-gpu`) and run by
//! `cargo xtask test-multi-gpu` on a GPU machine; the CPU-side parts (probing, id sharing,
//! the TCP rendezvous, argument checks) are tested everywhere.
//!
//! [`ProcessGroup`]: crate::ProcessGroup

mod backend;
mod comm;
mod device;
mod id;
mod ops;
mod own;

pub use backend::NcclBackend;
pub use comm::{DevicePtr, NcclComm, Stream, WaitFailure};
pub use id::UniqueId;

use crate::{CommError, Result};
use cudarc::driver::{result as cu, sys as cusys};
use cudarc::nccl::{result as nccl, sys as nsys};

pub(crate) fn error(message: impl Into<String>) -> CommError {
    CommError::Backend {
        backend: "nccl",
        message: message.into(),
    }
}

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Libraries {
    /// `ncclGetVersion`, e.g. 22304 for 2.23.4.
    pub nccl_version: i32,
    /// Number of CUDA devices visible to this process.
    pub devices: usize,
}

/// Checks that the CUDA driver library and NCCL can be loaded, without letting `cudarc`
/// panic. Call it (or anything in this module, which calls it) before using `cudarc`.
pub fn probe() -> Result<Libraries> {
    // SAFETY: only dlopen()s the candidate names and closes them again.
    let (cuda, nccl_present) = unsafe { (cusys::is_culib_present(), nsys::is_culib_present()) };
    let mut missing = Vec::new();
    if !cuda {
        missing.push(NO_LIBCUDA);
    }
    if !nccl_present {
        missing.push(
            "libnccl.so.2 not found (install NCCL, e.g. `apt install libnccl2`, or add its \
             directory to LD_LIBRARY_PATH)",
        );
    }
    if !missing.is_empty() {
        return Err(error(missing.join("; ")));
    }
    let devices = cuda_devices()?;
    let nccl_version =
        nccl::get_nccl_version().map_err(|e| error(format!("ncclGetVersion: {e:?}")))?;
    Ok(Libraries {
        nccl_version,
        devices,
    })
}

const NO_LIBCUDA: &str = "libcuda.so.1 not found (the NVIDIA driver library: is this a GPU \
                          machine with the driver installed?)";

/// The number of CUDA devices this process sees, checking first that the driver library can
/// be loaded (without letting `cudarc` panic); NCCL is not needed.
pub fn cuda_devices() -> Result<usize> {
    // SAFETY: only dlopen()s the candidate names and closes them again.
    if !unsafe { cusys::is_culib_present() } {
        return Err(error(NO_LIBCUDA));
    }
    cu::init().map_err(|e| error(format!("cuInit failed: {e:?}")))?;
    let devices = cu::device::get_count().map_err(|e| error(format!("cuDeviceGetCount: {e:?}")))?;
    Ok(devices.max(0) as usize)
}

/// Runs `f` on one thread per visible GPU, thread `r` rank `r` of one NCCL group named `name`
/// on GPU `r`, every collective bounded by `timeout`: a single-node GPU job in one process.
/// Returns each rank's result in rank order and the libraries found; a rank that cannot join
/// the group or panics is an error.
pub fn launch_on_every_gpu<R: Send>(
    name: &str,
    timeout: std::time::Duration,
    f: impl Fn(&crate::ProcessGroup) -> R + Sync,
) -> Result<(Libraries, Vec<R>)> {
    let libs = probe()?;
    let n = libs.devices;
    if n == 0 {
        return Err(error("no CUDA device visible"));
    }
    let id = UniqueId::new()?;
    let f = &f;
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                s.spawn(move || -> Result<R> {
                    let pg = NcclComm::init(&id, rank, n, rank)?.into_group(name);
                    pg.set_timeout(timeout);
                    Ok(f(&pg))
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join()
                    .map_err(|_| error(format!("GPU rank {rank} panicked")))?
            })
            .collect::<Result<Vec<R>>>()
    })?;
    Ok((libs, results))
}

#[cfg(test)]
mod tests {
    use super::device::{nccl_dtype, nccl_op};
    use super::*;
    use crate::launch;
    use crate::rendezvous::Rendezvous;
    use crate::{DType, ReduceOp};
    use std::time::Duration;

    #[test]
    fn missing_libraries_are_an_error_not_a_panic() {
        // On a machine without the NVIDIA driver / NCCL (CI), every entry point must say so.
        match probe() {
            Ok(libs) => eprintln!("CUDA + NCCL present here: {libs:?}"),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("not found"), "{msg}");
                assert!(matches!(
                    e,
                    CommError::Backend {
                        backend: "nccl",
                        ..
                    }
                ));
                assert!(UniqueId::new().is_err());
                assert!(NcclComm::init(&UniqueId([0; 128]), 0, 1, 0).is_err());
                let launched = launch_on_every_gpu("none", Duration::from_secs(1), |_| ());
                assert!(launched.unwrap_err().to_string().contains("not found"));
            }
        }
        // The driver alone (what `--device cuda` checks before Burn's CUDA backend starts).
        match cuda_devices() {
            Ok(n) => eprintln!("CUDA driver present here: {n} device(s)"),
            Err(e) => assert!(e.to_string().contains("libcuda.so.1 not found"), "{e}"),
        }
    }

    #[test]
    fn init_checks_arguments_before_touching_cuda() {
        let e = NcclComm::init(&UniqueId([0; 128]), 2, 2, 0).unwrap_err();
        assert!(e.to_string().contains("out of range"), "{e}");
    }

    #[test]
    fn id_is_shared_over_a_process_group_and_failures_reach_every_rank() {
        let want = UniqueId([7; 128]);
        let ids = launch(3, |pg| UniqueId::share_over_with(&pg, || Ok(want))).unwrap();
        assert!(ids.into_iter().all(|id| id.unwrap() == want));
        let errs = launch(3, |pg| {
            UniqueId::share_over_with(&pg, || Err(error("libnccl.so.2 not found")))
        })
        .unwrap();
        for e in errs {
            let msg = e.unwrap_err().to_string();
            assert!(msg.contains("libnccl.so.2 not found"), "{msg}");
        }
    }

    #[test]
    fn id_is_shared_over_tcp_rendezvous() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let want = UniqueId([42; 128]);
        let ids: Vec<Result<UniqueId>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|rank| {
                    s.spawn(move || {
                        let rv = Rendezvous {
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            rank,
                            size: 3,
                            key: 0,
                            timeout: Duration::from_secs(10),
                        };
                        UniqueId::share_tcp_with(&rv, || Ok(want))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(ids.into_iter().all(|id| id.unwrap() == want));
    }

    #[test]
    fn dtype_and_op_mapping() {
        assert_eq!(nccl_dtype(DType::BF16), nsys::ncclDataType_t::ncclBfloat16);
        assert_eq!(nccl_op(ReduceOp::Avg), nsys::ncclRedOp_t::ncclAvg);
    }
}
