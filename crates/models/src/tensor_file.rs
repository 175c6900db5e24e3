//! Plain safetensors files of named tensors (the harness's data and result files), read and
//! written with the `safetensors` crate: these hold arbitrary tensors (int64 batches,
//! gradients, losses), not a module, so they bypass burn-store.

use safetensors::tensor::{Dtype, TensorView};
use std::collections::BTreeMap;
use std::path::Path;

/// Named f32 tensors: name → (dims, row-major values).
pub type F32Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// A named tensor's contents on the host.
#[derive(Debug, Clone, PartialEq)]
pub enum HostTensor {
    /// A float32 tensor.
    F32 {
        /// The tensor's dims.
        shape: Vec<usize>,
        /// Row-major values.
        data: Vec<f32>,
    },
    /// An int64 tensor (int32 in the file is widened to this).
    I64 {
        /// The tensor's dims.
        shape: Vec<usize>,
        /// Row-major values.
        data: Vec<i64>,
    },
}

impl HostTensor {
    /// The tensor's dims.
    pub fn shape(&self) -> &[usize] {
        match self {
            HostTensor::F32 { shape, .. } | HostTensor::I64 { shape, .. } => shape,
        }
    }
}

/// Reads every tensor of a safetensors file (f32, i64; i32 is widened to i64).
pub fn read(path: impl AsRef<Path>) -> Result<BTreeMap<String, HostTensor>, String> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("{} is not a safetensors file: {e}", path.display()))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let raw = view.data();
        let t = match view.dtype() {
            Dtype::F32 => HostTensor::F32 {
                shape,
                data: raw
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
            },
            Dtype::I64 => HostTensor::I64 {
                shape,
                data: raw
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
            },
            Dtype::I32 => HostTensor::I64 {
                shape,
                data: raw
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)
                    .collect(),
            },
            other => {
                return Err(format!(
                    "{}: tensor `{name}` has dtype {other:?}; expected F32 or I64",
                    path.display()
                ));
            }
        };
        out.insert(name, t);
    }
    Ok(out)
}

/// Every float tensor of a safetensors file as f32 (f32, bf16 and f16 read exactly), by
/// name; `Err` on a tensor of another dtype.
pub fn read_floats(path: &Path) -> Result<F32Tensors, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("{} is not a safetensors file: {e}", path.display()))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let raw = view.data();
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            Dtype::BF16 => raw
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f32())
                .collect(),
            Dtype::F16 => raw
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32())
                .collect(),
            other => {
                return Err(format!(
                    "{}: tensor `{name}` has dtype {other:?}; expected a float",
                    path.display()
                ));
            }
        };
        out.insert(name, (view.shape().to_vec(), values));
    }
    Ok(out)
}

/// Writes f32 tensors to a safetensors file (creating its folder).
pub fn write_f32(path: impl AsRef<Path>, tensors: &F32Tensors) -> Result<(), String> {
    let path = path.as_ref();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, (shape, data))| {
            let raw = data.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name.clone(), shape.clone(), raw)
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, shape, raw)| {
            TensorView::new(Dtype::F32, shape.clone(), raw)
                .map(|v| (name.clone(), v))
                .map_err(|e| format!("tensor `{name}`: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}
