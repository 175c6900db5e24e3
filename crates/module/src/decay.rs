//! [`DecaySplit`]: decoupled weight decay on the parameters of two or more dimensions only —
//! PyTorch's AdamW with two parameter groups (`weight_decay` on the matrices, none on norm
//! weights, biases and other 1-d tensors).
//!
//! Burn's optimizers choose per parameter tensor (`ModuleOptimizer::with_group`), but a
//! data-parallel wrapper that steps a flat range of many parameters at once (ZeRO) hands
//! Burn one tensor. So the split is applied by the wrapper: Burn's optimizer is built with no
//! decay of its own and, right before its step, the wrapper multiplies the decayed elements
//! by `1 − lr·rate` — the very operation Burn's AdamW performs first (`p·(1 − lr·wd)`, then
//! the Adam update, which does not read `p`), so the result is the same to the bit. DDP and
//! ZeRO apply the same [`DecaySplit`], so every layout decays the same elements.

use crate::params::{ParamInfo, index_of};
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::Tensor;
use std::collections::HashMap;
use std::ops::Range;

/// Weight decay at `rate` on the parameters of two or more dimensions only (see the module
/// docs); the optimizer it goes with decays nothing itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecaySplit {
    /// The decay rate (AdamW's `weight_decay`, an `f32` as Burn's config holds it).
    pub rate: f32,
}

impl DecaySplit {
    /// Whether a parameter of `shape` decays: two or more dimensions.
    pub fn decays(shape: &[usize]) -> bool {
        shape.len() >= 2
    }

    /// What a decayed element is multiplied by at learning rate `lr` (Burn's AdamW's
    /// `1 − lr·wd`, computed as it computes it).
    pub fn factor(self, lr: f64) -> f64 {
        1.0 - lr * (self.rate as f64)
    }

    /// The element ranges of a flat vector laid out as `infos` (in order) that decay,
    /// restricted to `window` and made relative to its start; consecutive ranges merged.
    pub fn flat_ranges(infos: &[ParamInfo], window: Range<usize>) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::new();
        let mut at = 0;
        for info in infos {
            let (start, end) = (at, at + info.numel());
            at = end;
            let (a, b) = (start.max(window.start), end.min(window.end));
            if a >= b || !Self::decays(&info.shape) {
                continue;
            }
            let r = a - window.start..b - window.start;
            match out.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => out.push(r),
            }
        }
        out
    }

    /// `values` (a flat range) with the elements of `decayed` (sorted, disjoint ranges of it)
    /// multiplied by [`factor`](Self::factor). On the device: slices and one concatenation.
    pub fn apply_flat(self, lr: f64, values: Tensor<1>, decayed: &[Range<usize>]) -> Tensor<1> {
        let n = values.dims()[0];
        let f = self.factor(lr);
        match decayed {
            [] => values,
            [only] if only.start == 0 && only.end == n => values.mul_scalar(f),
            _ => {
                let mut parts = Vec::with_capacity(2 * decayed.len() + 1);
                let mut at = 0;
                for r in decayed {
                    if r.start > at {
                        parts.push(values.clone().narrow(0, at, r.start - at));
                    }
                    parts.push(values.clone().narrow(0, r.start, r.len()).mul_scalar(f));
                    at = r.end;
                }
                if at < n {
                    parts.push(values.narrow(0, at, n - at));
                }
                Tensor::cat(parts, 0)
            }
        }
    }

    /// `module` with every parameter of `infos` that decays multiplied by
    /// [`factor`](Self::factor) (same id, same `require_grad`).
    pub fn apply_module<M: Module>(self, lr: f64, module: M, infos: &[ParamInfo]) -> M {
        struct Decay<'a> {
            index: HashMap<ParamId, usize>,
            infos: &'a [ParamInfo],
            factor: f64,
        }
        impl ModuleMapper for Decay<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                match self.index.get(&param.id) {
                    Some(&i) if DecaySplit::decays(&self.infos[i].shape) => {
                        let (id, old, mapper) = param.consume();
                        let require_grad = old.is_require_grad();
                        // A fresh leaf, as the optimizer's own update is.
                        let mut new = Tensor::from_inner(old.inner().mul_scalar(self.factor));
                        if require_grad {
                            new = new.require_grad();
                        }
                        Param::from_mapped_value(id, new, mapper)
                    }
                    _ => param,
                }
            }
        }
        module.map(&mut Decay {
            index: index_of(infos),
            infos,
            factor: self.factor(lr),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    fn info(shape: &[usize]) -> ParamInfo {
        ParamInfo {
            id: ParamId::new(),
            path: String::new(),
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn ranges_keep_only_matrices_within_the_window() {
        // [2×2 matrix][3 bias][1×2 matrix][2 norm] = offsets 0, 4, 7, 9, 11.
        let infos = [info(&[2, 2]), info(&[3]), info(&[1, 2]), info(&[2])];
        assert_eq!(DecaySplit::flat_ranges(&infos, 0..11), vec![0..4, 7..9]);
        assert_eq!(DecaySplit::flat_ranges(&infos, 3..8), vec![0..1, 4..5]);
        assert_eq!(
            DecaySplit::flat_ranges(&infos, 4..7),
            Vec::<Range<usize>>::new()
        );
        let merged = [info(&[1, 2]), info(&[2, 1]), info(&[1])];
        assert_eq!(DecaySplit::flat_ranges(&merged, 0..5), vec![0..4]);
    }

    #[test]
    fn only_the_decayed_elements_are_scaled() {
        let device = Device::flex();
        let values = Tensor::<1>::from_data(TensorData::from([1.0f32; 6]), &device);
        let split = DecaySplit { rate: 0.5 };
        let out = split.apply_flat(0.2, values, &[1..3, 5..6]);
        let got = out.into_data().try_into_vec::<f32>().unwrap();
        assert_eq!(got, vec![1.0, 0.9, 0.9, 1.0, 1.0, 0.9]);
    }
}
