//! `zerorun bench adam`: params/s of one AdamW step, beside libtorch's AdamW and the machine's memory bandwidth,
//! all measured in the same run. Compiled into the `zerorun-torch` helper binary only (it links libtorch).
use std::time::Instant;

use tch::nn::{self, OptimizerConfig};
use tch::{Kind, Tensor};
use zerorun_optim::traffic::adam_traffic;
use zerorun_optim::{simd_level, Adam, AdamConfig, AlignedVec, Grads, Group, Optimizer, ParamsOut};
use zerorun_runtime::engine::device_optimizer::{fused_adam_step, FusedAdamStep};

use super::{emit, CliError};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn timed(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// The in-place reference kernels, run over the very arrays of zerorun's fp32 step (its params, gradients and
/// optimizer moments): on these virtual machines bandwidth depends on where an allocation landed in physical memory
/// (up to 2x between two allocations of the same size), so only the same arrays give a fair limit; and kernels
/// such as `a *= s` touch only some of them. Returns the bytes/s of an in-place kernel with exactly Adam's
/// traffic (read p, g, m, v; write p, m, v: 28 B per element) and trivial math.
fn bandwidth(z: &mut ZerorunAdam) -> f64 {
    let n = z.p.len() as f64;
    let ZerorunAdam { p, g, opt, .. } = z;
    let mut states = opt.state_mut().buffers.iter_mut().map(|(_, b)| b.as_mut_slice());
    let (m, v) = (states.next().expect("exp_avg"), states.next().expect("exp_avg_sq"));
    // Adam's traffic through zerorun-optim's own tiles, threads and vector code, with trivial math.
    // Best of two back-to-back runs: the first after libtorch's steps (which allocate and free temporaries of the
    // step's size) is sometimes slowed by the page-table work that leaves behind.
    let adam_like =
        (0..2).map(|_| timed(|| adam_traffic(p, Grads::F32(g), m, v).expect("equal lengths"))).fold(f64::MAX, f64::min);
    std::hint::black_box(&p);
    28.0 * n / adam_like
}

/// zerorun-optim's AdamW on `n` parameters, with f32 gradients or bf16 gradients and a bf16 copy-out.
struct ZerorunAdam {
    p: AlignedVec,
    g: AlignedVec,
    g16: Vec<half::bf16>,
    out: Vec<half::bf16>,
    opt: Adam,
    groups: Vec<Group>,
}

impl ZerorunAdam {
    fn new(n: usize) -> Self {
        ZerorunAdam {
            // 64-byte aligned like the engine's (libtorch-allocated) flat buffers.
            p: AlignedVec::filled(n, 0.5),
            g: AlignedVec::filled(n, 0.01),
            g16: vec![half::bf16::from_f32(0.01); n],
            out: vec![half::bf16::ZERO; n],
            opt: Adam::new(AdamConfig::default(), n),
            groups: Group::whole(n, 1e-3, 0.01),
        }
    }

    fn step(&mut self, bf16: bool) -> f64 {
        let ZerorunAdam { p, g, g16, out, opt, groups } = self;
        timed(|| {
            let r = if bf16 {
                opt.step(p, Grads::Bf16(g16), groups, Some(ParamsOut::Bf16(out)))
            } else {
                opt.step(p, Grads::F32(g), groups, None)
            };
            r.expect("sizes match")
        })
    }
}

/// libtorch's fused CPU AdamW kernel (`_fused_adamw_`, what `torch.optim.AdamW(fused=True)` runs).
struct TorchFusedAdam {
    t: [Tensor; 4],
    steps: u64,
}

impl TorchFusedAdam {
    fn new(n: usize) -> Self {
        let o = (Kind::Float, tch::Device::Cpu);
        TorchFusedAdam {
            t: [
                Tensor::full([n as i64], 0.5, o),
                Tensor::full([n as i64], 0.01, o),
                Tensor::zeros([n as i64], o),
                Tensor::zeros([n as i64], o),
            ],
            steps: 0,
        }
    }

    fn step(&mut self) -> f64 {
        let [p, g, m, v] = &self.t;
        self.steps += 1;
        let h = FusedAdamStep {
            step: self.steps,
            lr: 1e-3,
            betas: (0.9, 0.999),
            weight_decay: 0.01,
            eps: 1e-8,
            decoupled: true,
        };
        timed(|| fused_adam_step(p, g, m, v, None, h).expect("libtorch's _fused_adamw_"))
    }
}

/// libtorch's C++ AdamW (tch's `nn::AdamW`) on one flat parameter of `n` elements.
struct TorchAdam {
    opt: nn::Optimizer,
    _vs: nn::VarStore,
}

impl TorchAdam {
    fn new(n: usize) -> Self {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let p = vs.root().var("p", &[n as i64], nn::Init::Const(0.5));
        let opt = nn::AdamW { beta1: 0.9, beta2: 0.999, wd: 0.01, eps: 1e-8, amsgrad: false }
            .build(&vs, 1e-3)
            .expect("AdamW builds");
        let g = Tensor::full([n as i64], 0.01, (Kind::Float, tch::Device::Cpu));
        (&p * &g).sum(Kind::Float).backward();
        TorchAdam { opt, _vs: vs }
    }

    fn step(&mut self) -> f64 {
        timed(|| self.opt.step())
    }
}

/// Runs the benchmark (`repeats` timed rounds per size after a warm-up).
pub fn run(params: Option<usize>, repeats: usize, json: bool) -> Result<(), CliError> {
    let repeats = repeats.max(1);
    let sizes: Vec<usize> = match params {
        Some(n) if n > 0 => vec![n],
        Some(_) => return Err(CliError::Usage("--params must be >= 1".into())),
        None => (20..=27).map(|e| 1usize << e).collect(),
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    tch::set_num_threads(cores as i32);
    if !json {
        emit(&format!("# AdamW step, {cores} cores, SIMD {:?}; limit = bandwidth of an Adam-traffic kernel over the step's own arrays / 28 B per parameter", simd_level()))?;
        emit(&format!(
            "{:>12} {:>6} {:>14} {:>14} {:>14} {:>9} {:>9}",
            "params", "grads", "zerorun/s", "best torch/s", "limit/s", "vs torch", "of limit"
        ))?;
    }
    let mut progress = super::cli::progress::Progress::new("bench adam", sizes.len() as u64);
    for &n in &sizes {
        progress.item(&format!("{n} parameters"));
        // The machine's bandwidth drifts from second to second here: the reference, zerorun and libtorch are
        // interleaved, one round each per repetition, after one untimed warm-up round.
        let (mut z32, mut z16, mut torch, mut fused) =
            (ZerorunAdam::new(n), ZerorunAdam::new(n), TorchAdam::new(n), TorchFusedAdam::new(n));
        let mut samples: [Vec<f64>; 6] = Default::default();
        for rep in 0..=repeats {
            let round = [
                bandwidth(&mut z32),
                n as f64 / z32.step(false),
                bandwidth(&mut z16),
                n as f64 / z16.step(true),
                n as f64 / torch.step(),
                n as f64 / fused.step(),
            ];
            if rep > 0 {
                for (s, v) in samples.iter_mut().zip(round) {
                    s.push(v);
                }
            }
        }
        let [bw32, z32, bw16, z16, cpp, fused] = samples.map(median);
        progress.done();
        let (torch, variant) = if fused >= cpp {
            (fused, "_fused_adamw_ (libtorch fused kernel)")
        } else {
            (cpp, "nn::AdamW (libtorch C++)")
        };
        // fp32 Adam reads p, g, m, v and writes p, m, v: 28 B. bf16 grads + bf16 copy-out: 14 B read + 14 B written.
        progress.suspend(|| -> Result<(), CliError> {
            for (grads, z, bw) in [("f32", z32, bw32), ("bf16", z16, bw16)] {
                let limit = bw / 28.0;
                if json {
                    emit(
                        &serde_json::json!({
                            "params": n, "grads": grads, "copy_out": if grads == "bf16" { "bf16" } else { "none" },
                            "zerorun_params_per_s": z, "torch_params_per_s": torch, "torch_variant": variant,
                            "torch_fused_params_per_s": fused, "torch_cpp_params_per_s": cpp,
                            "limit_params_per_s": limit, "bandwidth_bytes_per_s": bw, "simd": format!("{:?}", simd_level()),
                        })
                        .to_string(),
                    )?;
                } else {
                    emit(&format!(
                        "{n:>12} {grads:>6} {z:>14.3e} {torch:>14.3e} {limit:>14.3e} {:>8.2}x {:>8.0}%",
                        z / torch,
                        100.0 * z / limit
                    ))?;
                }
            }
            Ok(())
        })?;
    }
    Ok(())
}
