//! Properties that need no reference implementation: thread-count independence, input checks, schedules pinned
//! at their boundaries, loss-scaler rules.
use half::bf16;
use zerorun_optim::loss_scale::StepDecision;
use zerorun_optim::schedule::*;
use zerorun_optim::*;

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn run_adam(threads: usize) -> (Vec<f32>, Vec<bf16>, OptimizerState) {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.install(|| {
        let n = 100_003;
        let mut p = data(n, 1);
        let mut out = vec![bf16::ZERO; n];
        let mut opt = Adam::new(AdamConfig { amsgrad: true, ..Default::default() }, n);
        let groups = vec![
            Group { range: 0..60_000, lr: 1e-3, weight_decay: 0.1 },
            Group { range: 60_000..n, lr: 2e-3, weight_decay: 0.0 },
        ];
        for step in 0..5 {
            let g: Vec<bf16> = data(n, 100 + step).iter().map(|x| bf16::from_f32(*x)).collect();
            opt.step(&mut p, Grads::Bf16(&g), &groups, Some(ParamsOut::Bf16(&mut out))).unwrap();
        }
        (p, out, opt.state().clone())
    })
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let (p1, o1, s1) = run_adam(1);
    let (p4, o4, s4) = run_adam(4);
    assert!(p1.iter().zip(&p4).all(|(a, b)| a.to_bits() == b.to_bits()), "params differ bitwise");
    assert_eq!(o1, o4);
    assert_eq!(s1, s4);
    // The 16-bit copy is the rounded fp32 master.
    assert!(o1.iter().zip(&p1).all(|(o, p)| *o == bf16::from_f32(*p)));
}

#[test]
fn groups_apply_their_own_hyper_parameters() {
    // lr 0 in the second group: those elements must not move; weight decay only where asked.
    let n = 40_000;
    let p0 = data(n, 7);
    let mut p = p0.clone();
    let g = vec![0f32; n];
    let mut opt = Adam::new(AdamConfig::default(), n);
    let groups = vec![
        Group { range: 0..20_000, lr: 0.1, weight_decay: 0.5 },
        Group { range: 20_000..n, lr: 0.0, weight_decay: 0.5 },
    ];
    opt.step(&mut p, Grads::F32(&g), &groups, None).unwrap();
    for i in 0..20_000 {
        assert_eq!(p[i], p0[i] * (1.0 - 0.1 * 0.5), "decoupled decay at {i}");
    }
    assert_eq!(&p[20_000..], &p0[20_000..]);
}

#[test]
fn bad_inputs_are_typed_errors() {
    let mut p = vec![0f32; 10];
    let mut opt = Adam::new(AdamConfig::default(), 10);
    let g = vec![0f32; 9];
    assert_eq!(
        opt.step(&mut p, Grads::F32(&g), &Group::whole(10, 1e-3, 0.0), None).unwrap_err().to_string(),
        "gradient shard has 9 elements, expected 10"
    );
    let g = vec![0f32; 10];
    let overlap =
        vec![Group { range: 0..6, lr: 1.0, weight_decay: 0.0 }, Group { range: 5..10, lr: 1.0, weight_decay: 0.0 }];
    assert_eq!(
        opt.step(&mut p, Grads::F32(&g), &overlap, None).unwrap_err().to_string(),
        "parameter groups 0..6 and 5..10 overlap"
    );
    let outside = vec![Group { range: 0..11, lr: 1.0, weight_decay: 0.0 }];
    assert!(matches!(opt.step(&mut p, Grads::F32(&g), &outside, None), Err(OptimError::GroupRange { index: 0, .. })));
}

