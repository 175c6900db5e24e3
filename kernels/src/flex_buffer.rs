//! [`owned`]: a Flex f32 tensor's own buffer, for what writes in place — the host kernels
//! (`fused::host`) and the products that add into their destination (`matmul`).

use burn::backend::tensor::FloatTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::DType;

/// `t`'s own buffer, when it is contiguous from the buffer's start, not shared and f32.
pub(crate) fn owned(t: &mut FloatTensor<Flex>) -> Option<&mut [f32]> {
    let n = t.shape().num_elements();
    if t.dtype() != DType::F32 || t.layout().contiguous_offsets() != Some((0, n)) {
        return None;
    }
    t.try_storage_mut::<f32>().filter(|s| s.len() == n)
}
