//! [`AnchorBackend::anchored`]: an identity whose node sits in the autodiff graph right below
//! another tensor, so that its backward — and the backward of everything it feeds — runs as
//! soon as that tensor's consumers are done.
//!
//! Why: Burn runs backward deepest node first. A communication op fed only by parameters
//! (a ZeRO-3 all-gather of a shard) is shallow, so its backward (the reduce-scatter of the
//! gradient) would wait until the very end of backward, with every layer's full gradient held
//! until then. Anchoring the gather's input at the layer's input activation places the
//! reduce-scatter right after that layer's backward. The anchor only positions the node: no
//! gradient flows to it.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension};
use burn::tensor::{DispatchTensor, Tensor};
use std::marker::PhantomData;

/// Burn backends that can place a node below an anchor (`Flex`, `Autodiff<B>`, and `Cube`
/// with the `cuda` feature).
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait AnchorBackend: Backend {
    /// Returns `tensor` unchanged; in backward its gradient passes through, after the
    /// consumers of `anchor` (which gets no gradient from it).
    fn anchored(tensor: FloatTensor<Self>, anchor: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl AnchorBackend for Flex {
    fn anchored(tensor: FloatTensor<Self>, _anchor: FloatTensor<Self>) -> FloatTensor<Self> {
        tensor
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl AnchorBackend for burn::backend::Cube {
    fn anchored(tensor: FloatTensor<Self>, _anchor: FloatTensor<Self>) -> FloatTensor<Self> {
        tensor
    }
}

#[derive(Debug)]
struct AnchoredBackward;

impl<B: Backend> Backward<B, 2> for AnchoredBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [tensor, _anchor] = ops.parents;
        if let Some(node) = tensor {
            grads.register::<B>(node.id, grad);
        }
    }
}

/// Recomputes the identity in backward (Balanced checkpointing) so that nothing is stored
/// for it: a recomputation downstream (a ZeRO-3 re-gather) goes on to the tensor's own
/// inputs.
struct RetroAnchored<B> {
    tensor_id: NodeId,
    anchor_id: NodeId,
    _backend: PhantomData<fn() -> B>,
}

impl<B> std::fmt::Debug for RetroAnchored<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetroAnchored")
            .field("tensor_id", &self.tensor_id)
            .field("anchor_id", &self.anchor_id)
            .finish()
    }
}

impl<B: Backend> RetroForward for RetroAnchored<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let value = states.get_state::<FloatTensor<B>>(&self.tensor_id);
        // The checkpointer counts this node among the anchor's users (it is a parent in the
        // graph): take its state once so that it is released on time.
        drop(states.get_state::<FloatTensor<B>>(&self.anchor_id));
        states.save(out_node, value)
    }
}

impl<B: AnchorBackend, C: CheckpointStrategy> AnchorBackend for Autodiff<B, C> {
    fn anchored(tensor: FloatTensor<Self>, anchor: FloatTensor<Self>) -> FloatTensor<Self> {
        let retro = RetroAnchored::<B> {
            tensor_id: tensor.id(),
            anchor_id: anchor.id(),
            _backend: PhantomData,
        };
        let prep = AnchoredBackward
            .prepare::<C>([tensor.node(), anchor.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&tensor, &anchor]);
        drop(anchor);
        prep.stateless(tensor.into_primitive())
    }
}

/// `tensor`, placed in the autodiff graph right below `anchor` (see the module docs): its
/// backward, and that of the operations it feeds, runs as soon as `anchor`'s consumers are
/// done. Identity in value; no gradient reaches `anchor` through it.
pub fn anchored<const D: usize>(tensor: Tensor<D>, anchor: &DispatchTensor) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as AnchorBackend>::anchored(
        tensor.into_dispatch(),
        anchor.clone(),
    ))
}