#[test]
fn norms_and_overflow() {
    let g = vec![3f32, 4.0];
    assert_eq!(norm::sum_of_squares(Grads::F32(&g)), 25.0);
    let big: Vec<f32> = (0..100_000).map(|i| (i % 7) as f32).collect();
    let expect: f64 = big.iter().map(|x| (*x as f64).powi(2)).sum();
    assert_eq!(norm::sum_of_squares(Grads::F32(&big)), expect);
    let mut bad = big.clone();
    bad[77_777] = f32::INFINITY;
    assert!(norm::has_overflow(Grads::F32(&bad)));
    bad[77_777] = f32::NAN;
    assert!(norm::has_overflow(Grads::F32(&bad)));
    assert!(!norm::has_overflow(Grads::F32(&big)));
    assert!((norm::clip_coefficient(10.0, 1.0) - 1.0 / (10.0 + 1e-6)).abs() < 1e-15);
    assert_eq!(norm::clip_coefficient(0.5, 1.0), 1.0);
    assert_eq!(norm::clip_coefficient(10.0, 0.0), 1.0);
}

fn lr_at(config: SchedulerConfig, base: f64, iteration: i64) -> f64 {
    let mut s = LrScheduler::new(config, base);
    while s.last_batch_iteration < iteration {
        s.step();
    }
    s.lr()
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() <= 1e-12 * b.abs().max(1e-12), "{a} != {b}");
}

#[test]
fn warmup_schedules_at_their_boundaries() {
    let w = |kind| WarmupLrParams {
        warmup_min_lr: 0.01,
        warmup_max_lr: 0.11,
        warmup_num_steps: 10,
        warmup_type: kind,
        last_batch_iteration: -1,
    };
    let lin = SchedulerConfig::WarmupLR(w(WarmupType::Linear));
    close(lr_at(lin.clone(), 1.0, -1), 0.01); // before the first step: the minimum
    close(lr_at(lin.clone(), 1.0, 0), 0.01);
    close(lr_at(lin.clone(), 1.0, 1), 0.01 + 0.1 * 0.1);
    close(lr_at(lin.clone(), 1.0, 9), 0.01 + 0.1 * 0.9);
    close(lr_at(lin.clone(), 1.0, 10), 0.11); // warmup end
    close(lr_at(lin, 1.0, 1000), 0.11);
    let log = SchedulerConfig::WarmupLR(w(WarmupType::Log));
    close(lr_at(log.clone(), 1.0, 0), 0.01);
    close(lr_at(log.clone(), 1.0, 4), 0.01 + 0.1 * 5f64.ln() / 10f64.ln());
    close(lr_at(log, 1.0, 10), 0.11);

    let decay =
        SchedulerConfig::WarmupDecayLR(WarmupDecayLrParams { warmup: w(WarmupType::Linear), total_num_steps: 110 });
    close(lr_at(decay.clone(), 1.0, 10), 0.01 + 0.1 * 100.0 / 100.0);
    close(lr_at(decay.clone(), 1.0, 60), 0.01 + 0.1 * 50.0 / 100.0); // mid-decay
    close(lr_at(decay.clone(), 1.0, 110), 0.01); // total_num_steps
    close(lr_at(decay, 1.0, 200), 0.01);

    let cos = |kind| {
        SchedulerConfig::WarmupCosineLR(WarmupCosineLrParams {
            total_num_steps: 110,
            warmup_min_ratio: 0.1,
            warmup_num_steps: 10,
            cos_min_ratio: 0.01,
            warmup_type: kind,
            last_batch_iteration: -1,
        })
    };
    close(lr_at(cos(WarmupType::Linear), 2.0, 0), 2.0 * 0.1);
    close(lr_at(cos(WarmupType::Linear), 2.0, 5), 2.0 * (0.1 + 0.5 * 0.9));
    close(lr_at(cos(WarmupType::Log), 2.0, 5), 2.0 * (0.1 + 6f64.ln() / 10f64.ln() * 0.9));
    close(
        lr_at(cos(WarmupType::Linear), 2.0, 10),
        2.0 * (0.01 + 0.99 * (1.0 + (std::f64::consts::PI / 100.0).cos()) / 2.0),
    );
    close(lr_at(cos(WarmupType::Linear), 2.0, 59), 2.0 * (0.01 + 0.99 * 0.5)); // mid-decay: half the cosine
    close(lr_at(cos(WarmupType::Linear), 2.0, 109), 2.0 * 0.01); // total_num_steps
}

