use std::time::Instant;
use zerorun_optim::*;
fn main() {
    let n: usize = std::env::args().nth(1).unwrap().parse().unwrap();
    let mut p = vec![0.5f32; n];
    let g = vec![0.01f32; n];
    let g16 = vec![half::bf16::from_f32(0.01); n];
    let mut out = vec![half::bf16::ZERO; n];
    let mut opt = Adam::new(AdamConfig::default(), n);
    let groups = Group::whole(n, 1e-3, 0.01);
    let reps = (1usize << 28) / n;
    for bf in [false, true] {
        let t = Instant::now();
        for _ in 0..reps {
            if bf { opt.step(&mut p, Grads::Bf16(&g16), &groups, Some(ParamsOut::Bf16(&mut out))).unwrap(); }
            else { opt.step(&mut p, Grads::F32(&g), &groups, None).unwrap(); }
        }
        println!("{:?} n {n} bf16 {bf}: {:.3e} params/s", simd_level(), (n * reps) as f64 / t.elapsed().as_secs_f64());
    }
}
