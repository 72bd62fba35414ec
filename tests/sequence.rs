//! Sequence parallelism's pieces on thread ranks: Ulysses attention over S = 2 and 4 ranks (grouped-query attention
//! whose key/value heads split over S, and whose do not) gives every rank its slice of the whole attention output,
//! and the gradients of its slices of the queries, keys and values; the sequence loss is the rows' mean on every
//! rank, and its gradients summed over the ranks (as the engine's average times S) are the whole loss's; heads that
//! do not split are refused by name. Ring attention over S = 2 and 3 ranks (3 heads, which do not split over 2; one
//! key/value head; the load-balanced head-and-tail chunks and contiguous slices) gives every rank the whole
//! attention at its positions, and the gradients of its queries, keys and values. An engine with
//! `sequence_parallel_size` 2 on 4 ranks counts a batch's rows over 2 data-parallel ranks, and its sampler gives the
//! two ranks of a sequence group the same rows.
use std::time::Duration;

use tch::{Device, Kind, Tensor};
use zerorun::runtime::comm::threads;
use zerorun::runtime::sequence::{self, SequenceParallel};

const B: i64 = 2;
const T: i64 = 8;
const HEADS: i64 = 4;
const KV: i64 = 2;
const D: i64 = 6;

/// Causal attention of q [b, h, t, d] over k, v [b, kv, t, d] (each key/value head serving h / kv query heads),
/// with a position-dependent rotation of q and k (as rotary embeddings: positions of the whole sequence).
fn attend(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let (b, h, t, d) = q.size4().unwrap();
    let kv = k.size()[1];
    let pos = Tensor::arange(t, (Kind::Float, Device::Cpu)).reshape([1, 1, t, 1]) * 0.1;
    let (q, k) = (q * (pos.cos()) + q.flip([-1]) * pos.sin(), k * pos.cos() + k.flip([-1]) * pos.sin());
    let expand = |x: &Tensor| x.repeat_interleave_self_int(h / kv, 1, None);
    let (k, v) = (expand(&k), expand(v));
    let scores = q.matmul(&k.transpose(-2, -1)) / (d as f64).sqrt();
    let mask = Tensor::ones([t, t], (Kind::Bool, Device::Cpu)).triu(1);
    let probs = scores.masked_fill(&mask, f64::NEG_INFINITY).softmax(-1, Kind::Float);
    probs.matmul(&v).transpose(1, 2).reshape([b, t, h * d])
}

fn inputs() -> (Tensor, Tensor, Tensor, Tensor) {
    tch::manual_seed(4);
    let q = Tensor::randn([B, T, HEADS, D], (Kind::Float, Device::Cpu));
    let k = Tensor::randn([B, T, KV, D], (Kind::Float, Device::Cpu));
    let v = Tensor::randn([B, T, KV, D], (Kind::Float, Device::Cpu));
    let c = Tensor::randn([B, T, HEADS * D], (Kind::Float, Device::Cpu));
    (q, k, v, c)
}

fn close(a: &Tensor, b: &Tensor, what: &str) {
    let d = (a - b).abs().max().double_value(&[]);
    assert!(d <= 1e-5, "{what}: max difference {d:e}");
}

