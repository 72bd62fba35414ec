//! The mixture-of-experts layer against transformers' own blocks (the project venv's, from `make setup`): Mixtral's
//! and Qwen3-MoE's (without renormalised top-k weights) give the same output, router logits, load-balancing loss and
//! gradients of every weight and of the input. Over an expert-parallel group of 2 and 4 thread ranks, each rank's
//! output and the gradients equal one rank holding every expert (an expert's gradient summed over every rank's
//! tokens), with an expert that no token chose among them; DeepSpeed's capacity drops exactly the slots over it.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use tch::{nn, Device, Kind, Tensor};
use zerorun::runtime::comm::threads;
use zerorun::runtime::moe::{load_balancing_loss, Capacity, ExpertNames, ExpertParallel, MoeLayer};

const HIDDEN: i64 = 16;
const FFN: i64 = 24;
const EXPERTS: i64 = 4;
const TOP_K: i64 = 2;
const COEF: f64 = 0.02;

/// libtorch's generator is the process's: layers are built one at a time, each from a seed.
static BUILD: Mutex<()> = Mutex::new(());

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zerorun-moe-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn close(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.size(), b.size(), "{what}: shapes");
    let d = (a - b).abs().max().double_value(&[]);
    let scale = b.abs().max().double_value(&[]).max(1.0);
    assert!(d <= 1e-5 * scale, "{what}: max difference {d:e} (scale {scale:e})");
}

/// Seeded tokens (under the generator's lock: tests run at once).
fn tokens(seed: i64, rows: i64) -> Tensor {
    let _g = BUILD.lock().unwrap();
    tch::manual_seed(seed);
    Tensor::randn([rows, 5, HIDDEN], (Kind::Float, Device::Cpu))
}

