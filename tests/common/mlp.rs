//! A small MLP, its data and the order of its global batches, shared by the engine tests.
#![allow(dead_code)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};
use zerorun::UnitModel;

pub const IN: i64 = 8;
pub const HIDDEN: i64 = 16;
pub const OUT: i64 = 3;
pub const SAMPLES: i64 = 96;
pub const GLOBAL_BATCH: i64 = 12;
pub const STEPS: i64 = 20;
pub const LR: f64 = 0.01;
pub const WD: f64 = 0.05;
pub const CLIP: f64 = 0.5;

pub fn mlp(p: nn::Path) -> nn::Sequential {
    nn::seq()
        .add(nn::linear(&p / "layers" / 0, IN, HIDDEN, Default::default()))
        .add_fn(|x| x.gelu("none"))
        .add(nn::linear(&p / "layers" / 1, HIDDEN, HIDDEN, Default::default()))
        .add_fn(|x| x.gelu("none"))
        .add(nn::linear(&p / "layers" / 2, HIDDEN, OUT, Default::default()))
}

/// Inputs in [-2, 2) from a private generator (tests run in parallel; libtorch's seed is global), targets a
/// fixed smooth function of them.
pub fn data() -> (Vec<f32>, Vec<f32>) {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    };
    let x: Vec<f32> = (0..SAMPLES * IN).map(|_| next()).collect();
    let w: Vec<f32> = (0..IN * OUT).map(|_| next() * 0.5).collect();
    let mut y = vec![0f32; (SAMPLES * OUT) as usize];
    for s in 0..SAMPLES as usize {
        for o in 0..OUT as usize {
            y[s * OUT as usize + o] =
                (0..IN as usize).map(|i| x[s * IN as usize + i].sin() * w[i * OUT as usize + o]).sum();
        }
    }
    (x, y)
}

/// The samples of global batch `step`, in order.
pub fn batch_indices(step: i64) -> Vec<i64> {
    (0..GLOBAL_BATCH).map(|i| (step * 7 + i * 5) % SAMPLES).collect()
}

/// libtorch's default generator is process-wide: whoever seeds and draws from it holds this lock, the one the
/// engine holds when it restores a checkpoint's generator state.
pub fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    zerorun::generator_lock()
}

pub fn init_store() -> (nn::VarStore, nn::Sequential) {
    let _g = rng_lock();
    tch::manual_seed(5);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = mlp(vs.root());
    (vs, model)
}

pub fn params_of(vs: &nn::VarStore) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<_> =
        vs.variables().into_iter().map(|(n, t)| (n, Vec::<f32>::try_from(t.detach().reshape([-1])).unwrap())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Mean-squared error of the model on the given rows of the data.
pub fn loss_on(model: &nn::Sequential, x: &Tensor, y: &Tensor, rows: &[i64]) -> Tensor {
    let idx = Tensor::from_slice(rows);
    model
        .forward(&x.index_select(0, &idx))
        .to_kind(Kind::Float)
        .mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean)
}

/// The same MLP as separate layers with one unit each (stage 3 gathers one layer at a time); the same initial
/// weights as [`init_store`].
pub struct Layers(pub Vec<nn::Linear>);

impl UnitModel for Layers {
    fn unit_prefixes(&self) -> Vec<Vec<String>> {
        (0..self.0.len()).map(|i| vec![format!("layers.{i}")]).collect()
    }

    fn forward_unit(&self, unit: usize, x: &Tensor) -> Tensor {
        let h = self.0[unit].forward(x);
        if unit + 1 < self.0.len() {
            h.gelu("none")
        } else {
            h
        }
    }
}

impl Layers {
    pub fn forward_all(&self, x: &Tensor) -> Tensor {
        (0..self.0.len()).fold(x.shallow_clone(), |h, u| self.forward_unit(u, &h))
    }
}

/// [`init_store`] as [`Layers`], with layer sizes `dims` (default dims: [IN, HIDDEN, HIDDEN, OUT]).
pub fn init_layers(dims: &[i64]) -> (nn::VarStore, Layers) {
    let _g = rng_lock();
    tch::manual_seed(5);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let p = vs.root();
    let layers =
        (0..dims.len() - 1).map(|i| nn::linear(&p / "layers" / i, dims[i], dims[i + 1], Default::default())).collect();
    (vs, Layers(layers))
}

/// A single-process tch loop with libtorch's AdamW on the global batches: what every engine run must match.
pub fn adamw_reference() -> Vec<(String, Vec<f32>)> {
    let (x, y) = data();
    let (x, y) = (Tensor::from_slice(&x).view([SAMPLES, IN]), Tensor::from_slice(&y).view([SAMPLES, OUT]));
    let (vs, model) = init_store();
    let mut opt = nn::AdamW { beta1: 0.9, beta2: 0.999, wd: WD, eps: 1e-8, amsgrad: false }.build(&vs, LR).unwrap();
    for step in 0..STEPS {
        let idx = Tensor::from_slice(&batch_indices(step));
        let loss = model.forward(&x.index_select(0, &idx)).mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean);
        opt.zero_grad();
        loss.backward();
        opt.clip_grad_norm(CLIP);
        opt.step();
    }
    params_of(&vs)
}

/// Runs `rank` on each of `world` thread ranks (threads backend, 60 s timeout) with the MLP's inputs and targets
/// as tensors, and returns what each returned, in rank order.
pub fn on_thread_ranks<R: Send>(
    world: usize,
    rank: impl Fn(zerorun::runtime::comm::threads::ThreadComm, Tensor, Tensor) -> R + Sync,
) -> Vec<R> {
    let (xv, yv) = data();
    let comms = zerorun::runtime::comm::threads::group(world, std::time::Duration::from_secs(60));
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (rank, xv, yv) = (&rank, &xv, &yv);
                // Tensors are not Send: each rank builds its own from the shared values.
                s.spawn(move || {
                    rank(comm, Tensor::from_slice(xv).view([SAMPLES, IN]), Tensor::from_slice(yv).view([SAMPLES, OUT]))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
