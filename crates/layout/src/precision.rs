//! [`MixedPrecision`]: the float formats a layout computes, keeps and reduces in — PyTorch
//! FSDP2's `MixedPrecisionPolicy` (param dtype, reduce dtype) with DeepSpeed's fp32 master
//! weights. Under a half format the model's parameters, activations and gradients are held
//! in it; gradients are cast to the reduce format before they cross ranks; the optimizer
//! steps an fp32 master copy and keeps fp32 state. (Casting Burn tensors is
//! `bonfire_module::precision`'s.)

use std::fmt;

/// A float format a layout can compute or reduce in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FloatFormat {
    /// IEEE single precision.
    F32,
    /// bfloat16 (f32's range, 8 bits of mantissa).
    BF16,
    /// IEEE half precision (use dynamic loss scaling).
    F16,
}

impl FloatFormat {
    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::BF16 | Self::F16 => 2,
        }
    }

    /// `f32`, `bf16` or `f16`.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::BF16 => "bf16",
            Self::F16 => "f16",
        }
    }
}

/// Compute/parameter format and gradient-reduction format. The default is full fp32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MixedPrecision {
    /// What the model's parameters, activations and gradients are held in.
    pub param: FloatFormat,
    /// What gradients are averaged in across ranks: F32 or the param format.
    pub reduce: FloatFormat,
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
            param: FloatFormat::F32,
            reduce: FloatFormat::F32,
        }
    }
    /// bf16 compute, gradients reduced in fp32, fp32 master and optimizer state.
    pub const fn bf16() -> Self {
        Self {
            param: FloatFormat::BF16,
            reduce: FloatFormat::F32,
        }
    }
    /// f16 compute (use dynamic loss scaling), gradients reduced in fp32, fp32 master.
    pub const fn f16() -> Self {
        Self {
            param: FloatFormat::F16,
            reduce: FloatFormat::F32,
        }
    }
    /// The same policy reducing gradients in `format` (F32, or the param format).
    pub const fn with_reduce(mut self, format: FloatFormat) -> Self {
        self.reduce = format;
        self
    }
    /// The same policy reducing gradients in its param format (half-precision reduction).
    pub const fn reduced_in_param(self) -> Self {
        self.with_reduce(self.param)
    }

    /// Whether parameters are held in a half format (so an fp32 master is kept).
    pub fn is_mixed(&self) -> bool {
        self.param != FloatFormat::F32
    }

    /// `f32`, `bf16` or `f16` (the param format, gradients reduced in f32; `fp32` and
    /// `fp16` too), or the param format followed by `/reduce=` and the reduce format — what
    /// `Display` prints (`bf16/reduce=bf16`). Any case.
    pub fn parse(name: &str) -> Option<Self> {
        let name = name.to_ascii_lowercase();
        let format = |n: &str| match n {
            "f32" | "fp32" => Some(FloatFormat::F32),
            "bf16" => Some(FloatFormat::BF16),
            "f16" | "fp16" => Some(FloatFormat::F16),
            _ => None,
        };
        let (param, reduce) = match name.split_once("/reduce=") {
            Some((p, r)) => (format(p)?, format(r)?),
            None => (format(&name)?, FloatFormat::F32),
        };
        Some(Self { param, reduce })
    }

    /// Checks that gradients are reduced in f32 or in the param format.
    pub fn validate(&self) -> Result<(), String> {
        if self.reduce != FloatFormat::F32 && self.reduce != self.param {
            return Err(format!(
                "gradients are reduced in f32 or in the param dtype ({}), not {}",
                self.param.name(),
                self.reduce.name()
            ));
        }
        Ok(())
    }
}

impl fmt::Display for MixedPrecision {
    /// `bf16` (reduce in f32) or `bf16/reduce=bf16`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.param.name())?;
        if self.reduce != FloatFormat::F32 {
            write!(f, "/reduce={}", self.reduce.name())?;
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
            .reduced_in_param()
            .validate()
            .unwrap();
        let bad = MixedPrecision::f16()
            .with_reduce(FloatFormat::BF16)
            .validate();
        assert!(
            bad.unwrap_err()
                .contains("reduced in f32 or in the param dtype")
        );
        assert_eq!(MixedPrecision::bf16().to_string(), "bf16");
        assert_eq!(
            MixedPrecision::bf16().reduced_in_param().to_string(),
            "bf16/reduce=bf16"
        );
        assert_eq!(
            (FloatFormat::BF16.bytes(), FloatFormat::F32.bytes()),
            (2, 4)
        );
    }
}