#[test]
fn one_cycle_and_range_test_at_their_boundaries() {
    let oc = SchedulerConfig::OneCycle(OneCycleParams {
        cycle_min_lr: 0.1,
        cycle_max_lr: 1.1,
        decay_lr_rate: 0.5,
        cycle_first_step_size: 10,
        cycle_second_step_size: 10,
        cycle_first_stair_count: 0,
        cycle_second_stair_count: 0,
        decay_step_size: 5,
        cycle_momentum: true,
        cycle_min_mom: 0.8,
        cycle_max_mom: 0.9,
        decay_mom_rate: 0.1,
        last_batch_iteration: -1,
    });
    let at = |it| {
        let mut s = LrScheduler::new(oc.clone(), 0.0);
        while s.last_batch_iteration < it {
            s.step();
        }
        (s.lr(), s.momentum().unwrap())
    };
    let (lr, mom) = at(-1);
    close(lr, 0.1);
    close(mom, 0.9);
    let (lr, mom) = at(9); // peak of the cycle
    close(lr, 1.1);
    close(mom, 0.8);
    let (lr, _) = at(14);
    close(lr, 0.1 + 1.0 * 0.5);
    let (lr, mom) = at(24); // 5 steps into the decay: one decay interval
    close(lr, 0.1 / (1.0 + 0.5 * 1.0));
    close(mom, 0.9 * (1.0 + 0.1 * 1.0));

    let rt = |stair| {
        SchedulerConfig::LRRangeTest(LrRangeTestParams {
            lr_range_test_min_lr: 0.001,
            lr_range_test_step_size: 10,
            lr_range_test_step_rate: 2.0,
            lr_range_test_staircase: stair,
            last_batch_iteration: -1,
        })
    };
    close(lr_at(rt(false), 0.0, -1), 0.001);
    close(lr_at(rt(false), 0.0, 4), 0.001 * (1.0 + 2.0 * 0.5));
    close(lr_at(rt(true), 0.0, 4), 0.001);
    close(lr_at(rt(true), 0.0, 9), 0.001 * 3.0);
}

#[test]
fn dynamic_loss_scaling_follows_deepspeed() {
    let mut s = LossScaler::new(LossScalerConfig::from_fp16(0.0, 4, 3, 2, false, 1.0));
    assert_eq!(s.scale(), 16.0);
    // First overflow is absorbed by the hysteresis, the second halves the scale; both steps are skipped.
    assert_eq!(s.update(true).unwrap(), StepDecision::Skip);
    assert_eq!(s.scale(), 16.0);
    assert_eq!(s.update(true).unwrap(), StepDecision::Skip);
    assert_eq!(s.scale(), 8.0);
    // Three good steps after the last overflow double it.
    for _ in 0..2 {
        assert_eq!(s.update(false).unwrap(), StepDecision::Apply);
        assert_eq!(s.scale(), 8.0);
    }
    s.update(false).unwrap();
    assert_eq!(s.scale(), 16.0);

    let mut at_min = LossScaler::new(LossScalerConfig::from_fp16(0.0, 1, 1000, 1, false, 1.0));
    at_min.update(true).unwrap();
    assert_eq!(at_min.scale(), 1.0);
    assert_eq!(
        at_min.update(true).unwrap_err().to_string(),
        "current loss scale 1 is already at the minimum (1) and gradients still overflow"
    );

    let mut fixed = LossScaler::new(LossScalerConfig::from_fp16(128.0, 16, 1000, 2, false, 1.0));
    assert_eq!(fixed.update(true).unwrap(), StepDecision::Skip);
    assert_eq!(fixed.scale(), 128.0);
}

#[test]
fn bf16_copy_out_rounds_like_half_including_ties_and_nan() {
    // Values at, around and between bf16 ties, infinities and NaN go through the optimizer's copy-out.
    let specials = [
        0.0f32,
        -0.0,
        1.0,
        1.003_906_3,
        1.0078125,
        1.005_859_4,
        1.001_953_1,
        -3.0e38,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1e-40,
        f32::MAX,
    ];
    let mut p: Vec<f32> =
        specials.iter().copied().chain((0..5000).map(|i| f32::from_bits(0x3f80_0000 + i * 977))).collect();
    let n = p.len();
    let g = vec![0f32; n];
    let mut out = vec![bf16::ZERO; n];
    // SGD with lr 0 leaves p unchanged, so the copy-out sees exactly these values.
    let mut opt = Sgd::new(SgdConfig::default(), n);
    opt.step(&mut p, Grads::F32(&g), &Group::whole(n, 0.0, 0.0), Some(ParamsOut::Bf16(&mut out))).unwrap();
    for (o, x) in out.iter().zip(&p) {
        assert_eq!(o.to_bits(), bf16::from_f32(*x).to_bits(), "{x:e}");
    }
}