/// `f` on each rank of a group of `inputs.len()`, with that rank's input (tensors are not shared across threads).
fn on_ranks<I: Send, R: Send>(inputs: Vec<I>, f: impl Fn(SequenceParallel, I) -> R + Sync) -> Vec<R> {
    let comms = threads::group(inputs.len(), Duration::from_secs(30));
    std::thread::scope(|scope| {
        let hs: Vec<_> = comms
            .into_iter()
            .zip(inputs)
            .map(|(c, i)| scope.spawn(|| f(SequenceParallel::new(Box::new(c)), i)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank r of `s`'s slice of `x` along the sequence (dimension 1), a leaf of its own.
fn slice_of(x: &Tensor, r: usize, s: usize) -> Tensor {
    x.detach().narrow(1, r as i64 * T / s as i64, T / s as i64).contiguous()
}

#[test]
fn ulysses_attention_is_the_whole_attention_slice_by_slice() {
    let (q, k, v, c) = inputs();
    let (q, k, v) = (q.set_requires_grad(true), k.set_requires_grad(true), v.set_requires_grad(true));
    let whole = attend(&q.transpose(1, 2), &k.transpose(1, 2), &v.transpose(1, 2));
    (&whole * &c).sum(Kind::Float).backward();
    for s in [2usize, 4] {
        let slices = (0..s).map(|r| [&q, &k, &v, &c].map(|x| slice_of(x, r, s))).collect();
        let runs = on_ranks(slices, |g, [qs, ks, vs, cs]| {
            // The library's own slicing agrees with the test's.
            assert_eq!(
                sequence::slice(&g, &Tensor::arange(T, (Kind::Int64, Device::Cpu)), 0).unwrap().int64_value(&[0]),
                g.rank() as i64 * T / g.size() as i64
            );
            let (qs, ks, vs) = (qs.set_requires_grad(true), ks.set_requires_grad(true), vs.set_requires_grad(true));
            let y = sequence::ulysses_attention(&g, &qs, &ks, &vs, attend).unwrap();
            (&y * cs).sum(Kind::Float).backward();
            (y.detach(), qs.grad(), ks.grad(), vs.grad(), g.counts().all_to_all)
        });
        for (r, (y, gq, gk, gv, all_to_alls)) in runs.iter().enumerate() {
            let mine = |x: &Tensor| x.narrow(1, r as i64 * T / s as i64, T / s as i64);
            close(y, &mine(&whole), &format!("S = {s}, rank {r}: output"));
            close(gq, &mine(&q.grad()), &format!("S = {s}, rank {r}: the queries' gradient"));
            close(gk, &mine(&k.grad()), &format!("S = {s}, rank {r}: the keys' gradient"));
            close(gv, &mine(&v.grad()), &format!("S = {s}, rank {r}: the values' gradient"));
            // q, k, v there and the output back; the same four backward.
            assert_eq!(*all_to_alls, 8, "S = {s}, rank {r}");
        }
    }
}

#[test]
fn the_sequence_loss_is_the_rows_mean_and_its_gradient_the_whole_one() {
    let (_, _, _, c) = inputs();
    let x = c.set_requires_grad(true);
    let token_losses = |x: &Tensor| x.pow_tensor_scalar(2).sum_dim_intlist(-1, false, Kind::Float); // [b, t]
    let whole = token_losses(&x).mean(Kind::Float);
    whole.backward();
    let runs = on_ranks((0..2).map(|r| slice_of(&x, r, 2)).collect(), |g, xs| {
        let xs = xs.set_requires_grad(true);
        let loss = sequence::sequence_loss(&g, &token_losses(&xs).sum(Kind::Float), B * T / 2).unwrap();
        loss.backward();
        (loss.double_value(&[]), xs.grad())
    });
    let expected = whole.double_value(&[]);
    let mut grads = Vec::new();
    for (r, (value, grad)) in runs.into_iter().enumerate() {
        assert!((value - expected).abs() <= 1e-5 * expected, "rank {r}: loss {value} vs the rows' {expected}");
        grads.push(grad);
    }
    // The engine averages over the 2 ranks: half of each rank's gradient, side by side, is the whole gradient.
    close(&(Tensor::cat(&grads, 1) / 2.0), &x.grad(), "the averaged gradient");
}

#[test]
fn heads_that_do_not_split_are_refused_by_name() {
    let runs = on_ranks(vec![(); 4], |g, ()| {
        let q = Tensor::zeros([1, 2, 6, 4], (Kind::Float, Device::Cpu));
        sequence::ulysses_attention(&g, &q, &q, &q, attend).unwrap_err().to_string()
    });
    for e in runs {
        assert!(e.contains("6 attention heads do not split over 4 ranks"), "{e}");
    }
}

/// Rotates `x` [b, t, h, d] by its tokens' positions `pos` [t] (as rotary embeddings do, before attention).
fn rotate(x: &Tensor, pos: &Tensor) -> Tensor {
    let angle = pos.to_kind(Kind::Float).reshape([1, -1, 1, 1]) * 0.1;
    x * angle.cos() + x.flip([-1]) * angle.sin()
}

/// Causal attention of q [b, h, t, d] over k, v [b, kv, t, d] at positions 0..t, heads side by side [b, t, h d].
fn plain_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let (b, h, t, d) = q.size4().unwrap();
    let r = h / k.size()[1];
    let (k, v) = (k.repeat_interleave_self_int(r, 1, None), v.repeat_interleave_self_int(r, 1, None));
    let scores = q.matmul(&k.transpose(-2, -1)) / (d as f64).sqrt();
    let mask = Tensor::ones([t, t], (Kind::Bool, Device::Cpu)).triu(1);
    let probs = scores.masked_fill(&mask, f64::NEG_INFINITY).softmax(-1, Kind::Float);
    probs.matmul(&v).transpose(1, 2).reshape([b, t, h * d])
}

#[test]
fn ring_attention_is_the_whole_attention_at_each_ranks_positions() {
    let (heads, kv, t) = (3i64, 1i64, 12i64);
    tch::manual_seed(8);
    let q = Tensor::randn([B, t, heads, D], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let k = Tensor::randn([B, t, kv, D], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let v = Tensor::randn([B, t, kv, D], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let c = Tensor::randn([B, t, heads * D], (Kind::Float, Device::Cpu));
    let all = Tensor::arange(t, (Kind::Int64, Device::Cpu));
    let whole =
        plain_attention(&rotate(&q, &all).transpose(1, 2), &rotate(&k, &all).transpose(1, 2), &v.transpose(1, 2));
    (&whole * &c).sum(Kind::Float).backward();
    for (s, balanced) in [(2usize, true), (3, true), (2, false)] {
        let per_rank: Vec<[Tensor; 4]> = (0..s).map(|_| [&q, &k, &v, &c].map(|x| x.detach())).collect();
        let runs = on_ranks(per_rank, |g, [q, k, v, c]| {
            let pos = if balanced {
                sequence::ring_positions(&g, t).unwrap()
            } else {
                let n = t / g.size() as i64;
                Tensor::arange_start(g.rank() as i64 * n, (g.rank() as i64 + 1) * n, (Kind::Int64, Device::Cpu))
            };
            let take = |x: &Tensor| x.index_select(1, &pos).set_requires_grad(true);
            let (qs, ks, vs) = (take(&q), take(&k), take(&v));
            if balanced {
                assert!(sequence::ring_slice(&g, &q, 1).unwrap().equal(&qs.detach()));
            }
            let y = sequence::ring_attention(
                &g,
                &rotate(&qs, &pos).transpose(1, 2),
                &rotate(&ks, &pos).transpose(1, 2),
                &vs.transpose(1, 2),
                &pos,
            )
            .unwrap();
            (&y * c.index_select(1, &pos)).sum(Kind::Float).backward();
            (pos, y.detach(), qs.grad(), ks.grad(), vs.grad())
        });
        for (r, (pos, y, gq, gk, gv)) in runs.iter().enumerate() {
            let at = |x: &Tensor| x.index_select(1, pos);
            let what = format!("S = {s} (balanced {balanced}), rank {r}");
            close(y, &at(&whole), &format!("{what}: output"));
            close(gq, &at(&q.grad()), &format!("{what}: the queries' gradient"));
            close(gk, &at(&k.grad()), &format!("{what}: the keys' gradient"));
            close(gv, &at(&v.grad()), &format!("{what}: the values' gradient"));
        }
    }
}

#[test]
fn the_engine_counts_rows_over_data_ranks_and_samples_them_per_sequence_group() {
    use zerorun::{Engine, EngineOptions};
    let config: zerorun::Config =
        r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2}"#.parse().unwrap();
    let comms = threads::group(4, Duration::from_secs(30));
    let rows: Vec<(usize, Vec<Vec<usize>>, u64)> = std::thread::scope(|scope| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let config = config.clone();
                scope.spawn(move || {
                    let vs = tch::nn::VarStore::new(Device::Cpu);
                    let _ = vs.root().var("w", &[4], tch::nn::Init::Const(1.0));
                    let engine = Engine::new(&vs, config, Box::new(c), EngineOptions::default()).unwrap();
                    let b = engine.batch_sizes();
                    let micro = engine.sampler(64, 3, true).next_micro_batches(0);
                    (engine.rank(), micro, b.gradient_accumulation_steps)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, micro, accumulation) in &rows {
        // 8 rows over 2 data-parallel ranks of micro-batches of 2: two micro-batches each.
        assert_eq!(*accumulation, 2, "rank {rank}");
        assert_eq!(micro.len(), 2, "rank {rank}");
    }
    assert_eq!(rows[0].1, rows[1].1, "ranks 0 and 1 split the same rows");
    assert_eq!(rows[2].1, rows[3].1, "ranks 2 and 3 split the same rows");
    let (a, b): (Vec<usize>, Vec<usize>) = (rows[0].1.concat(), rows[2].1.concat());
    assert!(a.iter().all(|i| !b.contains(i)), "the two data-parallel ranks take different rows: {a:?} {b:?}");
    // A degree that does not divide the ranks is refused by name.
    let bad: zerorun::Config = r#"{"train_batch_size": 8, "sequence_parallel_size": 3}"#.parse().unwrap();
    let comm = threads::group(1, Duration::from_secs(5)).pop().unwrap();
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let _ = vs.root().var("w", &[4], tch::nn::Init::Const(1.0));
    let e = Engine::new(&vs, bad, Box::new(comm), EngineOptions::default()).err().unwrap().to_string();
    assert!(e.contains("sequence_parallel_size"), "{e}");
}