fn weights_of(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn against_transformers(kind: &str, names: ExpertNames, normalize: bool) {
    let dir = scratch(kind);
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = {
        let _g = BUILD.lock().unwrap();
        tch::manual_seed(3);
        MoeLayer::new(&vs.root(), names, HIDDEN, FFN, EXPERTS, TOP_K).normalize_top_k(normalize)
    };
    let x = tokens(11, 3).set_requires_grad(true);
    let c = tokens(12, 3);
    let mut written = weights_of(&vs);
    written.push(("x".into(), x.detach()));
    written.push(("c".into(), c.shallow_clone()));
    Tensor::write_safetensors(&written, dir.join("in.safetensors")).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/moe/reference.py");
    let (h, f, e, k, n, coef) = (HIDDEN, FFN, EXPERTS, TOP_K, u8::from(normalize), COEF);
    let out = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python"))
        .arg(script)
        .args([
            kind,
            &dir.join("in.safetensors").display().to_string(),
            &dir.join("out.safetensors").display().to_string(),
        ])
        .args([h, f, e, k].map(|v| v.to_string()))
        .args([n.to_string(), coef.to_string()])
        .output()
        .expect("the project venv (make setup)");
    assert!(out.status.success(), "reference.py: {}", String::from_utf8_lossy(&out.stderr));
    let reference: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("out.safetensors")).unwrap().into_iter().collect();

    let result = layer.forward(&x).unwrap();
    let aux = load_balancing_loss(&[&result.router_logits], EXPERTS, TOP_K);
    ((&result.output * &c).sum(Kind::Float) + &aux * COEF).backward();
    close(&result.output, &reference["output"], "output");
    close(&result.router_logits, &reference["router_logits"], "router logits");
    close(&aux.reshape([1]), &reference["aux"], "load-balancing loss");
    close(&x.grad(), &reference["x.grad"], "the input's gradient");
    for (name, v) in weights_of(&vs) {
        close(&v.grad(), &reference[&format!("{name}.grad")], &format!("{name}'s gradient"));
    }
    assert_eq!(result.dropped, 0);
    assert_eq!(result.tokens_per_expert.iter().sum::<i64>(), 3 * 5 * TOP_K);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mixtral_block_matches_transformers() {
    against_transformers("mixtral", ExpertNames::Mixtral, true);
}

#[test]
fn qwen3_moe_block_without_renormalised_weights_matches_transformers() {
    against_transformers("qwen3", ExpertNames::GateUpDown, false);
}

/// The whole layer from seed 5, the router steered so that expert 3 is nobody's choice when `starve`.
fn steer(layer: &MoeLayer, starve: bool) {
    if starve {
        tch::no_grad(|| {
            let _ = layer.router.weight.get(3).fill_(0.0);
            let _ = layer.router.weight.get(3).get(0).fill_(-1e3);
        });
    }
}

/// Rank r's tokens: its own seed, shifted so that expert 3's row gives them a large negative logit.
fn rank_tokens(r: usize) -> Tensor {
    let x = tokens(40 + r as i64, 2);
    let _ = tch::no_grad(|| x.narrow(2, 0, 1).abs_().g_add_scalar_(0.5));
    x
}

/// A rank's output, its input's gradient, its variables' gradients by name and its all-to-alls.
type RankRun = (Tensor, Tensor, Vec<(String, Tensor)>, u64);

#[test]
fn expert_parallel_groups_equal_one_rank_holding_every_expert() {
    for starve in [false, true] {
        for ranks in [2usize, 4] {
            // The reference: one layer with every expert, each rank's tokens in turn, gradients summed.
            let vs = nn::VarStore::new(Device::Cpu);
            let whole = {
                let _g = BUILD.lock().unwrap();
                tch::manual_seed(5);
                MoeLayer::new(&vs.root(), ExpertNames::Mixtral, HIDDEN, FFN, EXPERTS, TOP_K)
            };
            steer(&whole, starve);
            let (mut outputs, mut input_grads) = (Vec::new(), Vec::new());
            let mut chosen = vec![0i64; EXPERTS as usize];
            for r in 0..ranks {
                let x = rank_tokens(r).set_requires_grad(true);
                let y = whole.forward(&x).unwrap();
                (&y.output * &y.output).sum(Kind::Float).backward();
                chosen.iter_mut().zip(&y.tokens_per_expert).for_each(|(c, n)| *c += n);
                outputs.push(y.output.detach());
                input_grads.push(x.grad());
            }
            assert_eq!(chosen[3] == 0, starve, "expert 3 is chosen unless steered away: {chosen:?}");
            let grads: std::collections::HashMap<String, Tensor> =
                vs.variables().into_iter().map(|(n, v)| (n, v.grad().copy())).collect();

            let comms = threads::group(ranks, Duration::from_secs(30));
            let runs: Vec<RankRun> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .map(|c| {
                        s.spawn(move || {
                            let group = ExpertParallel::new(Box::new(c));
                            let vs = nn::VarStore::new(Device::Cpu);
                            let layer = {
                                let _g = BUILD.lock().unwrap();
                                tch::manual_seed(5);
                                MoeLayer::new(&vs.root(), ExpertNames::Mixtral, HIDDEN, FFN, EXPERTS, TOP_K)
                            };
                            steer(&layer, starve);
                            let x = rank_tokens(group.rank()).set_requires_grad(true);
                            let y = layer.forward_parallel(&group, &x).unwrap();
                            (&y.output * &y.output).sum(Kind::Float).backward();
                            let grads = vs
                                .variables()
                                .into_iter()
                                .map(|(n, v)| {
                                    let g = v.grad();
                                    (n, if g.defined() { g.copy() } else { g })
                                })
                                .collect();
                            (y.output.detach(), x.grad(), grads, group.counts().all_to_all)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let per = EXPERTS as usize / ranks;
            // Every rank holds every expert; each computed its own `per` of them, whose gradients (from every
            // rank's tokens) are the reference's, and has none for the others: the ranks' sum (ZeRO's reduction)
            // is the reference's for every variable.
            let mut sums: std::collections::HashMap<String, Tensor> =
                grads.iter().map(|(n, g)| (n.clone(), g.zeros_like())).collect();
            for (r, (output, input_grad, grads_r, all_to_alls)) in runs.iter().enumerate() {
                close(output, &outputs[r], &format!("rank {r} of {ranks}: output"));
                close(input_grad, &input_grads[r], &format!("rank {r} of {ranks}: the input's gradient"));
                // Two all-to-alls of rows forward, two backward.
                assert_eq!(*all_to_alls, 4, "rank {r}");
                assert_eq!(grads_r.len(), grads.len(), "rank {r} holds every variable");
                for (name, g) in grads_r {
                    if name != "gate.weight" {
                        let expert: usize = name.split('.').nth(1).unwrap().parse().unwrap();
                        let computed_here = expert / per == r;
                        assert_eq!(g.defined(), computed_here, "{name} on rank {r}: a gradient only where computed");
                        if computed_here {
                            close(g, &grads[name], &format!("{ranks} ranks: {name}'s gradient"));
                        }
                    }
                    if g.defined() {
                        let _ = sums.get_mut(name).unwrap().g_add_(g);
                    }
                }
            }
            for (name, sum) in &sums {
                close(sum, &grads[name], &format!("{ranks} ranks: {name}'s gradient summed over the ranks"));
            }
        }
    }
}

#[test]
fn capacity_drops_the_slots_over_it_in_token_order() {
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = {
        let _g = BUILD.lock().unwrap();
        tch::manual_seed(9);
        MoeLayer::new(&vs.root(), ExpertNames::Mixtral, HIDDEN, FFN, EXPERTS, TOP_K)
    };
    let x = tokens(21, 2).reshape([-1, HIDDEN]);
    let dropless = layer.forward(&x).unwrap();
    // A factor that covers every slot changes nothing.
    let roomy = MoeLayer { capacity: Some(Capacity { factor: EXPERTS as f64, min: 1 }), ..clone_layer(&layer) };
    let same = roomy.forward(&x).unwrap();
    assert_eq!(same.dropped, 0);
    close(&same.output, &dropless.output, "capacity over every slot");
    // One slot per expert: each expert takes its first token in token order, the other slots pass nothing.
    let tight = MoeLayer { capacity: Some(Capacity { factor: 1e-3, min: 1 }), ..clone_layer(&layer) };
    let one = tight.forward(&x).unwrap();
    let routing = layer.router.route(&x);
    let (experts, weights) = (Vec::<Vec<i64>>::try_from(&routing.experts).unwrap(), routing.weights);
    let expected = x.zeros_like();
    let mut taken = vec![false; EXPERTS as usize];
    for (t, choices) in experts.iter().enumerate() {
        for (j, e) in choices.iter().enumerate() {
            if !std::mem::replace(&mut taken[*e as usize], true) {
                let out = layer.experts.expert(*e as usize, &x.get(t as i64).unsqueeze(0))
                    * weights.get(t as i64).get(j as i64);
                let _ = expected.get(t as i64).g_add_(&out.squeeze_dim(0));
            }
        }
    }
    let used = taken.iter().filter(|t| **t).count() as i64;
    assert_eq!(one.dropped, x.size()[0] * TOP_K - used);
    close(&one.output, &expected, "one slot per expert");
}

/// The same layer's tensors, shared (shallow clones).
fn clone_layer(l: &MoeLayer) -> MoeLayer {
    use zerorun::runtime::moe::{Router, SwiGluExperts};
    MoeLayer {
        router: Router {
            weight: l.router.weight.shallow_clone(),
            top_k: l.router.top_k,
            normalize: l.router.normalize,
            bias: None,
        },
        experts: SwiGluExperts {
            weights: l.experts.weights.iter().map(|w| w.each_ref().map(|t| t.shallow_clone())).collect(),
        },
        num_experts: l.num_experts,
        capacity: None,
    }
}
