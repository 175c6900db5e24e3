//! The fused ops' dtype handling: 16-bit inputs computed in f32 and narrowed back.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::DType;

/// `t` in f32 when it is a 16-bit type (softmax runs in f32 under autocast too), else as is.
pub(crate) fn widen<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    match t.dtype() {
        DType::F16 | DType::BF16 => B::float_cast(t, DType::F32.into()),
        _ => t,
    }
}

/// `t` in `dtype` (a no-op when it already is).
pub(crate) fn narrow_to<B: Backend>(t: FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    match t.dtype() == dtype {
        true => t,
        false => B::float_cast(t, dtype.into()),
    }
}
