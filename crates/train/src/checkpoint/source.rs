//! Parameters from whole-tensor weights ([`ParameterSource`]: a Hugging Face directory, say) loaded as resume loads
//! a checkpoint: each rank reads only the slices its layout holds ([`load_parameters`]); the
//! optimizer starts fresh.

use super::{CheckpointError, Loaded, Stateful, agree};
use crate::error::TrainError;
use bonfire_parallel::ParameterSource;

/// What [`load_parameters`] read on this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadedParameters {
    /// Parameter values this rank read.
    pub read: usize,
    /// Parameter values of the whole model.
    pub total: usize,
}

/// Sets `engine`'s parameters from `source`, each rank reading only the slices it holds (its
/// tensor-parallel shards, its ZeRO slices, its pipeline stages); the optimizer state starts
/// fresh. A collective: an error on any rank (a missing tensor, a shape that differs, an
/// unreadable file) is an error on every rank, and no rank's state changes.
pub fn load_parameters(
    engine: &mut (impl Stateful + ?Sized),
    source: &dyn ParameterSource,
) -> Result<LoadedParameters, TrainError> {
    let wants = engine.state_wants();
    let total = wants
        .params
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let read = source.check(&wants.params).and_then(|()| {
        wants
            .values
            .iter()
            .map(|(i, region)| {
                let (name, shape) = &wants.params[*i];
                source.read(name, shape, region)
            })
            .collect::<Result<Vec<_>, String>>()
    });
    let values = agree(engine.world(), read.map_err(CheckpointError::Failed))?;
    let read = values.iter().map(Vec::len).sum();
    engine.load_state(Loaded {
        values,
        state: vec![None; wants.state.len()],
    })?;
    Ok(LoadedParameters { read, total })
}
