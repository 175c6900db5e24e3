//! The `Autodiff` implementation: each collective records a backward step that runs its dual
//! ([`CollectiveSpec::dual`]) on the gradient, and optionally a retro-forward so that Burn's
//! Balanced checkpointing strategy recomputes the output in backward instead of storing it.

use super::ops::{CollectiveBackend, narrow, scale, zeros_like};
use super::{CollectiveKind, CollectiveSpec};
use bonfire_comm::ReduceOp;
use burn::backend::Autodiff;
use burn::backend::TensorMetadata;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::tensor::Scalar;
use std::marker::PhantomData;

#[derive(Debug)]
struct CollectiveBackward {
    spec: CollectiveSpec,
    input_shape: Vec<usize>,
    /// The input's dtype when the output was cast ([`CollectiveSpec::output_dtype`]).
    input_dtype: Option<burn::tensor::DType>,
}

impl<B: CollectiveBackend> Backward<B, 1> for CollectiveBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let mut grad = grads.consume::<B>(&ops.node);
        if let Some(dtype) = self.input_dtype
            && grad.dtype() != dtype
        {
            grad = B::float_cast(grad, dtype.into());
        }
        // The dual collective runs whether or not the parent wants a gradient: the peers
        // wait for it.
        let input_grad = backward_of::<B>(&self.spec, grad, &self.input_shape);
        let [parent] = ops.parents;
        if let (Some(node), Some(g)) = (parent, input_grad) {
            grads.register::<B>(node.id, g);
        }
    }
}

/// The gradient of the input given the gradient of the output (`None`: no gradient flows).
fn backward_of<B: CollectiveBackend>(
    spec: &CollectiveSpec,
    grad: FloatTensor<B>,
    input_shape: &[usize],
) -> Option<FloatTensor<B>> {
    let (dual, factor) = spec.dual();
    let run = |kind: CollectiveKind, t: FloatTensor<B>| {
        B::collective(t, CollectiveSpec::new(&spec.group, kind))
    };
    match (&spec.kind, dual) {
        // The gradient of a sent tensor arrives from its receiver.
        (CollectiveKind::Send { .. }, Some(recv)) => {
            let template = zeros_like::<B>(&grad, input_shape);
            Some(run(recv, template))
        }
        // A receive sends the gradient back; its template input gets none.
        (CollectiveKind::Recv { .. }, Some(send)) => {
            let _token = run(send, grad);
            None
        }
        // A placeholder's gradient: zeros (its rank's piece of the reduce-scatter is empty).
        (CollectiveKind::AllGather { dim, sizes }, Some(kind))
            if input_shape[*dim] != sizes[spec.group.rank()] =>
        {
            let template = zeros_like::<B>(&grad, input_shape);
            let _empty = run(kind, grad);
            Some(template)
        }
        (CollectiveKind::Pad { dim, offset, .. }, _) => {
            Some(narrow::<B>(grad, *dim, *offset, input_shape[*dim]))
        }
        (_, Some(kind)) => Some(scale::<B>(run(kind, grad), factor)),
        (_, None) => Some(scale::<B>(grad, factor)),
    }
}

/// Re-runs the collective in backward (Balanced checkpointing) from its saved input.
struct RetroCollective<B> {
    input_id: NodeId,
    spec: CollectiveSpec,
    _backend: PhantomData<fn() -> B>,
}

impl<B> std::fmt::Debug for RetroCollective<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetroCollective")
            .field("input_id", &self.input_id)
            .field("spec", &self.spec)
            .finish()
    }
}

impl<B: CollectiveBackend> RetroForward for RetroCollective<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let input = states.get_state::<FloatTensor<B>>(&self.input_id);
        let output = B::collective(input, self.spec.clone());
        states.save(out_node, output)
    }
}

/// All-reduce with `Max` or `Min`: the summed gradient goes to the ranks whose input is the
/// extremum, split evenly between ties (two all-reduces in backward).
#[derive(Debug)]
struct ExtremumBackward {
    spec: CollectiveSpec,
}

impl<B: CollectiveBackend> Backward<B, 1> for ExtremumBackward {
    /// The input and the output of the all-reduce.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (input, output) = ops.state;
        let sum = |t| {
            let kind = CollectiveKind::AllReduce { op: ReduceOp::Sum };
            B::collective(t, CollectiveSpec::new(&self.spec.group, kind))
        };
        let total = sum(grad);
        // 1 where this rank holds the extremum, else 0.
        let differs = B::float_sign(B::float_abs(B::float_sub(input, output)));
        let mask = B::float_add_scalar(B::float_neg(differs), Scalar::Float(1.0));
        let ties = sum(mask.clone());
        let input_grad = B::float_div(B::float_mul(total, mask), ties);
        let [parent] = ops.parents;
        if let Some(node) = parent {
            grads.register::<B>(node.id, input_grad);
        }
    }
}

impl<B: CollectiveBackend, C: CheckpointStrategy> CollectiveBackend for Autodiff<B, C> {
    fn collective(tensor: FloatTensor<Self>, spec: CollectiveSpec) -> FloatTensor<Self> {
        if tensor.is_tracked() && !spec.is_differentiable() {
            panic!(
                "bonfire-dtensor: {:?} has no gradient here (only sum and avg reductions, and \
                 max / min all-reduce, are differentiable); detach the tensor first",
                spec.kind
            );
        }
        if matches!(
            spec.kind,
            CollectiveKind::AllReduce {
                op: ReduceOp::Max | ReduceOp::Min
            }
        ) {
            let step = ExtremumBackward { spec: spec.clone() };
            return match step
                .prepare::<C>([tensor.node()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => {
                    let input = tensor.primitive().clone();
                    let output = B::collective(tensor.into_primitive(), spec);
                    prep.finish((input, output.clone()), output)
                }
                OpsKind::UnTracked(prep) => {
                    prep.finish(B::collective(tensor.into_primitive(), spec))
                }
            };
        }
        let input_shape: Vec<usize> = tensor.primitive().shape().iter().copied().collect();
        let input_dtype = spec.output_dtype.map(|_| tensor.primitive().dtype());
        let step = CollectiveBackward {
            spec: spec.clone(),
            input_shape,
            input_dtype,
        };
        let prep = step.prepare::<C>([tensor.node()]);
        if spec.recompute {
            let retro = RetroCollective::<B> {
                input_id: tensor.id(),
                spec: spec.clone(),
                _backend: PhantomData,
            };
            let prep = prep.memory_bound().retro_forward(retro).parents([&tensor]);
            prep.stateless(B::collective(tensor.into_primitive(), spec))
        } else {
            prep.compute_bound()
                .stateless(B::collective(tensor.into_primitive(), spec))
        }
    }
}
