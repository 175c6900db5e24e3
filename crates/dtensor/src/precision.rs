//! [`MixedPrecision`]: the dtypes a data-parallel wrapper computes, keeps and reduces in —
//! PyTorch FSDP2's `MixedPrecisionPolicy` (param dtype, reduce dtype) with DeepSpeed's fp32
//! master weights.
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
use std::fmt;

/// Compute/parameter dtype and gradient-reduction dtype. The default is full fp32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixedPrecision {
    /// What the model's parameters, activations and gradients are held in: F32, BF16 or F16.
    pub param_dtype: DType,
    /// What gradients are averaged in across ranks: F32 or the param dtype.
    pub reduce_dtype: DType,
}

impl Default for MixedPrecision {
    fn default() -> Self {
        Self::f32()
    }
}

impl MixedPrecision {
    /// Everything in fp32 (no master copy).
    pub const fn f32() -> Self {
        Self {
            param_dtype: DType::F32,
            reduce_dtype: DType::F32,
        }
    }
    /// bf16 compute, gradients reduced in fp32, fp32 master and optimizer state.
    pub const fn bf16() -> Self {
        Self {
            param_dtype: DType::BF16,
            reduce_dtype: DType::F32,
        }
    }
    /// f16 compute (use dynamic loss scaling), gradients reduced in fp32, fp32 master.
    pub const fn f16() -> Self {
        Self {
            param_dtype: DType::F16,
            reduce_dtype: DType::F32,
        }
    }
    /// The same policy reducing gradients in `dtype` (F32, or the param dtype).
    pub const fn with_reduce_dtype(mut self, dtype: DType) -> Self {
        self.reduce_dtype = dtype;
        self
    }

    /// Whether parameters are held in a half type (so an fp32 master is kept).
    pub fn is_mixed(&self) -> bool {
        self.param_dtype != DType::F32
    }

    /// `f32`, `bf16` or `f16` (the param dtype), as on the command line.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "f32" | "fp32" => Some(Self::f32()),
            "bf16" => Some(Self::bf16()),
            "f16" | "fp16" => Some(Self::f16()),
            _ => None,
        }
    }

    /// Checks the dtypes: param F32/BF16/F16, reduce F32 or the param dtype.
    pub fn validate(&self) -> Result<(), String> {
        if !matches!(self.param_dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(format!(
                "the param dtype must be f32, bf16 or f16, not {:?}",
                self.param_dtype
            ));
        }
        if self.reduce_dtype != DType::F32 && self.reduce_dtype != self.param_dtype {
            return Err(format!(
                "gradients are reduced in f32 or in the param dtype ({:?}), not {:?}",
                self.param_dtype, self.reduce_dtype
            ));
        }
        Ok(())
    }
}

/// `module` with every float parameter cast to `dtype` (same ids; a parameter that required
/// gradients is a fresh leaf that requires them). A parameter already in `dtype` is kept.
pub fn cast_module<M: Module>(module: M, dtype: DType) -> M {
    struct Cast(DType);
    impl ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, old, mapper) = param.consume();
            if old.dtype() == self.0 {
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

/// The short name of a float dtype (`f32`, `bf16`, `f16`).
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F64 => "f64",
        _ => "other",
    }
}

impl fmt::Display for MixedPrecision {
    /// `bf16` (reduce in f32) or `bf16/reduce=bf16`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", dtype_name(self.param_dtype))?;
        if self.reduce_dtype != DType::F32 {
            write!(f, "/reduce={}", dtype_name(self.reduce_dtype))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_validates() {
        assert_eq!(MixedPrecision::parse("bf16"), Some(MixedPrecision::bf16()));
        assert!(MixedPrecision::parse("int8").is_none());
        assert!(MixedPrecision::bf16().is_mixed() && !MixedPrecision::f32().is_mixed());
        MixedPrecision::bf16()
            .with_reduce_dtype(DType::BF16)
            .validate()
            .unwrap();
        let bad = MixedPrecision::f16()
            .with_reduce_dtype(DType::BF16)
            .validate();
        assert!(
            bad.unwrap_err()
                .contains("reduced in f32 or in the param dtype")
        );
        assert_eq!(MixedPrecision::bf16().to_string(), "bf16");
    }
}
