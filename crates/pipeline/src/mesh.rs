//! Pipeline × data parallelism on a 2-d mesh of ranks.
//!
//! Ranks form a row-major `dp × pp` grid: world rank `d·pp + s` is pipeline rank `s` of
//! data-parallel replica `d`. Each replica runs the pipeline schedule on its row (the `pp`
//! group); afterwards each pipeline rank averages its gradients with the same pipeline rank
//! of the other replicas (its column, the `dp` group), then steps the optimizer.

use crate::runtime::PipelineError;
use bonfire_comm::{ProcessGroup, ReduceOp};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};

/// This rank's groups on a `dp × pp` mesh.
#[derive(Clone, Debug)]
pub struct Mesh2d {
    /// Data-parallel degree.
    pub dp: usize,
    /// Pipeline degree.
    pub pp: usize,
    /// This rank's replica (row).
    pub dp_rank: usize,
    /// This rank's pipeline position (column).
    pub pp_rank: usize,
    /// The row: the ranks of this replica's pipeline, numbered by stage.
    pub pp_group: ProcessGroup,
    /// The column: the ranks holding the same stages in every replica.
    pub dp_group: ProcessGroup,
}

impl Mesh2d {
    /// Builds the groups; every rank of `world` (of size `dp·pp`) must call this.
    pub fn new(world: &ProcessGroup, dp: usize, pp: usize) -> Result<Self, PipelineError> {
        if dp * pp != world.size() || dp == 0 || pp == 0 {
            return Err(PipelineError::Invalid(format!(
                "mesh dp={dp} × pp={pp} does not match {} ranks",
                world.size()
            )));
        }
        let (dp_rank, pp_rank) = (world.rank() / pp, world.rank() % pp);
        let row: Vec<usize> = (0..pp).map(|s| dp_rank * pp + s).collect();
        let column: Vec<usize> = (0..dp).map(|d| d * pp + pp_rank).collect();
        let pp_group = world.new_group(&row)?;
        let dp_group = world.new_group(&column)?;
        Ok(Self {
            dp,
            pp,
            dp_rank,
            pp_rank,
            pp_group,
            dp_group,
        })
    }
}

/// Averages (or sums) the gradients of every float parameter of `module` over `group`, in the
/// module's parameter order (identical on every member). A parameter without a gradient on
/// this rank contributes zeros.
pub fn all_reduce_grads<M: Module>(
    group: &ProcessGroup,
    module: &M,
    grads: GradientsParams,
    op: ReduceOp,
) -> Result<GradientsParams, PipelineError> {
    let mut visitor = Reducer {
        group,
        grads,
        op,
        error: None,
    };
    module.visit(&mut visitor);
    match visitor.error {
        Some(e) => Err(e),
        None => Ok(visitor.grads),
    }
}

struct Reducer<'a> {
    group: &'a ProcessGroup,
    grads: GradientsParams,
    op: ReduceOp,
    error: Option<PipelineError>,
}

impl ModuleVisitor for Reducer<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.error.is_some() {
            return;
        }
        let grad = match self.grads.remove::<D>(param.id) {
            Some(g) => g,
            None => Tensor::zeros(param.val().dims(), &param.val().device()).inner(),
        };
        let (shape, device) = (grad.dims(), grad.device());
        let mut data = match grad.into_data().try_into_vec::<f32>() {
            Ok(d) => d,
            Err(e) => {
                self.error = Some(PipelineError::Invalid(format!(
                    "gradient is not f32: {e:?}"
                )));
                return;
            }
        };
        if let Err(e) = self.group.all_reduce(&mut data, self.op) {
            self.error = Some(e.into());
            return;
        }
        let reduced = Tensor::from_data(TensorData::new(data, shape), &device);
        self.grads.register::<D>(param.id, reduced);
    }
}
