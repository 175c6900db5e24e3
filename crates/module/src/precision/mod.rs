//! Mixed precision on Burn tensors: a layout's [`MixedPrecision`] policy (`bonfire-layout`'s;
//! PyTorch FSDP2's `MixedPrecisionPolicy` with DeepSpeed's fp32 master weights) as Burn
//! dtypes ([`PrecisionDTypes`]), and a module cast to one ([`cast_module`]).
//!
//! Under a half-precision policy the model's parameters are held in `param_dtype` (bf16 or
//! f16): forward and backward run in it and produce gradients in it. Each gradient is cast to
//! `reduce_dtype` before it is all-reduced or reduce-scattered. The optimizer (Burn's own)
//! steps an fp32 master copy of the parameters it owns, and its state stays fp32; the
//! updated master is cast back to `param_dtype`. With ZeRO the master and the state are
//! sharded like the optimizer state (the ZeRO paper's K = 12 bytes per parameter for Adam:
//! master, momentum, variance).
//!
//! [`observe`] records per rank thread what the layers and reductions really ran in.

pub mod observe;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{DType, Tensor};

use bonfire_layout::{FloatFormat, MixedPrecision};

/// Burn's dtype of a layout's float format.
pub fn dtype(format: FloatFormat) -> DType {
    match format {
        FloatFormat::F32 => DType::F32,
        FloatFormat::BF16 => DType::BF16,
        FloatFormat::F16 => DType::F16,
    }
}

/// A [`MixedPrecision`]'s formats as Burn dtypes.
pub trait PrecisionDTypes {
    /// What parameters, activations and gradients are held in.
    fn param_dtype(&self) -> DType;
    /// What gradients are reduced in across ranks.
    fn reduce_dtype(&self) -> DType;
}

impl PrecisionDTypes for MixedPrecision {
    fn param_dtype(&self) -> DType {
        dtype(self.param)
    }
    fn reduce_dtype(&self) -> DType {
        dtype(self.reduce)
    }
}

/// `module` with every trained float parameter cast to `dtype` (same ids; a fresh leaf that
/// requires gradients). A parameter already in `dtype` is kept, and so is state — a
/// parameter without gradient (DeepSeek's balancing bias, which transformers keeps in fp32
/// and the router casts itself): the wrappers keep it whole, in its own dtype, as ZeRO's
/// compute copy (cast from the flat parameters) does.
pub fn cast_module<M: Module>(module: M, dtype: DType) -> M {
    struct Cast(DType);
    impl ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, old, mapper) = param.consume();
            if old.dtype() == self.0 || !old.is_require_grad() {
                return Param::from_mapped_value(id, old, mapper);
            }
            let require_grad = old.is_require_grad();
            let mut new = old.cast(self.0).detach();
            if require_grad {
                new = new.require_grad();
            }
            Param::from_mapped_value(id, new, mapper)
        }
    }
    module.map(&mut Cast(dtype))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Module;
    use burn::tensor::Device;

    #[derive(Module, Debug)]
    struct Two {
        trained: Param<Tensor<2>>,
        state: Param<Tensor<1>>,
    }

    /// A 16-bit compute copy casts what trains and keeps state (a parameter without gradient)
    /// in its dtype, ids unchanged.
    #[test]
    fn a_compute_copy_keeps_state_in_its_dtype() {
        let device = Device::flex().autodiff();
        let m = Two {
            trained: Param::from_tensor(Tensor::ones([2, 3], &device)),
            state: Param::from_tensor(Tensor::ones([3], &device)).set_require_grad(false),
        };
        let ids = (m.trained.id, m.state.id);
        let half = cast_module(m, DType::BF16);
        assert_eq!(half.trained.val().dtype(), DType::BF16);
        assert_eq!(half.state.val().dtype(), DType::F32);
        assert_eq!((half.trained.id, half.state.id), ids);
    }
}
