//! Experts split over their own ranks at stage 3 (DeepSpeed-MoE's expert-data-parallel groups): with
//! `expert_parallel.autoep_size` E, a unit holding one expert-parallel position's experts is split over the ranks at
//! that position only, gathered and reduced there. Training equals the same program at E = 1 (every unit split over
//! every rank), with less gathered and a checkpoint any degree reads.
use std::path::Path;
use std::rc::Rc;
use std::sync::RwLock;
use std::time::Duration;

use serde_json::json;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use zerorun::runtime::comm::{threads, Communicator};
use zerorun::runtime::moe::{load_balancing_loss, ExpertNames, ExpertParallel, MoeLayer};
use zerorun::{Config, Engine, EngineOptions};

const HIDDEN: i64 = 16;
const FFN: i64 = 24;
const EXPERTS: i64 = 4;
const TOP_K: i64 = 2;
const STEPS: usize = 3;
const ROWS: i64 = 6;

/// libtorch's generator is the process's: models and rows are drawn one seed at a time, under the lock the engine
/// also holds when `load_checkpoint` restores a rank's generator.
fn generator() -> std::sync::MutexGuard<'static, ()> {
    zerorun::generator_lock()
}
/// A checkpointed layer's recomputation sets the process's generator back to its forward's state for a moment:
/// a checkpointed run runs alone, so no other run seeds and draws meanwhile.
static RUNS: RwLock<()> = RwLock::new(());

struct Model {
    embed: nn::Linear,
    moe: MoeLayer,
    head: nn::Linear,
}

fn model(vs: &nn::VarStore) -> Model {
    let _g = generator();
    tch::manual_seed(11);
    let root = vs.root();
    Model {
        embed: nn::linear(&root / "embed", HIDDEN, HIDDEN, Default::default()),
        moe: MoeLayer::new(&(&root / "moe"), ExpertNames::Mixtral, HIDDEN, FFN, EXPERTS, TOP_K),
        head: nn::linear(&root / "head", HIDDEN, 1, Default::default()),
    }
}

/// Rank r's rows at step s, and their targets.
fn batch(rank: usize, step: usize) -> (Tensor, Tensor) {
    let _g = generator();
    tch::manual_seed(100 + 10 * step as i64 + rank as i64);
    (Tensor::randn([ROWS, HIDDEN], (Kind::Float, Device::Cpu)), Tensor::randn([ROWS, 1], (Kind::Float, Device::Cpu)))
}

fn config(e: usize, world: usize) -> Config {
    config_with(e, world, &json!({}))
}

/// The config with `extra`'s keys set over it (`zero_optimization`'s merged key by key).
fn config_with(e: usize, world: usize, extra: &serde_json::Value) -> Config {
    let mut c = json!({
        "train_batch_size": world, "gradient_clipping": 1.0,
        // SGD: a gradient off by any factor shows (Adam would normalise it away).
        // With momentum: a checkpoint carries optimizer states.
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, "zero_allow_untested_optimizer": true,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 200},
        "expert_parallel": {"enabled": e > 1, "autoep_size": e}
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        match (k.as_str(), v.as_object()) {
            ("zero_optimization", Some(z)) => z.iter().for_each(|(z, v)| c[k][z] = v.clone()),
            _ => c[k] = v.clone(),
        }
    }
    Config::from_value(c).unwrap()
}

/// What a rank ends with: every parameter by name, the elements it all-gathered, its peak of gathered bytes.
struct Ran {
    params: Vec<(String, Tensor)>,
    gathered_elements: u64,
    gathered_peak: usize,
    /// The memory report's parameter shard bytes (0 where the shard is on NVMe).
    parameters_in_memory: usize,
}

/// Where a run starts and what it leaves: its steps, the checkpoint it loads first and the one it saves last.
#[derive(Clone, Default)]
struct Span<'a> {
    steps: std::ops::Range<usize>,
    /// Config keys over the test's own.
    with: serde_json::Value,
    load: Option<&'a Path>,
    save: Option<&'a Path>,
    /// The MoE layer's unit is checkpointed, its experts' unit entered inside it (`unit_checkpointed_with`).
    checkpointed: bool,
}

