//! A small MLP, its data and the order of its global batches, shared by the engine tests.
#![allow(dead_code)]
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

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
            y[s * OUT as usize + o] = (0..IN as usize).map(|i| x[s * IN as usize + i].sin() * w[i * OUT as usize + o]).sum();
        }
    }
    (x, y)
}

/// The samples of global batch `step`, in order.
pub fn batch_indices(step: i64) -> Vec<i64> {
    (0..GLOBAL_BATCH).map(|i| (step * 7 + i * 5) % SAMPLES).collect()
}

pub fn init_store() -> (nn::VarStore, nn::Sequential) {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(5);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = mlp(vs.root());
    (vs, model)
}

pub fn params_of(vs: &nn::VarStore) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<_> = vs.variables().into_iter().map(|(n, t)| (n, Vec::<f32>::try_from(t.detach().reshape([-1])).unwrap())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}


/// Mean-squared error of the model on the given rows of the data.
pub fn loss_on(model: &nn::Sequential, x: &Tensor, y: &Tensor, rows: &[i64]) -> Tensor {
    let idx = Tensor::from_slice(rows);
    model.forward(&x.index_select(0, &idx)).to_kind(Kind::Float).mse_loss(&y.index_select(0, &idx), tch::Reduction::Mean)
}
