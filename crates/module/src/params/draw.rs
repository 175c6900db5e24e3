//! A model's random parameters drawn from an explicit generator, so that a seeded model is
//! the same whatever runs beside it.
//!
//! Burn keeps one random generator per process: a model drawn after `device.seed(s)` while
//! another thread of the process draws anything (another test's model, a random input) gets
//! an interleaving of the two streams, not the stream of `s`. Inside [`seeded`] this thread
//! has a generator of its own (SplitMix64, normal values by Box–Muller): every draw of
//! [`normal`] — the initialization of Bonfire's layers (`bonfire-tp`'s) and of the models'
//! own parameters — comes from it, on the host, then goes to the device. Outside [`seeded`],
//! [`normal`] is Burn's `Tensor::random`.

use bonfire_dtensor::plane::ledger::Reason;
use burn::module::Module;
use burn::tensor::{Device, Distribution, Tensor, TensorData};
use std::cell::RefCell;

/// SplitMix64 with a cached second normal value: the explicit generator of [`seeded`].
struct Generator {
    state: u64,
    spare: Option<f64>,
}

impl Generator {
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// A standard normal value (Box–Muller, both values of a pair used).
    fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let (u, v) = (self.unit(), self.unit());
        let r = (-2.0 * u.ln()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * v;
        self.spare = Some(r * theta.sin());
        r * theta.cos()
    }
}

thread_local! {
    static GENERATOR: RefCell<Option<Generator>> = const { RefCell::new(None) };
}

/// A tensor of `shape` drawn from N(`mean`, `std`²): from this thread's generator inside
/// [`seeded`], else from Burn's.
pub fn normal<const D: usize>(
    shape: [usize; D],
    mean: f64,
    std: f64,
    device: &Device,
) -> Tensor<D> {
    let n: usize = shape.iter().product();
    let values = GENERATOR.with(|g| {
        g.borrow_mut().as_mut().map(|g| {
            (0..n)
                .map(|_| (mean + std * g.normal()) as f32)
                .collect::<Vec<f32>>()
        })
    });
    match values {
        Some(v) => {
            bonfire_dtensor::plane::from_data(TensorData::new(v, shape), device, Reason::Init)
        }
        None => Tensor::random(shape, Distribution::Normal(mean, std), device),
    }
}

/// `build`'s model with its random parameters drawn from a generator seeded with `seed`:
/// the same model on every call, whatever other threads of the process draw meanwhile.
/// Bonfire's layers and the models draw through [`normal`] (this thread's generator); a
/// `burn::nn` layer draws from Burn's process-wide generator, seeded with `seed` and held
/// under one lock for the build (its draws are fixed against other `seeded` builds, not
/// against unlocked draws elsewhere). Builds nest: the inner one has its own generator.
pub fn seeded<M: Module>(seed: u64, device: &Device, build: impl FnOnce(&Device) -> M) -> M {
    static BURN_DRAWS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    struct Restore(Option<Generator>);
    impl Drop for Restore {
        fn drop(&mut self) {
            GENERATOR.with(|g| *g.borrow_mut() = self.0.take());
        }
    }
    let _burn = BURN_DRAWS.lock().unwrap_or_else(|e| e.into_inner());
    device.seed(seed);
    let generator = Generator {
        state: seed,
        spare: None,
    };
    let _restore = Restore(GENERATOR.with(|g| g.borrow_mut().replace(generator)));
    let model = build(device);
    // `burn::nn` layers draw lazily, when a parameter is first read: read them all here.
    let infos = super::inventory(&model);
    if !infos.is_empty() {
        super::flatten_values(&model, &infos);
    }
    model
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[derive(Module, Debug)]
    struct Probe {
        w: Vec<Param<Tensor<1>>>,
    }

    /// Eight parameters drawn one after the other under `seeded(seed)`, their values.
    fn draw(seed: u64) -> Vec<f32> {
        let probe = seeded(seed, &Device::flex().autodiff(), |d| Probe {
            w: (0..8)
                .map(|_| Param::from_tensor(normal([4096], 0.0, 1.0, d)))
                .collect(),
        });
        let all = probe.w.iter().map(|p| p.val()).collect();
        Tensor::cat(all, 0).into_data().try_to_vec::<f32>().unwrap()
    }

    #[test]
    fn a_seeded_draw_is_the_same_whatever_draws_beside_it() {
        let alone = draw(7);
        // Another thread draws from Burn's generator all along.
        let (started, stop) = (AtomicBool::new(false), AtomicBool::new(false));
        std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let _ = Tensor::<1>::random([64], Distribution::Default, &Device::flex());
                    started.store(true, Ordering::Relaxed);
                }
            });
            // Stops the other thread however this one leaves (a failed assertion included).
            struct Stop<'a>(&'a AtomicBool);
            impl Drop for Stop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Relaxed);
                }
            }
            let _stop = Stop(&stop);
            while !started.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
            for _ in 0..20 {
                assert_eq!(draw(7), alone);
            }
        });
        let n = alone.len() as f32;
        let mean = alone.iter().sum::<f32>() / n;
        let var = alone.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / n;
        assert!(
            mean.abs() < 0.05 && (0.95..1.05).contains(&var),
            "{mean} {var}"
        );
        assert_ne!(draw(8), alone);
    }
}