/// One rank's run: the MoE layer's experts in a unit per expert-parallel position, this rank entering its own.
fn rank_run(comm: Box<dyn Communicator>, e: usize, world: usize, span: &Span) -> Engine {
    let group = Rc::new(ExpertParallel::adjacent(comm.as_ref(), e).unwrap());
    let mut vs = nn::VarStore::new(Device::Cpu);
    let m = Rc::new(model(&vs));
    let config = config_with(e, world, &span.with);
    if config.precision() == zerorun::config::Precision::Bf16 {
        vs.bfloat16();
    }
    let mut engine = Engine::new(&vs, config, comm, expert_options(e)).unwrap();
    if let Some(dir) = span.load {
        engine.load_checkpoint(dir, None).unwrap();
    }
    for step in span.steps.clone() {
        train_step(&mut engine, &m, &group, step, span.checkpointed);
    }
    if let Some(dir) = span.save {
        engine.save_checkpoint(dir, None).unwrap();
    }
    engine
}

/// One step; the loss adds transformers' load-balancing term, so the router's logits carry a gradient out of the
/// MoE layer's unit (a second output when it is checkpointed).
fn train_step(engine: &mut Engine, m: &Rc<Model>, group: &Rc<ExpertParallel>, step: usize, checkpointed: bool) {
    let (x, y) = batch(engine.rank(), step);
    let kind = m.head.ws.kind();
    let (x, y) = (x.to_kind(kind), y.to_kind(kind));
    // This rank's experts: the unit of its position.
    let mine = MoeLayer::own_expert_unit("moe", EXPERTS, group);
    let h = engine.unit("embed", |_| m.embed.forward(&x).relu()).unwrap();
    let (moe, router) = if checkpointed {
        let (m, group) = (Rc::clone(m), Rc::clone(group));
        let mut out = engine
            .unit_checkpointed_with("moe.gate", &[&h], move |xs, units| {
                let out = m.moe.forward_parallel_scoped(&group, &xs[0], &mut |experts| units.unit(&mine, experts))?;
                Ok(vec![out.output, out.router_logits])
            })
            .unwrap();
        let router = out.pop().unwrap();
        (out.pop().unwrap(), router)
    } else {
        engine
            .unit("moe.gate", |e| {
                let out = m.moe.forward_parallel_scoped(group, &h, &mut |experts| e.unit(&mine, |_| experts()));
                let out = out.unwrap();
                (out.output, out.router_logits)
            })
            .unwrap()
    };
    let pred = engine.unit("head", |_| m.head.forward(&(&h + moe))).unwrap();
    let balance = load_balancing_loss(&[&router], EXPERTS, TOP_K).to_kind(kind);
    let loss = pred.mse_loss(&y, tch::Reduction::Mean) + 0.02 * balance;
    engine.backward(&loss).unwrap();
    engine.step().unwrap();
}

