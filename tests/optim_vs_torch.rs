//! zerorun-optim against libtorch: AdamW, Adam (L2) and SGD against tch's C++ optimizers; Adagrad against
//! torch.optim.Adagrad's formula and Lion / Lamb against DeepSpeed's, written with libtorch fp32 tensor ops.
//! 120 steps on random data; max relative error <= 1e-6 (max |a - b| / max |b|).
use half::bf16;
use tch::nn::{self, OptimizerConfig};
use tch::{Kind, Tensor};
use zerorun::optim::*;

const N: usize = 50_000; // several tiles
const STEPS: usize = 120;

/// Uniform in [-scale, scale), from a private generator (tests run in parallel; libtorch's seed is global).
fn random(seed: i64, scale: f64) -> Vec<f32> {
    let mut s = (seed as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..N)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0) as f32 * scale as f32
        })
        .collect()
}

fn grads(step: usize) -> Vec<f32> {
    random(1000 + step as i64, 0.1)
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let d = a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max);
    d / b.iter().map(|y| y.abs() as f64).fold(1e-12, f64::max)
}

/// Steps one of tch's C++ optimizers with the given gradients (loss = sum(p * g) makes p.grad = g).
fn torch_cpp(build: impl FnOnce(&nn::VarStore) -> nn::Optimizer) -> Vec<f32> {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let p = vs.root().var_copy("p", &Tensor::from_slice(&random(1, 1.0)));
    let mut opt = build(&vs);
    for s in 0..STEPS {
        let g = Tensor::from_slice(&grads(s));
        let loss = (&p * &g).sum(Kind::Float);
        opt.zero_grad();
        loss.backward();
        opt.step();
    }
    Vec::try_from(p.detach()).unwrap()
}

fn zerorun_run(mut opt: impl Optimizer, lr: f64, wd: f64) -> Vec<f32> {
    let mut p = random(1, 1.0);
    let groups = Group::whole(N, lr, wd);
    for s in 0..STEPS {
        opt.step(&mut p, Grads::F32(&grads(s)), &groups, None).unwrap();
    }
    p
}

#[test]
fn adamw_matches_libtorch() {
    for amsgrad in [false, true] {
        let t =
            torch_cpp(|vs| nn::AdamW { beta1: 0.9, beta2: 0.95, wd: 0.1, eps: 1e-8, amsgrad }.build(vs, 1e-3).unwrap());
        let z = zerorun_run(Adam::new(AdamConfig { betas: (0.9, 0.95), amsgrad, ..Default::default() }, N), 1e-3, 0.1);
        let e = rel(&z, &t);
        assert!(e <= 1e-6, "AdamW (amsgrad {amsgrad}): {e:e}");
    }
}

#[test]
fn adam_with_l2_matches_libtorch() {
    let t = torch_cpp(|vs| {
        nn::Adam { beta1: 0.9, beta2: 0.999, wd: 0.01, eps: 1e-8, amsgrad: false }.build(vs, 2e-3).unwrap()
    });
    let z = zerorun_run(Adam::new(AdamConfig { adam_w_mode: false, ..Default::default() }, N), 2e-3, 0.01);
    let e = rel(&z, &t);
    assert!(e <= 1e-6, "Adam with L2: {e:e}");
}

#[test]
fn sgd_matches_libtorch() {
    for (momentum, dampening, nesterov) in [(0.0, 0.0, false), (0.9, 0.1, false), (0.9, 0.0, true)] {
        let t = torch_cpp(|vs| nn::Sgd { momentum, dampening, wd: 1e-3, nesterov }.build(vs, 0.05).unwrap());
        let c = SgdConfig { momentum, dampening, nesterov };
        let z = zerorun_run(Sgd::new(c, N), 0.05, 1e-3);
        let e = rel(&z, &t);
        assert!(e <= 1e-6, "SGD momentum {momentum} dampening {dampening} nesterov {nesterov}: {e:e}");
    }
}

/// References compute in fp32 like the kernels (and DeepSpeed's CPU ops): an f64 reference would measure fp32's
/// own rounding over 120 steps, not the implementation.
fn f32t(v: &[f32]) -> Tensor {
    Tensor::from_slice(v)
}

fn back(t: &Tensor) -> Vec<f32> {
    Vec::try_from(t.to_kind(Kind::Float)).unwrap()
}

