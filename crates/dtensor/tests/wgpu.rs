//! The data plane on a device that is not host memory (Burn's wgpu backend; on a machine
//! without a GPU, Mesa's software Vulkan): every collective returns a tensor on the same
//! wgpu device with the right values, and the ledger counts exactly one staged copy down and
//! one up of what each collective carries, and moves to another device by their reason.
//! (Tensor parallelism's differentiable collectives on wgpu: `examples/tests/wgpu.rs`.) Run
//! with `--features wgpu` (`cargo xtask test` does).

#![cfg(feature = "wgpu")]

mod common;
use bonfire_comm::ReduceOp;
use bonfire_dtensor::plane::{self, TransferLedger, ledger::Direction, ledger::Reason};
use burn::tensor::{DType, Device, DeviceKind, Tensor};
use common::world;

fn wgpu() -> Device {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // SAFETY: set before any thread of this test binary reads the environment.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
    Device::wgpu(DeviceKind::Cpu)
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

#[test]
fn every_collective_returns_a_wgpu_tensor_and_stages_once() {
    let out = world(2, |pg| {
        let device = wgpu();
        let r = pg.rank() as f32;
        let ledger = TransferLedger::start();
        let x = Tensor::<1>::from_floats([r, r + 1.0, r + 2.0, r + 3.0], &device);
        let sum = plane::all_reduce(x.clone(), ReduceOp::Sum, &pg).unwrap();
        let after_reduce = ledger.snapshot();
        let avg = plane::all_reduce_async(x.clone(), ReduceOp::Avg, &pg)
            .wait()
            .unwrap();
        let from_1 = plane::broadcast(x.clone(), 1, &pg).unwrap();
        let mine = plane::reduce_scatter(x, &[1, 3], ReduceOp::Sum, &pg)
            .unwrap()
            .unwrap();
        let whole =
            plane::all_gather(Some(mine.clone()), &[1, 3], DType::F32, &pg, &device).unwrap();
        if pg.rank() == 0 {
            plane::send(sum.clone(), 1, 3, &pg).unwrap();
        } else {
            let got: Tensor<1> = plane::recv([4], DType::F32, 0, 3, &pg, &device).unwrap();
            assert_eq!(values(got), vec![1.0, 3.0, 5.0, 7.0]);
        }
        let devices_ok = [&sum, &avg, &from_1, &mine, &whole]
            .iter()
            .all(|t| t.device() == device && !plane::is_host(&t.device()));
        (
            devices_ok,
            values(sum),
            values(avg),
            values(from_1),
            values(mine),
            values(whole),
            after_reduce,
        )
    });
    for (rank, (ok, sum, avg, from_1, mine, whole, t)) in out.into_iter().enumerate() {
        assert!(ok, "rank {rank}: results stay on the wgpu device");
        assert_eq!(sum, vec![1.0, 3.0, 5.0, 7.0]);
        assert_eq!(avg, vec![0.5, 1.5, 2.5, 3.5]);
        assert_eq!(from_1, vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(whole, vec![1.0, 3.0, 5.0, 7.0]);
        assert_eq!(
            mine,
            if rank == 0 {
                vec![1.0]
            } else {
                vec![3.0, 5.0, 7.0]
            }
        );
        // One all-reduce of 16 bytes: staged down once and up once, carried once.
        assert_eq!(t.of(Direction::DeviceToHost, Reason::Collective), 16);
        assert_eq!(t.of(Direction::HostToDevice, Reason::Collective), 16);
        assert_eq!(t.payload, 16);
    }
}

#[test]
fn moving_to_the_host_and_back_is_counted_by_reason() {
    let device = wgpu();
    let ledger = TransferLedger::start();
    let x = Tensor::<2>::ones([8, 16], &device);
    let on_cpu = plane::to_device(x, &Device::flex(), Reason::Offload);
    let back = plane::to_device(on_cpu.clone(), &device, Reason::Offload);
    let t = ledger.snapshot();
    assert!(plane::is_host(&on_cpu.device()));
    assert_eq!(back.device(), device);
    assert_eq!(t.of(Direction::DeviceToHost, Reason::Offload), 8 * 16 * 4);
    assert_eq!(t.of(Direction::HostToDevice, Reason::Offload), 8 * 16 * 4);
    assert_eq!(t.total(Direction::DeviceToHost), 8 * 16 * 4, "nothing else");
}
