//! A parameter two pipeline stages use — a tied embedding and head — kept as one parameter
//! (`bonfire_module::tied`): the stage of its first use owns it, and its wrapper reduces,
//! clips, steps and saves it as any other; the later piece holds it as a `Borrowed` module,
//! which no wrapper sees. Each step the owner's rank sends its current values (its tp shard,
//! as the forwards compute with them) to the borrowing stage's rank on the pp axis — the same
//! dp, cp and tp coordinates —, which lends them to its forwards; after the last micro-batch
//! the borrower sends back the sum of its uses' gradients, and the owner adds it to its own
//! gradient through its wrapper (a backward of `Σ table ⊙ g`), before the dp reduction. Where
//! one rank runs both stages (V-shaped schedules) nothing travels. Megatron keeps a copy on
//! each stage and all-reduces their gradients; here there is one copy, one optimizer state,
//! one checkpoint entry — for two transfers of the table's size a step.

use crate::error::TrainError;
use crate::mesh::RankMesh;
use crate::wrapper::DpWrapper;
use bonfire_dtensor::plane;
use bonfire_layout::Axis;
use bonfire_module::DataParallel;
use bonfire_module::params;
use bonfire_module::tied::{self, LendGuard};
use bonfire_pipeline::StageMap;
use burn::module::{Module, ParamId};
use burn::tensor::{DType, Int, Tensor};

/// Point-to-point tags of the tied transfers (values; gradients one above), apart from the
/// schedule's.
const TAG: u64 = 0x7469_6564 << 20;

/// One borrowed parameter as this pipeline runs it.
#[derive(Clone, Debug)]
pub(crate) struct Tie {
    id: ParamId,
    /// Its shape on this rank (a tp shard).
    shape: [usize; 2],
    /// The pp coordinates of the ranks that run the owning and the borrowing piece.
    owner: usize,
    borrower: usize,
    /// Its place among the pipeline's ties (tags).
    index: u64,
}

/// The ties of a pipeline whose pieces are `pieces` (each piece's stage: `stage_of`) and
/// whose borrowed parameters are `borrowed` (`(parameter, borrowing piece)`): the owner is
/// the first piece holding the parameter; the borrower must come after it.
pub(crate) fn ties<P: Module>(
    pieces: &[(String, P)],
    borrowed: &[(ParamId, String)],
    stage_of: impl Fn(usize) -> usize,
    map: StageMap,
) -> Result<Vec<Tie>, TrainError> {
    let mut out = Vec::with_capacity(borrowed.len());
    for (index, (id, name)) in borrowed.iter().enumerate() {
        let owner = pieces.iter().enumerate().find_map(|(i, (_, p))| {
            let info = params::inventory(p).into_iter().find(|x| x.id == *id)?;
            Some((i, info))
        });
        let user = pieces.iter().position(|(n, _)| n == name);
        let (Some((owner, info)), Some(user)) = (owner, user) else {
            return Err(TrainError::Model(format!(
                "pipeline piece `{name}` borrows a parameter no earlier piece holds"
            )));
        };
        let shape: [usize; 2] = info.shape.clone().try_into().map_err(|_| {
            TrainError::Model(format!("borrowed parameter `{}` is not 2-d", info.path))
        })?;
        if user <= owner {
            return Err(TrainError::Model(format!(
                "pipeline piece `{name}` borrows `{}` from a later piece",
                info.path
            )));
        }
        out.push(Tie {
            id: *id,
            shape,
            owner: map.locate(stage_of(owner)).0,
            borrower: map.locate(stage_of(user)).0,
            index: index as u64,
        });
    }
    Ok(out)
}

/// The owner's parameter `id` as its forwards compute with it (gathered under ZeRO-3, the
/// 16-bit copy under mixed precision), on the autodiff graph.
fn owner_value<M: Module>(module: &M, id: ParamId) -> Tensor<2> {
    let param = tied::find(module, id).expect("the owning stage holds the parameter");
    let no_anchor = Tensor::<1, Int>::zeros([1], &param.lazy_device());
    bonfire_module::layer(&param, &no_anchor).val()
}

impl Tie {
    fn tag(&self, grad: bool) -> u64 {
        TAG + 2 * self.index + grad as u64
    }

    /// Before a step's (or an evaluation's) forwards: the owner's current values lent to the
    /// borrowing rank's forwards (`track`: training, their gradients kept). A collective on
    /// the two ranks; `None` on the ranks that borrow nothing.
    pub(crate) fn lend<M: Module>(
        &self,
        wrapper: &mut DpWrapper<M>,
        at: &RankMesh,
        track: bool,
    ) -> Result<Option<LendGuard>, TrainError> {
        let (me, pp) = (at.coord(Axis::Pp), at.group(Axis::Pp));
        let value = if me == self.owner {
            let v = wrapper.evaluate(|m| owner_value(m, self.id).detach());
            if me != self.borrower {
                plane::send(v.cast(DType::F32), self.borrower, self.tag(false), pp)?;
                return Ok(None);
            }
            v
        } else if me == self.borrower {
            plane::recv(
                self.shape,
                DType::F32,
                self.owner,
                self.tag(false),
                pp,
                &at.device,
            )?
        } else {
            return Ok(None);
        };
        Ok(Some(tied::lend(self.id, value, track)))
    }

    /// After a step's last backward, before the dp reduction: the borrower's gradient (its
    /// uses' sum over micro-batches and accumulation parts) added to the owner's. A
    /// collective on the two ranks and, on the owner's, on its wrapper's group.
    pub(crate) fn give_back<M: Module>(
        &self,
        wrapper: &mut DpWrapper<M>,
        at: &RankMesh,
        lent: Option<LendGuard>,
    ) -> Result<(), TrainError> {
        let (me, pp) = (at.coord(Axis::Pp), at.group(Axis::Pp));
        let grad = match lent {
            Some(guard) => {
                let g = tied::take_gradient(self.id)
                    .unwrap_or_else(|| Tensor::zeros(self.shape, &at.device));
                drop(guard);
                if me != self.owner {
                    return Ok(plane::send(
                        g.cast(DType::F32),
                        self.owner,
                        self.tag(true),
                        pp,
                    )?);
                }
                g
            }
            None if me == self.owner => plane::recv(
                self.shape,
                DType::F32,
                self.borrower,
                self.tag(true),
                pp,
                &at.device,
            )?,
            None => return Ok(()),
        };
        let id = self.id;
        let surrogate = wrapper.forward_micro(|m| {
            let table = owner_value(m, id);
            (table.clone() * grad.cast(table.dtype())).sum()
        });
        let mut grads = surrogate.backward();
        wrapper.accumulate(&mut grads)
    }
}
