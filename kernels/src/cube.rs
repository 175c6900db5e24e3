//! Between Burn tensors and CubeCL launches: a tensor's `CubeTensor` (its client, its device
//! buffer), empty outputs on the same device, and the launch grid of an element-wise kernel.

use burn::backend::{Cube, DispatchDevice};
use burn::tensor::{DType, Device, Shape, Tensor};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Whether `device` is a CubeCL device (wgpu, CUDA …), autodiff or not.
pub fn is_cube(device: &Device) -> bool {
    matches!(crate::device::base_device(device), DispatchDevice::Cube(_))
}

/// `tensor` (on a CubeCL device; autodiff is dropped) as a contiguous `CubeTensor`.
pub fn to_cube<const D: usize>(tensor: Tensor<D>) -> CubeTensor {
    let primitive = tensor
        .inner()
        .try_into_primitive::<Cube>()
        .expect("a tensor on a CubeCL device");
    into_contiguous(primitive)
}

/// The Burn tensor of a `CubeTensor`.
pub fn from_cube<const D: usize>(tensor: CubeTensor) -> Tensor<D> {
    Tensor::from_primitive::<Cube>(tensor)
}

/// An uninitialised contiguous tensor of `shape` and `dtype` on `like`'s device.
pub fn empty(like: &CubeTensor, shape: Shape, dtype: DType) -> CubeTensor {
    let handle = like.client.empty(shape.num_elements() * dtype.size());
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        shape,
        handle,
        dtype,
    )
}

/// The cube count and dimension that give one unit per element of `n`.
pub(crate) fn grid(client: &Client, n: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(client, n.max(1));
    (cubecl::calculate_cube_count_elemwise(client, n, dim), dim)
}

/// One cube a row for `rows` rows: the count, the cube, and its units — 256, or the device's
/// most if fewer, rounded down to a power of two (the row kernels' shared-memory trees). The
/// units stride over their row, adjacent units on adjacent elements. (A unit a row, the first
/// version, left a GPU nearly idle: 4,096 rows — the 1 B Llama's 2 × 2,048 tokens — are 4,096
/// units of a device that runs some 270 thousand, and a warp's loads fell in 32 rows at once.)
pub(crate) fn row_grid(client: &Client, rows: usize) -> (CubeCount, CubeDim, usize) {
    let most = client.properties().hardware.max_units_per_cube.max(1) as usize;
    let units = 1usize << 256usize.min(most).ilog2();
    let dim = CubeDim::new_1d(units as u32);
    let count = cubecl::calculate_cube_count_elemwise(client, rows * units, dim);
    (count, dim, units)
}

/// The number of elements of a (contiguous) `CubeTensor`.
pub fn len(tensor: &CubeTensor) -> usize {
    tensor.meta.num_elements()
}

/// Whether the CubeCL `device` stores `dtype` in buffers and converts it (see [`crate::stores`]);
/// asked once per device and type (the models ask at every fused op: [`crate::fuses`]).
pub(crate) fn stores(device: &Device, dtype: DType) -> bool {
    use std::sync::Mutex;
    static KNOWN: Mutex<Vec<(Device, DType, bool)>> = Mutex::new(Vec::new());
    let known = |list: &[(Device, DType, bool)]| {
        let hit = list.iter().find(|(d, t, _)| d == device && *t == dtype);
        hit.map(|&(_, _, s)| s)
    };
    if let Some(s) = known(&KNOWN.lock().expect("the stores cache")) {
        return s;
    }
    let s = client_stores(&to_cube(Tensor::<1>::zeros([1], device)).client, dtype);
    KNOWN
        .lock()
        .expect("the stores cache")
        .push((device.clone(), dtype, s));
    s
}

/// [`stores`] for the device of `t` (asked through its own client: nothing allocated).
pub(crate) fn stores_like(t: &Tensor<1>, dtype: DType) -> bool {
    client_stores(&to_cube(t.clone()).client, dtype)
}

fn client_stores(client: &Client, dtype: DType) -> bool {
    use cubecl::ir::features::TypeUsage;
    use half::{bf16, f16};
    let uses = match dtype {
        DType::BF16 => bf16::supported_uses(client),
        DType::F16 => f16::supported_uses(client),
        DType::F32 => f32::supported_uses(client),
        DType::F64 => f64::supported_uses(client),
        _ => return true,
    };
    uses.contains(TypeUsage::Buffer) && uses.contains(TypeUsage::Conversion)
}

/// `t` contiguous and of `dtype` (cast where it is another float type).
pub(crate) fn prepared(t: CubeTensor, dtype: DType) -> CubeTensor {
    use burn::backend::ops::FloatTensorOps;
    let t = match t.dtype == dtype {
        true => t,
        false => <burn::backend::Cube as FloatTensorOps<burn::backend::Cube>>::float_cast(
            t,
            dtype.into(),
        ),
    };
    into_contiguous(t)
}

/// Runs `$body` with `$e` the Rust float type of `$dtype` (f32, f16, bf16; another dtype
/// panics naming it: callers check first).
macro_rules! with_float {
    ($dtype:expr, $e:ident => $body:expr) => {
        match $dtype {
            burn::tensor::DType::F32 => {
                type $e = f32;
                $body
            }
            burn::tensor::DType::F16 => {
                type $e = half::f16;
                $body
            }
            burn::tensor::DType::BF16 => {
                type $e = half::bf16;
                $body
            }
            other => panic!("a CubeCL kernel: no kernel for {other:?}"),
        }
    };
}
pub(crate) use with_float;