#[test]
fn adagrad_matches_torch_formula() {
    let (lr, wd, lr_decay, init, eps) = (0.05, 0.01, 0.001, 0.1, 1e-10);
    let _g = tch::no_grad_guard();
    let mut p = f32t(&random(1, 1.0));
    let mut sum = Tensor::full([N as i64], init, (Kind::Float, tch::Device::Cpu));
    for s in 0..STEPS {
        let g = f32t(&grads(s)) + &p * wd;
        let clr = lr / (1.0 + s as f64 * lr_decay);
        sum += &g * &g;
        p = &p - (g / (sum.sqrt() + eps)) * clr;
    }
    let c = AdagradConfig { eps, lr_decay, initial_accumulator_value: init };
    let z = zerorun_run(Adagrad::new(c, N), lr, wd);
    let e = rel(&z, &back(&p));
    assert!(e <= 1e-6, "Adagrad: {e:e}");
}

#[test]
fn lion_matches_deepspeed_formula() {
    let (lr, wd, b1, b2) = (1e-4, 0.1, 0.9, 0.99);
    let _g = tch::no_grad_guard();
    let mut p = f32t(&random(1, 1.0));
    let mut m = Tensor::zeros([N as i64], (Kind::Float, tch::Device::Cpu));
    for s in 0..STEPS {
        let g = f32t(&grads(s));
        let c = &m * b1 + &g * (1.0 - b1);
        p = &p * (1.0 - lr * wd) - c.sign() * lr;
        m = &m * b2 + &g * (1.0 - b2);
    }
    let z = zerorun_run(Lion::new(LionConfig { betas: (b1, b2) }, N), lr, wd);
    let e = rel(&z, &back(&p));
    assert!(e <= 1e-6, "Lion: {e:e}");
}

#[test]
fn lamb_matches_deepspeed_formula() {
    let (lr, wd, b1, b2, eps) = (1e-3, 0.01, 0.9, 0.999, 1e-8);
    let _g = tch::no_grad_guard();
    let mut p = f32t(&random(1, 1.0));
    let (mut m, mut v) = (
        Tensor::zeros([N as i64], (Kind::Float, tch::Device::Cpu)),
        Tensor::zeros([N as i64], (Kind::Float, tch::Device::Cpu)),
    );
    for s in 0..STEPS {
        let t = (s + 1) as i32;
        let g = f32t(&grads(s));
        m = &m * b1 + &g * (1.0 - b1);
        v = &v * b2 + &g * &g * (1.0 - b2);
        let u = (&m / (1.0 - b1.powi(t))) / ((&v / (1.0 - b2.powi(t))).sqrt() + eps) + &p * wd;
        let (wn, un) = (p.norm().double_value(&[]), u.norm().double_value(&[]));
        let coeff = if wn > 0.0 && un > 0.0 { (wn / un).clamp(0.01, 10.0) } else { 1.0 };
        p = &p - u * (lr * coeff);
    }
    let z = zerorun_run(Lamb::new(LambConfig::default(), N), lr, wd);
    let e = rel(&z, &back(&p));
    assert!(e <= 1e-6, "Lamb: {e:e}");
}

#[test]
fn sixteen_bit_gradients_and_copy_out() {
    // bf16 gradients give exactly the fp32 path fed with the same (rounded) values; the copy-out is the rounded master.
    let mut a = random(1, 1.0);
    let mut b = a.clone();
    let mut out = vec![bf16::ZERO; N];
    let (mut oa, mut ob) = (Adam::new(AdamConfig::default(), N), Adam::new(AdamConfig::default(), N));
    let groups = Group::whole(N, 1e-3, 0.01);
    for s in 0..10 {
        let g16: Vec<bf16> = grads(s).iter().map(|x| bf16::from_f32(*x)).collect();
        let g32: Vec<f32> = g16.iter().map(|x| x.to_f32()).collect();
        oa.step(&mut a, Grads::Bf16(&g16), &groups, Some(ParamsOut::Bf16(&mut out))).unwrap();
        ob.step(&mut b, Grads::F32(&g32), &groups, None).unwrap();
    }
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    assert!(out.iter().zip(&a).all(|(o, p)| *o == bf16::from_f32(*p)));
    let mut h = vec![half::f16::ZERO; N];
    let g16: Vec<half::f16> = grads(0).iter().map(|x| half::f16::from_f32(*x)).collect();
    oa.step(&mut a, Grads::F16(&g16), &groups, Some(ParamsOut::F16(&mut h))).unwrap();
    assert!(h.iter().zip(&a).all(|(o, p)| *o == half::f16::from_f32(*p)));
}
