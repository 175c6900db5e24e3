//! [`DdpError`].

use bonfire_comm::CommError;
use bonfire_dtensor::DTensorError;

/// Why a DDP call failed. Every variant is raised on every rank alike (ranks agree before
/// failing), so no rank is left waiting in a collective.
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    /// A collective on the process group failed (timeout, peer failure, mismatch...).
    #[error("bonfire-ddp: communication failed: {0}")]
    Comm(#[from] CommError),
    /// Ranks hold different parameter sets or shapes.
    #[error("bonfire-ddp: ranks disagree on the model's parameters: {0}")]
    ParamMismatch(String),
    /// Parameters got no gradient and [`crate::UnusedParams::Error`] was chosen.
    #[error(
        "bonfire-ddp: these parameters got no gradient on some rank this step: {}; \
         use UnusedParams::Zero to let them contribute zeros",
        .0.join(", ")
    )]
    UnusedParams(Vec<String>),
    /// A parameter's gradient arrived after its bucket had been sent.
    #[error(
        "bonfire-ddp: parameter `{0}` got gradient from outside the layer it was entered \
         with (`bonfire_module::layer`), after its bucket was already reduced; run every \
         module that uses it through `layer`"
    )]
    LateGradient(String),
    /// API misuse (no backward before step, ...).
    #[error("bonfire-ddp: {0}")]
    Usage(String),
}

impl From<DTensorError> for DdpError {
    fn from(e: DTensorError) -> Self {
        match e {
            DTensorError::Comm(e) => DdpError::Comm(e),
            DTensorError::ParamMismatch(m) => DdpError::ParamMismatch(m),
            other => DdpError::Usage(other.to_string()),
        }
    }
}