fn run(e: usize, world: usize, span: Span) -> Vec<Ran> {
    let (_alone, _beside) = match span.checkpointed {
        true => (Some(RUNS.write().unwrap_or_else(|p| p.into_inner())), None),
        false => (None, Some(RUNS.read().unwrap_or_else(|p| p.into_inner()))),
    };
    let comms = threads::group(world, Duration::from_secs(60));
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let span = span.clone();
                s.spawn(move || {
                    let mut engine = rank_run(Box::new(c), e, world, &span);
                    let gathered_elements = engine.comm_volume().all_gather_elements;
                    let gathered_peak = engine.gathered_bytes().peak;
                    let parameters_in_memory =
                        engine.memory_bytes().iter().find(|(c, _)| c.name() == "parameters").map_or(0, |(_, b)| *b);
                    // By name: stage 1 orders its flat buffer so at E = 1, by units where it splits experts.
                    let mut params = engine.full_parameters().unwrap();
                    params.sort_by(|a, b| a.0.cmp(&b.0));
                    Ran { params, gathered_elements, gathered_peak, parameters_in_memory }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn assert_close(got: &[(String, Tensor)], want: &[(String, Tensor)], what: &str) {
    assert_within(got, want, 1e-6, what);
}

fn assert_within(got: &[(String, Tensor)], want: &[(String, Tensor)], tolerance: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: parameters");
    for ((n, a), (m, b)) in got.iter().zip(want) {
        assert_eq!(n, m, "{what}: parameter order");
        let d = (a - b).abs().max().double_value(&[]);
        let scale = b.abs().max().double_value(&[]).max(1.0);
        assert!(d <= tolerance * scale, "{what}: `{n}` differs by {d:e} (largest {scale:e})");
    }
}

#[test]
fn experts_split_over_their_positions_ranks_train_as_every_rank_holding_them() {
    let all = Span { steps: 0..STEPS, ..Default::default() };
    let every = run(1, 4, all.clone());
    let split = run(2, 4, all);
    for (r, (s, a)) in split.iter().zip(&every).enumerate() {
        // Every rank ends with the whole model, the experts included (the units' ranks send them to the others).
        assert_close(&s.params, &a.params, &format!("rank {r}, E = 2 against E = 1"));
        assert_close(&s.params, &split[0].params, &format!("rank {r} against rank 0"));
        // Each rank gathers half the experts (its position's): the experts are 4 x 3 x 16 x 24 of 5,025 elements
        // (of 6,065 with the dense units), so a step gathers far less.
        assert!(
            s.gathered_elements < a.gathered_elements * 7 / 10,
            "rank {r}: gathered {} elements at E = 2, {} at E = 1",
            s.gathered_elements,
            a.gathered_elements
        );
        assert!(
            s.gathered_peak < a.gathered_peak,
            "rank {r}: peak gathered {} vs {}",
            s.gathered_peak,
            a.gathered_peak
        );
    }
}

/// Units split over their position's ranks at E = 2 (`split`) against E = 1 (`every`), rank by rank: the same
/// weights; after each step a rank all-gathers only the units it holds (the dense ones and its position's
/// experts), and it keeps the values of those units only (the dense parameters and half the experts, fp32).
fn assert_split_matches_every(stage: u8, split: &[Ran], every: &[Ran]) {
    for (r, (s, a)) in split.iter().zip(every).enumerate() {
        assert_close(&s.params, &a.params, &format!("stage {stage}, rank {r}, E = 2 against E = 1"));
        assert!(
            s.gathered_elements < a.gathered_elements * 7 / 10,
            "stage {stage}, rank {r}: gathered {} elements at E = 2, {} at E = 1",
            s.gathered_elements,
            a.gathered_elements
        );
        let experts: usize = a.params.iter().filter(|(n, _)| n.contains(".experts.")).map(|(_, t)| t.numel()).sum();
        let expected = a.parameters_in_memory as f64 - 4.0 * experts as f64 / 2.0;
        assert!(
            experts > 0 && (s.parameters_in_memory as f64 - expected).abs() <= 0.01 * expected,
            "stage {stage}, rank {r}: {} bytes of parameters at E = 2, {} at E = 1, {experts} expert elements",
            s.parameters_in_memory,
            a.parameters_in_memory
        );
    }
}

/// `zero_optimization.stage` with `extra`'s keys beside it (its `zero_optimization` keys merged into the stage's).
fn at_stage(stage: u8, extra: serde_json::Value) -> serde_json::Value {
    let mut with = json!({"zero_optimization": {"stage": stage}});
    for (k, v) in extra.as_object().unwrap() {
        match (k.as_str(), v.as_object()) {
            ("zero_optimization", Some(z)) => with[k].as_object_mut().unwrap().extend(z.clone()),
            _ => with[k] = v.clone(),
        }
    }
    with
}

/// Stage 2 with units: each position's experts reduced over their own ranks, and each rank steps and all-gathers
/// its chunk over them. A rank outside a unit keeps none of its values: they leave the engine from the unit's
/// ranks (the full parameters below).
#[test]
fn at_stage_2_experts_split_over_their_positions_ranks_train_as_every_rank_holding_them() {
    let stage2 = |e, checkpointed| {
        let with = json!({"zero_optimization": {"stage": 2}});
        run(e, 4, Span { steps: 0..STEPS, with, checkpointed, ..Default::default() })
    };
    let every = stage2(1, false);
    let split = stage2(2, false);
    assert_split_matches_every(2, &split, &every);
    for (r, (c, a)) in stage2(2, true).iter().zip(&every).enumerate() {
        assert_close(&c.params, &a.params, &format!("stage 2, rank {r}, checkpointed at E = 2 against E = 1"));
    }
    // The optimizer on a copy of the rank's pieces (offloaded), and bf16's fp32 master, write back into the
    // rank's own units.
    let with = |extra: serde_json::Value| Span { steps: 0..STEPS, with: at_stage(2, extra), ..Default::default() };
    let offloaded = with(json!({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}));
    for (r, (o, a)) in run(2, 4, offloaded).iter().zip(&every).enumerate() {
        assert_close(&o.params, &a.params, &format!("stage 2 offloaded, rank {r}: E = 2 against E = 1"));
    }
    // All-reduced instead of reduce-scattered: each rank keeps its part by its place in the unit's group (it took
    // its place in the world, past the group's end, before).
    let all_reduced = with(json!({"zero_optimization": {"reduce_scatter": false}}));
    for (r, (o, a)) in run(2, 4, all_reduced).iter().zip(&every).enumerate() {
        assert_close(&o.params, &a.params, &format!("stage 2 all-reduced, rank {r}: E = 2 against E = 1"));
    }
    let bf16 = with(json!({"bf16": {"enabled": true}}));
    for (r, (s, a)) in run(2, 4, bf16.clone()).iter().zip(&run(1, 4, bf16)).enumerate() {
        assert_within(&s.params, &a.params, 2e-3, &format!("stage 2 bf16, rank {r}: E = 2 against E = 1"));
    }
}

/// Stage 1 with units: stage 2's layout (each rank keeps the dense units and its position's experts), stage 1's
/// reduction: autograd accumulates the micro-batches in `.grad`, and each held unit is reduced over its own ranks
/// after backward. Equal to E = 1 (the flat buffer, every expert on every rank) in fp32, with accumulation,
/// checkpointed, offloaded, overlapped, all-reduced, and in bf16.
#[test]
fn at_stage_1_experts_split_over_their_positions_ranks_train_as_every_rank_holding_them() {
    let stage1 = |e, extra: serde_json::Value, checkpointed, steps| {
        run(e, 4, Span { steps: 0..steps, with: at_stage(1, extra), checkpointed, ..Default::default() })
    };
    let every = stage1(1, json!({}), false, STEPS);
    let split = stage1(2, json!({}), false, STEPS);
    assert_split_matches_every(1, &split, &every);
    // Two micro-batches a step: the gradients of both are reduced once, at the boundary.
    let accumulating = json!({"train_batch_size": 8, "gradient_accumulation_steps": 2});
    let (one, two) = (stage1(1, accumulating.clone(), false, 4), stage1(2, accumulating, false, 4));
    for (r, (s, a)) in two.iter().zip(&one).enumerate() {
        assert_close(&s.params, &a.params, &format!("stage 1 accumulating, rank {r}: E = 2 against E = 1"));
    }
    for (r, (c, a)) in stage1(2, json!({}), true, STEPS).iter().zip(&every).enumerate() {
        assert_close(&c.params, &a.params, &format!("stage 1, rank {r}, checkpointed at E = 2 against E = 1"));
    }
    // Offloaded; reducing on the communication thread; all-reducing instead of reduce-scattering.
    for zero in [
        json!({"offload_optimizer": {"device": "cpu"}}),
        json!({"overlap_comm": true}),
        json!({"reduce_scatter": false}),
    ] {
        for (r, (o, a)) in stage1(2, json!({ "zero_optimization": zero }), false, STEPS).iter().zip(&every).enumerate()
        {
            assert_close(&o.params, &a.params, &format!("stage 1 with {zero}, rank {r}: E = 2 against E = 1"));
        }
    }
    let bf16 = json!({"bf16": {"enabled": true}});
    for (r, (s, a)) in stage1(2, bf16.clone(), false, STEPS).iter().zip(&stage1(1, bf16, false, STEPS)).enumerate() {
        assert_within(&s.params, &a.params, 2e-3, &format!("stage 1 bf16, rank {r}: E = 2 against E = 1"));
    }
}

/// Where what stage 1 runs covers the whole flat buffer (PowerSGD's factors, a frozen parameter the split refuses),
/// it keeps every expert on every rank, as at E = 1, and trains; with nothing in the way it splits them.
#[test]
fn stage_1_keeps_the_flat_buffer_where_what_it_runs_covers_it() {
    let held = |e: usize, extra: serde_json::Value, frozen: bool| {
        on_ranks(move |comm| {
            let group = Rc::new(ExpertParallel::adjacent(comm.as_ref(), e).unwrap());
            let vs = nn::VarStore::new(Device::Cpu);
            let m = Rc::new(model(&vs));
            if frozen {
                let _ = m.embed.bs.as_ref().unwrap().shallow_clone().set_requires_grad(false);
            }
            let with = at_stage(1, extra.clone());
            let mut engine = Engine::new(&vs, config_with(e, 2, &with), comm, expert_options(e)).unwrap();
            for step in 0..2 {
                train_step(&mut engine, &m, &group, step, false);
            }
            let bytes = engine.memory_bytes().iter().find(|(c, _)| c.name() == "parameters").map_or(0, |(_, b)| *b);
            bytes.to_string()
        })
    };
    let powersgd = json!({"gradient_compression": {"type": "powersgd", "matrix_approximation_rank": 2}});
    for (what, extra, frozen) in
        [("nothing", json!({}), false), ("PowerSGD", powersgd, false), ("frozen", json!({}), true)]
    {
        let (flat, at_2) = (held(1, extra.clone(), frozen), held(2, extra, frozen));
        let split = what == "nothing";
        for (r, (a, b)) in flat.iter().zip(&at_2).enumerate() {
            let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
            assert_eq!(b < a, split, "{what}, rank {r}: {b} bytes of parameters at E = 2, {a} at E = 1");
        }
    }
}

#[test]
fn a_checkpointed_layer_enters_its_split_experts_again_in_backward_and_trains_as_without() {
    let all = Span { steps: 0..STEPS, ..Default::default() };
    let every = run(1, 4, all.clone());
    let checkpointed = Span { checkpointed: true, ..all };
    // E = 2: the experts' unit, split over its position's ranks, is gathered again inside the layer's recomputation;
    // the router's logits leave the checkpoint with their gradient (the load-balancing term).
    for e in [2, 1] {
        for (r, (c, a)) in run(e, 4, checkpointed.clone()).iter().zip(&every).enumerate() {
            assert_close(&c.params, &a.params, &format!("rank {r}, checkpointed at E = {e} against E = 1"));
        }
    }
}

#[test]
fn a_checkpoint_of_experts_split_over_their_ranks_resumes_at_another_degree() {
    let scratch = std::env::temp_dir().join(format!("zerorun-expert-dp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let whole = run(1, 4, Span { steps: 0..STEPS, ..Default::default() });
    // E 2 -> 1 and 1 -> 2 at step 2 of 3, at stage 3 and across stages 1-3: the experts' values and momentum
    // come back where the other degree holds them (by name and range from the ranks that saved them).
    let stage = |s: u8| json!({"zero_optimization": {"stage": s}});
    for ((saved_at, saved_stage), (resumed_at, resumed_stage)) in
        [((2, 3), (1, 3)), ((1, 3), (2, 3)), ((2, 2), (1, 3)), ((1, 3), (2, 2)), ((2, 1), (1, 3)), ((1, 1), (2, 1))]
    {
        let dir = scratch.join(format!("e{saved_at}-{saved_stage}-{resumed_stage}"));
        let with = stage(saved_stage);
        run(saved_at, 4, Span { steps: 0..STEPS - 1, save: Some(&dir), with, ..Default::default() });
        let (with, load) = (stage(resumed_stage), Some(dir.as_path()));
        let resumed = run(resumed_at, 4, Span { steps: STEPS - 1..STEPS, load, with, ..Default::default() });
        for (r, (got, want)) in resumed.iter().zip(&whole).enumerate() {
            assert_close(
                &got.params,
                &want.params,
                &format!(
                    "rank {r}: saved at E = {saved_at} (stage {saved_stage}), resumed at E = {resumed_at} (stage {resumed_stage})"
                ),
            );
        }
    }
    std::fs::remove_dir_all(&scratch).ok();
}

/// On every one of 2 thread ranks: `f(rank's comm)`'s error text.
fn on_ranks(f: impl Fn(Box<dyn Communicator>) -> String + Sync) -> Vec<String> {
    let comms = threads::group(2, Duration::from_secs(30));
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(Box::new(c)))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn expert_options(e: usize) -> EngineOptions {
    let mut units = vec![vec!["embed".to_string()], vec!["moe.gate".to_string()], vec!["head".to_string()]];
    units.extend(MoeLayer::expert_units("moe", EXPERTS, e));
    EngineOptions { units: Some(units), ..Default::default() }
}

/// A walk over the engine's units (never reached: the engine refuses the walk first).
struct Walk(Vec<Vec<String>>);

impl zerorun::UnitModel for Walk {
    fn unit_prefixes(&self) -> Vec<Vec<String>> {
        self.0.clone()
    }
    fn forward_unit(&self, _unit: usize, x: &Tensor) -> Tensor {
        x.shallow_clone()
    }
}

#[test]
fn what_experts_split_over_their_ranks_cannot_do_is_refused_by_name() {
    // The walk runs every unit on every rank; a rank entering another position's experts; a frozen parameter and
    // hpZ at start-up.
    let errors = on_ranks(|comm| {
        let vs = nn::VarStore::new(Device::Cpu);
        let _m = model(&vs);
        let options = expert_options(2);
        let walk = Walk(options.units.clone().unwrap());
        let mut engine = Engine::new(&vs, config(2, 2), comm, options).unwrap();
        let x = Tensor::zeros([2, HIDDEN], (Kind::Float, Device::Cpu));
        let walked = engine.forward(&walk, &x).unwrap_err().to_string();
        let theirs = MoeLayer::expert_units("moe", EXPERTS, 2)[1 - engine.rank()][0].clone();
        let entered = engine.unit(&theirs, |_| x.shallow_clone()).unwrap_err().to_string();
        format!("{walked}\n{entered}")
    });
    // Stage 1 keeps no storage for another position's experts either.
    let at_stage_1 = on_ranks(|comm| {
        let vs = nn::VarStore::new(Device::Cpu);
        let _m = model(&vs);
        let c = config_with(2, 2, &at_stage(1, json!({})));
        let mut engine = Engine::new(&vs, c, comm, expert_options(2)).unwrap();
        let theirs = MoeLayer::expert_units("moe", EXPERTS, 2)[1 - engine.rank()][0].clone();
        let x = Tensor::zeros([2, HIDDEN], (Kind::Float, Device::Cpu));
        engine.unit(&theirs, |_| x.shallow_clone()).unwrap_err().to_string()
    });
    for (r, e) in at_stage_1.iter().enumerate() {
        let says = format!("on rank {r}: the unit holds experts of another expert-parallel position");
        assert!(e.contains(&says), "stage 1, rank {r}: {e}");
    }
    for (r, e) in errors.iter().enumerate() {
        assert!(e.contains("engine.forward walks every unit on every rank"), "rank {r}: {e}");
        assert!(
            e.contains(&format!("on rank {r}: the unit holds experts of another expert-parallel position")),
            "rank {r}: {e}"
        );
    }
    let errors = on_ranks(|comm| {
        let vs = nn::VarStore::new(Device::Cpu);
        let m = model(&vs);
        let _ = m.embed.bs.as_ref().unwrap().shallow_clone().set_requires_grad(false);
        Engine::new(&vs, config(2, 2), comm, expert_options(2)).err().unwrap().to_string()
    });
    assert!(errors.iter().all(|e| e.starts_with("parameter `embed.bias`: is frozen")), "{errors:?}");
    let errors = on_ranks(|comm| {
        let vs = nn::VarStore::new(Device::Cpu);
        let _m = model(&vs);
        let c = config_with(2, 2, &json!({"zero_optimization": {"zero_hpz_partition_size": 2}}));
        Engine::new(&vs, c, comm, expert_options(2)).err().unwrap().to_string()
    });
    assert!(
        errors.iter().all(|e| e.contains("`expert_parallel.autoep_size` = 2: with hpZ or quantized weights")),
        "{errors:?}"
    );
}

#[test]
fn experts_split_over_their_ranks_step_in_backward_and_train_in_bf16() {
    // The optimizer in backward steps each unit's part as its reduction lands: bitwise the whole step at E = 2
    // (no clipping: it needs every gradient first), and E = 1's within rounding.
    let span = |with: serde_json::Value| Span { steps: 0..STEPS, with, ..Default::default() };
    let plain = span(json!({"gradient_clipping": 0.0}));
    let in_backward = span(json!({"optimizer_in_backward": true, "gradient_clipping": 0.0}));
    let (whole, pieces, every) = (run(2, 4, plain.clone()), run(2, 4, in_backward), run(1, 4, plain));
    for (r, ((w, p), a)) in whole.iter().zip(&pieces).zip(&every).enumerate() {
        for ((n, x), (_, y)) in p.params.iter().zip(&w.params) {
            assert!(x.equal(y), "rank {r}: `{n}` stepped in backward differs from the whole step");
        }
        assert_within(&p.params, &a.params, 1e-5, &format!("in backward, rank {r}: E = 2 against E = 1"));
    }
    // bf16 reduces in bf16, so E = 1 and E = 2 round differently (a gradient off by a factor would be ~1e-2 off).
    let bf16 = span(json!({"bf16": {"enabled": true}}));
    let (split, every) = (run(2, 4, bf16.clone()), run(1, 4, bf16));
    for (r, (s, a)) in split.iter().zip(&every).enumerate() {
        assert_within(&s.params, &a.params, 2e-3, &format!("bf16, rank {r}: E = 2 against E = 1"));
    }
}

#[test]
fn experts_split_over_their_ranks_train_from_nvme_as_from_memory() {
    // Every chunk on NVMe (max_in_cpu 0) and the states too: a rank's chunks of other positions' experts are
    // empty, never read; the weights are bitwise those in memory.
    let swap = std::env::temp_dir().join(format!("zerorun-expert-dp-nvme-{}", std::process::id()));
    std::fs::create_dir_all(&swap).unwrap();
    let nvme = json!({"zero_optimization": {
        "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0},
        "offload_optimizer": {"device": "nvme", "nvme_path": swap}
    }});
    let memory = run(2, 4, Span { steps: 0..STEPS, ..Default::default() });
    let on_nvme = run(2, 4, Span { steps: 0..STEPS, with: nvme, ..Default::default() });
    for (r, (n, m)) in on_nvme.iter().zip(&memory).enumerate() {
        assert!(m.parameters_in_memory > 0 && n.parameters_in_memory == 0, "rank {r}: the shard is on NVMe");
        for ((name, a), (_, b)) in n.params.iter().zip(&m.params) {
            assert!(a.equal(b), "rank {r}: `{name}` from NVMe differs from memory");
        }
    }
    // Stages 1-2: the states on NVMe step each unit's chunk where the rank's own units lie in its parameter buffer.
    for stage in [2, 1] {
        let at = |with: serde_json::Value| run(2, 4, Span { steps: 0..STEPS, with, ..Default::default() });
        let states = json!({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": swap}}});
        let (on_nvme, memory) = (at(at_stage(stage, states)), at(at_stage(stage, json!({}))));
        for (r, (n, m)) in on_nvme.iter().zip(&memory).enumerate() {
            for ((name, a), (_, b)) in n.params.iter().zip(&m.params) {
                assert!(a.equal(b), "stage {stage}, rank {r}: `{name}` with the states on NVMe differs from memory");
            }
        }
    }
    std::fs::remove_dir_all(&swap).ok();
}