/// Bit pattern digest of a fixed run of every optimizer (FNV-1a over the params' bits).
fn digest_of_all_optimizers() -> u64 {
    let n = 40_000;
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let groups = vec![
        Group { range: 0..25_000, lr: 1e-2, weight_decay: 0.1 },
        Group { range: 25_000..n, lr: 3e-3, weight_decay: 0.0 },
    ];
    let opts: Vec<Box<dyn Optimizer>> = vec![
        Box::new(Adam::new(AdamConfig::default(), n)),
        Box::new(Adam::new(AdamConfig { amsgrad: true, adam_w_mode: false, ..Default::default() }, n)),
        Box::new(Sgd::new(SgdConfig { momentum: 0.9, dampening: 0.1, nesterov: false }, n)),
        Box::new(Adagrad::new(AdagradConfig::default(), n)),
        Box::new(Lion::new(LionConfig::default(), n)),
        Box::new(Lamb::new(LambConfig::default(), n)),
    ];
    for mut opt in opts {
        let mut p = data(n, 3);
        let mut out = vec![bf16::ZERO; n];
        for s in 0..4 {
            let g: Vec<bf16> = data(n, 50 + s).iter().map(|x| bf16::from_f32(*x)).collect();
            opt.step(&mut p, Grads::Bf16(&g), &groups, Some(ParamsOut::Bf16(&mut out))).unwrap();
            let g32 = data(n, 90 + s);
            opt.step(&mut p, Grads::F32(&g32), &groups, None).unwrap();
        }
        for x in p.iter().map(|x| x.to_bits() as u64).chain(out.iter().map(|x| x.to_bits() as u64)) {
            h = (h ^ x).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

#[test]
#[ignore = "run by every_simd_level_gives_the_same_bits in a child process"]
fn simd_digest_helper() {
    // Run by `every_simd_level_gives_the_same_bits` in a child process with ZERORUN_SIMD set.
    if std::env::var("ZERORUN_DIGEST").is_ok() {
        println!("DIGEST {:x} {:?}", digest_of_all_optimizers(), simd_level());
    }
}

#[test]
fn every_simd_level_gives_the_same_bits() {
    let run = |level: &str| {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "simd_digest_helper", "--ignored", "--nocapture", "--test-threads", "1"])
            .env("ZERORUN_DIGEST", "1")
            .env("ZERORUN_SIMD", level)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let at = text.find("DIGEST ").unwrap_or_else(|| panic!("no digest: {text}"));
        let mut parts = text[at..].split_whitespace().skip(1);
        (parts.next().unwrap().to_string(), parts.next().unwrap().to_string())
    };
    let (scalar, level) = run("scalar");
    assert_eq!(level, "Scalar");
    for l in ["avx2", "native"] {
        let (d, used) = run(l);
        assert_eq!(d, scalar, "{used} differs from the scalar build");
    }
}

/// Every element-wise optimizer, boxed, over a shard of `n`.
fn element_wise_optimizers(n: usize) -> Vec<Box<dyn Optimizer>> {
    vec![
        Box::new(Adam::new(AdamConfig { amsgrad: true, ..Default::default() }, n)),
        Box::new(Adam::new(AdamConfig { adam_w_mode: false, ..Default::default() }, n)),
        Box::new(Sgd::new(SgdConfig { momentum: 0.9, dampening: 0.1, nesterov: false }, n)),
        Box::new(Sgd::new(SgdConfig::default(), n)),
        Box::new(Adagrad::new(AdagradConfig { lr_decay: 0.01, ..Default::default() }, n)),
        Box::new(Lion::new(LionConfig::default(), n)),
    ]
}

/// A decayed group and one without decay, split at element 20,000 of `n`.
fn two_groups(n: usize) -> Vec<Group> {
    vec![
        Group { range: 0..20_000, lr: 1e-2, weight_decay: 0.1 },
        Group { range: 20_000..n, lr: 3e-3, weight_decay: 0.0 },
    ]
}

#[test]
fn a_step_in_pieces_equals_the_whole_step_bitwise() {
    // Pieces cut across both groups' boundaries, in backward's order (last piece first), with a 16-bit copy.
    let n = 50_001;
    let groups = two_groups(n);
    let pieces = [40_000..n, 17_000..40_000, 0..17_000];
    for (mut whole, mut parts) in element_wise_optimizers(n).into_iter().zip(element_wise_optimizers(n)) {
        let (mut p_whole, mut p_parts) = (data(n, 3), data(n, 3));
        let (mut o_whole, mut o_parts) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
        for step in 0..3 {
            let g = data(n, 50 + step);
            whole.step(&mut p_whole, Grads::F32(&g), &groups, Some(ParamsOut::Bf16(&mut o_whole))).unwrap();
            parts.begin_step();
            for r in pieces.clone() {
                let out = Some(ParamsOut::Bf16(&mut o_parts[r.clone()]));
                parts
                    .update_range(r.clone(), &mut p_parts[r.clone()], Grads::F32(&g[r.clone()]), &groups, out)
                    .unwrap();
            }
        }
        let name = whole.name();
        assert!(p_whole.iter().zip(&p_parts).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: params differ");
        assert_eq!(o_whole, o_parts, "{name}: 16-bit copies differ");
        assert_eq!(whole.state(), parts.state(), "{name}: states differ");
        assert_eq!(parts.state().step, 3);
    }
}

#[test]
fn scaled_gradients_step_bitwise_like_gradients_scaled_in_place_first() {
    // Clipping's coefficient read with the gradients (Grads::Scaled) against norm::scale_in_place before the step,
    // every optimizer (Lamb's trust ratio included), two groups, three steps.
    let n = 50_001;
    let groups = two_groups(n);
    let with_lamb = |n| {
        let mut all = element_wise_optimizers(n);
        all.push(Box::new(Lamb::new(LambConfig::default(), n)) as Box<dyn Optimizer>);
        all
    };
    for (mut fused, mut first) in with_lamb(n).into_iter().zip(with_lamb(n)) {
        let (mut p_fused, mut p_first) = (data(n, 3), data(n, 3));
        for step in 0..3 {
            let g = data(n, 50 + step);
            let coef = 0.37f32 + step as f32 * 0.11;
            fused.step(&mut p_fused, Grads::Scaled(&g, coef), &groups, None).unwrap();
            let mut scaled = g.clone();
            norm::scale_in_place(&mut scaled, coef);
            first.step(&mut p_first, Grads::F32(&scaled), &groups, None).unwrap();
        }
        let name = fused.name();
        assert!(p_fused.iter().zip(&p_first).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: params differ");
        assert_eq!(fused.state(), first.state(), "{name}: states differ");
    }
}

#[test]
fn a_piece_outside_the_shard_and_lamb_are_refused() {
    let n = 10;
    let mut adam = Adam::new(AdamConfig::default(), n);
    let groups = Group::whole(n, 1e-3, 0.0);
    let (mut p, g) = (vec![0f32; 4], vec![0f32; 4]);
    let err = adam.update_range(8..12, &mut p, Grads::F32(&g), &groups, None).unwrap_err();
    assert_eq!(err, OptimError::GroupRange { index: 0, start: 8, end: 12, len: 10 });
    let err = adam.update_range(0..3, &mut p, Grads::F32(&g), &groups, None).unwrap_err();
    assert_eq!(err, OptimError::Length { what: "parameters of the range", got: 4, expected: 3 });
    let mut lamb = Lamb::new(LambConfig::default(), n);
    let err = lamb.update_range(0..4, &mut p, Grads::F32(&g), &groups, None).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Lamb cannot step part of its shard: its update reads more than one element (per-tensor norms)"
    );
}
