//! The simple option, after PyTorch's `DataParallel` primitives: one call runs a batch
//! across in-process ranks and hands back the combined result. Every step re-creates the
//! replicas and funnels all gradients through the calling thread, so it is slower than
//! [`crate::DistributedDataParallel`] (persistent replicas, bucketed all-reduce overlapped
//! with backward) — use it for quick experiments and inference.

use bonfire_dtensor::plane::{self, ledger::Reason};
use bonfire_module::params::{self, ParamInfo};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::kind::Basic;
use burn::tensor::{Device, Tensor};

/// `n` copies of `module`, each with its own autodiff leaves (same [`burn::module::ParamId`]s),
/// so each can run forward and backward on its own thread. Sharing leaves between threads
/// (a plain `clone`) would merge their graphs.
pub fn replicate<M: Module>(module: &M, n: usize, device: &Device) -> Vec<M> {
    (0..n).map(|_| module.clone().fork(device)).collect()
}

/// Splits `tensor` along dimension 0 into `n` chunks whose sizes differ by at most one
/// (the first ones larger), like `torch.chunk` with even spreading.
pub fn scatter<const D: usize, K>(tensor: Tensor<D, K>, n: usize) -> Vec<Tensor<D, K>>
where
    K: Basic,
{
    let rows = tensor.dims()[0];
    assert!(
        n >= 1 && rows >= n,
        "cannot scatter {rows} rows over {n} ranks"
    );
    let mut out = Vec::with_capacity(n);
    let mut at = 0;
    for i in 0..n {
        let len = rows / n + usize::from(i < rows % n);
        out.push(tensor.clone().narrow(0, at, len));
        at += len;
    }
    out
}

/// Runs `f(replica, input)` for every pair on its own thread; results in input order.
pub fn parallel_apply<M, I, R, F>(replicas: Vec<M>, inputs: Vec<I>, f: F) -> Vec<R>
where
    M: Module + Send,
    I: Send,
    R: Send,
    F: Fn(M, I) -> R + Sync,
{
    assert_eq!(replicas.len(), inputs.len(), "one input per replica");
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = replicas
            .into_iter()
            .zip(inputs)
            .map(|(m, i)| s.spawn(move || f(m, i)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a data-parallel worker panicked"))
            .collect()
    })
}

/// Concatenates per-rank outputs along dimension 0.
pub fn gather<const D: usize>(outputs: Vec<Tensor<D>>) -> Tensor<D> {
    Tensor::cat(outputs, 0)
}

/// One call for a training step's gradients: each of `inputs` (with `weights[i]`, its share
/// of the global batch, summing to 1) runs `loss_fn` forward and backward on its own replica
/// and thread; returns the weighted loss and the weighted sum of gradients, registered for
/// `module`'s parameters (ready for its optimizer).
pub fn gradients<M, I, F>(
    module: &M,
    device: &Device,
    inputs: Vec<I>,
    weights: &[f32],
    loss_fn: F,
) -> (f32, GradientsParams)
where
    M: Module + Send,
    I: Send,
    F: Fn(&M, I) -> Tensor<1> + Sync,
{
    assert_eq!(inputs.len(), weights.len(), "one weight per input");
    let infos: Vec<ParamInfo> = params::inventory(module);
    let replicas = replicate(module, inputs.len(), device);
    let infos_ref = &infos;
    let results = parallel_apply(replicas, inputs, |replica, input| {
        let loss = loss_fn(&replica, input);
        let value = plane::to_host(loss.clone().detach(), Reason::Report)[0];
        let mut grads = GradientsParams::from_grads(loss.backward(), &replica);
        (
            value,
            params::take_flat_grads(&replica, infos_ref, &mut grads),
        )
    });
    let mut loss = 0.0;
    let mut sums: Vec<Option<Tensor<1>>> = vec![None; infos.len()];
    for ((value, grads), &w) in results.into_iter().zip(weights) {
        loss += w * value;
        for (sum, g) in sums.iter_mut().zip(grads) {
            if let Some(g) = g {
                let g = g * w;
                *sum = Some(match sum.take() {
                    Some(s) => s + g,
                    None => g,
                });
            }
        }
    }
    (
        loss,
        params::grads_from_parts(module, &infos, |i| sums[i].clone()),
    )
}
