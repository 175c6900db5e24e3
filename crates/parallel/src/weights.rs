//! Whole-tensor weights a model loads from outside (a Hugging Face directory, say):
//! [`ParameterSource`], read a [`Region`] at a time, so that each rank reads only the slices
//! its layout holds (the trainer's `load_parameters`).

use crate::region::Region;

/// Whole tensors by name, read a region at a time.
pub trait ParameterSource: Sync {
    /// Checks the source against the model's parameters (`(path, whole shape)`, in model
    /// order) before anything is read: every parameter there with its shape, nothing else.
    fn check(&self, params: &[(String, Vec<usize>)]) -> Result<(), String>;
    /// The values of `region` of tensor `name` (whole shape `shape`), in the region's order.
    fn read(&self, name: &str, shape: &[usize], region: &Region) -> Result<Vec<f32>, String>;
}
