//! Stage 3's parameter gathering: a forward module whose parameters are *lazy* (Burn's
//! `Param::uninitialized`): the first use of a parameter all-gathers it from every rank's
//! shard through the differentiable, recomputable all-gather of bonfire-dtensor — so backward
//! re-gathers it (Balanced checkpointing) and sends its gradient back reduce-scattered onto
//! the shard — while the gather of the next parameter (module order) is already running on a
//! helper thread (prefetch).

use crate::params::ParamInfo;
use crate::partition::Partition;
use bonfire_comm::ProcessGroup;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

struct PlanState {
    started: Vec<bool>,
    ready: Vec<Option<Tensor<1>>>,
    inflight: Option<(usize, JoinHandle<Tensor<1>>)>,
}

/// One forward's gathers.
pub(crate) struct GatherPlan {
    pg: ProcessGroup,
    part: Arc<Partition>,
    infos: Arc<Vec<ParamInfo>>,
    shard: Tensor<1>,
    own_start: usize,
    prefetch: bool,
    state: Mutex<PlanState>,
    max: Arc<AtomicUsize>,
    total: Arc<AtomicUsize>,
}

impl GatherPlan {
    pub(crate) fn new(
        pg: ProcessGroup,
        part: Arc<Partition>,
        infos: Arc<Vec<ParamInfo>>,
        shard: Tensor<1>,
        prefetch: bool,
        max: Arc<AtomicUsize>,
        total: Arc<AtomicUsize>,
    ) -> Self {
        let n = infos.len();
        let own_start = part.ranges[pg.rank()].start;
        Self {
            pg,
            part,
            infos,
            shard,
            own_start,
            prefetch,
            state: Mutex::new(PlanState {
                started: vec![false; n],
                ready: vec![None; n],
                inflight: None,
            }),
            max,
            total,
        }
    }

    /// The differentiable gather of parameter `i` (flat, `numel` elements). Burn has no
    /// zero-length tensors, so a rank owning no element of the parameter contributes one
    /// zero (`shard[0] · 0`, which keeps its graph identical to its peers'), cut off after.
    fn gather_op(&self, i: usize) -> impl FnOnce() -> Tensor<1> + Send + 'static {
        let counts = self.part.param_counts(i);
        let rank = self.pg.rank();
        let mine = counts[rank];
        let piece = if mine == 0 {
            self.shard.clone().narrow(0, 0, 1).mul_scalar(0.0)
        } else {
            let start = self.part.offsets[i].max(self.part.ranges[rank].start) - self.own_start;
            // × 1 (exact) so that every rank's graph has the same depth: Burn orders backward
            // by depth, and every rank must run the collectives of backward in the same order.
            self.shard.clone().narrow(0, start, mine).mul_scalar(1.0)
        };
        let before = counts.iter().take_while(|&&c| c == 0).count();
        let padded: Vec<usize> = counts.iter().map(|&c| c.max(1)).collect();
        let numel = self.infos[i].numel();
        let pg = self.pg.clone();
        move || {
            bonfire_dtensor::functional::all_gather_recomputable(piece, &pg, 0, &padded)
                .unwrap_or_else(|e| panic!("bonfire-zero: stage-3 all-gather failed: {e}"))
                .narrow(0, before, numel)
        }
    }

    /// Parameter `i`, gathered (waiting for its prefetch if one runs), and the next one's
    /// gather started.
    pub(crate) fn get(&self, i: usize) -> Tensor<1> {
        let mut st = self.state.lock().unwrap();
        let t = if let Some(t) = st.ready[i].take() {
            t
        } else {
            match st.inflight.take() {
                Some((j, h)) if j == i => h.join().expect("prefetch thread"),
                other => {
                    if let Some((j, h)) = other {
                        st.ready[j] = Some(h.join().expect("prefetch thread"));
                    }
                    st.started[i] = true;
                    (self.gather_op(i))()
                }
            }
        };
        st.started[i] = true;
        let bytes = self.infos[i].numel() * 4;
        self.max.fetch_max(bytes, Ordering::Relaxed);
        self.total.fetch_add(bytes, Ordering::Relaxed);
        if self.prefetch && st.inflight.is_none() {
            let next = (i + 1..self.infos.len()).find(|&k| !st.started[k]);
            if let Some(k) = next {
                st.started[k] = true;
                let op = self.gather_op(k);
                st.inflight = Some((k, std::thread::spawn(op)));
            }
        }
        t
    }

    /// Waits for a prefetch still running and drops what forward did not use.
    pub(crate) fn finish(&self) {
        let mut st = self.state.lock().unwrap();
        if let Some((_, h)) = st.inflight.take() {
            let _ = h.join();
        }
        st.ready.iter_mut().for_each(|r| *r = None);
    }
}

/// `skeleton` (a hollow module) with every parameter gathered lazily through `plan`.
pub(crate) fn lazy_module<M: Module>(skeleton: M, plan: Arc<GatherPlan>) -> M {
    struct Lazy {
        plan: Arc<GatherPlan>,
        index: HashMap<burn::module::ParamId, usize>,
    }
    impl ModuleMapper for Lazy {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(&i) = self.index.get(&param.id) else {
                return param;
            };
            let id = param.id;
            let device = param.lazy_device();
            let shape = param.lazy_shape();
            drop(param);
            let dims: [usize; D] = shape.to_vec().try_into().expect("rank");
            let plan = self.plan.clone();
            Param::uninitialized(
                id,
                move |_, _| plan.get(i).reshape(dims),
                device,
                true,
                shape,
            )
        }
    }
    let index = plan
        .infos
        .iter()
        .enumerate()
        .map(|(i, p)| (p.id, i))
        .collect();
    skeleton.map(&mut Lazy { plan, index })
}
