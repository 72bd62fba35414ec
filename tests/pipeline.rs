//! Pipeline parallelism: the example GPT cut into stages (GPipe, 1F1B, interleaved 1F1B; ZeRO 0-2 over each
//! stage's data-parallel group) ends at the parameters of a single-process tch loop with libtorch's AdamW and
//! gradient clipping on the same global batches, within 1e-5 relative: the loss reaches every stage's gradients,
//! the clipping norm is the whole pipeline's, and the micro-batches reassemble the global batch. The config keys
//! `pipeline.stages`, `pipeline.schedule`, `pipeline.virtual_stages`, `pipeline.partition` and
//! `pipeline.allow_fewer_micro_batches` act here, and bad setups fail with errors that say what to change.
use std::time::Duration;

use serde_json::{json, Value};
use tch::nn::{self, OptimizerConfig};
use tch::Tensor;
use zerorun::runtime::comm::threads;
use zerorun::{Config, Engine, EngineOptions, Mesh, MeshOptions, MicroBatch, StagePlacement};

#[path = "common/compare.rs"]
mod compare;
use compare::{full_parameters, max_relative_difference, sorted_values};

#[path = "../examples/support/mod.rs"]
mod support;
use support::gpt_model::{pipeline_model, pipeline_model_tied, Corpus, Gpt, GptConfig};

const GLOBAL_BATCH: u64 = 12;
const STEPS: u64 = 6;
const LR: f64 = 3e-3;
/// Small enough that every step clips: a per-stage norm would give other updates.
const CLIP: f64 = 0.5;
const SEED: u64 = 11;

fn gpt_config(corpus: &Corpus) -> GptConfig {
    GptConfig { vocab: corpus.vocab, block: 8, layers: 4, heads: 2, embd: 16 }
}

/// Parameters by name, sorted, as f32 values.
type Params = Vec<(String, Vec<f32>)>;
/// What a rank returns: rank 0's full parameters and last loss, and every rank's skipped steps.
type RankResult = Result<(Option<(Vec<(String, Tensor)>, f64)>, u64), String>;

/// Single process, whole batches, libtorch's AdamW.
fn reference(corpus: &Corpus) -> Vec<(String, Vec<f32>)> {
    reference_of(corpus, false)
}

/// `tied`: the head is the token embedding (the untrained `head` variables are left out).
fn reference_of(corpus: &Corpus, tied: bool) -> Vec<(String, Vec<f32>)> {
    let cfg = gpt_config(corpus);
    let (vs, gpt) = support::build_model(SEED, None, |vs| Gpt::new(vs.root(), &cfg)).unwrap();
    let mut opt = nn::AdamW { beta1: 0.9, beta2: 0.999, wd: 0.0, eps: 1e-8, amsgrad: false }.build(&vs, LR).unwrap();
    for step in 0..STEPS {
        let (x, y) = corpus.batch(SEED, step, GLOBAL_BATCH, 0..GLOBAL_BATCH as usize, cfg.block);
        let logits = if tied { gpt.forward_tied(&x) } else { gpt.forward(&x) };
        let loss = logits.view([-1, cfg.vocab]).cross_entropy_for_logits(&y.view([-1]));
        opt.zero_grad();
        loss.backward();
        opt.clip_grad_norm(CLIP);
        opt.step();
    }
    sorted_values(vs.variables().into_iter().filter(|(n, _)| !(tied && n.starts_with("head."))).collect())
}

fn config(stage: u8, gas: u64, pipeline: Value, extra: Value) -> Config {
    let mut v = json!({
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
        "pipeline": pipeline,
        "comms_timeout": 20,
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    Config::from_value(v).unwrap()
}

/// What rank 0 ends with: the full parameters and the last loss; or the first rank's error.
fn run_pipeline(
    corpus: &Corpus,
    world: usize,
    config: &Config,
    program_stages: Option<usize>,
    before_training: impl Fn(usize) -> bool + Sync,
) -> Result<(Params, f64), String> {
    run_model(corpus, world, config, program_stages, before_training, pipeline_model)
}

fn run_model(
    corpus: &Corpus,
    world: usize,
    config: &Config,
    program_stages: Option<usize>,
    before_training: impl Fn(usize) -> bool + Sync,
    make: fn(&GptConfig) -> zerorun::PipelineModel<'static>,
) -> Result<(Params, f64), String> {
    let run = Run { steps: 0..STEPS, load_from: None, save_to: None, report_to: None };
    run_with(corpus, world, config, program_stages, before_training, make, &run)
}

/// Which steps a run trains, and the checkpoint it starts from and ends with.
struct Run<'p> {
    steps: std::ops::Range<u64>,
    load_from: Option<&'p std::path::Path>,
    save_to: Option<&'p std::path::Path>,
    /// Write the memory report here at the end (rank 0 returns the table as the loss's companion).
    report_to: Option<&'p std::path::Path>,
}

fn run_with(
    corpus: &Corpus,
    world: usize,
    config: &Config,
    program_stages: Option<usize>,
    before_training: impl Fn(usize) -> bool + Sync,
    make: fn(&GptConfig) -> zerorun::PipelineModel<'static>,
    run: &Run<'_>,
) -> Result<(Params, f64), String> {
    let cfg = gpt_config(corpus);
    let results: Vec<RankResult> = std::thread::scope(|s| {
        let handles: Vec<_> = threads::group(world, Duration::from_secs_f64(config.comms_timeout))
            .into_iter()
            .map(|comm| {
                let before_training = &before_training;
                s.spawn(move || {
                    use zerorun::runtime::comm::Communicator;
                    let rank = comm.rank();
                    let options = MeshOptions { pipeline_stages: program_stages, ..Default::default() };
                    let mesh = Mesh::from_config(Box::new(comm), config, options).map_err(|e| e.to_string())?;
                    let placement = StagePlacement::of(&mesh, &config.pipeline);
                    let (mut vs, stage) = support::build_model(SEED, None, |vs| {
                        make(&cfg).build_stage(vs, &placement, &config.pipeline.partition)
                    })?;
                    let stage = stage.map_err(|e| e.to_string())?;
                    support::to_config_precision(config, &mut vs);
                    let mut pipe = zerorun::initialize_pipeline(&vs, config.clone(), mesh, stage, Default::default())
                        .map_err(|e| e.to_string())?;
                    if !before_training(rank) {
                        return Ok((None, 0));
                    }
                    if let Some(dir) = run.load_from {
                        pipe.load_checkpoint(dir, None).map_err(|e| format!("rank {rank}: {e}"))?;
                        assert_eq!(pipe.engine().global_steps(), run.steps.start, "the checkpoint's step");
                    }
                    let b = pipe.engine().batch_sizes();
                    let mut last_loss = f64::NAN;
                    for step in run.steps.clone() {
                        let mut micro_batches = (0..b.gradient_accumulation_steps).map(|m| {
                            let range = support::micro_batch_range(
                                placement.data_index,
                                placement.data_parallel,
                                m,
                                b.train_micro_batch_size_per_gpu,
                            );
                            let (x, y) = corpus.batch(SEED, step, GLOBAL_BATCH, range, cfg.block);
                            MicroBatch {
                                inputs: placement.takes_inputs().then_some(x),
                                labels: placement.takes_labels().then_some(y),
                            }
                        });
                        let outcome = pipe.train_batch(&mut micro_batches).map_err(|e| format!("rank {rank}: {e}"))?;
                        if let zerorun::StepOutcome::Stepped { loss, .. } = outcome {
                            last_loss = loss;
                        }
                    }
                    if let Some(dir) = run.save_to {
                        pipe.save_checkpoint(dir, None).map_err(|e| format!("rank {rank}: {e}"))?;
                    }
                    if let Some(dir) = run.report_to {
                        let files = pipe.write_memory_report(dir).map_err(|e| e.to_string())?;
                        assert_eq!(files.table.is_some(), rank == 0);
                    }
                    // Asynchronous training ends with every rank holding the final values (a no-op otherwise).
                    pipe.finish().map_err(|e| e.to_string())?;
                    let params = pipe.full_parameters().map_err(|e| e.to_string())?;
                    Ok(((rank == 0).then_some((params, last_loss)), pipe.engine().skipped_steps()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into()))).collect()
    });
    let mut out = None;
    let mut skipped = Vec::new();
    for r in results {
        let (v, s) = r?;
        skipped.push(s);
        if let Some(v) = v {
            out = Some(v);
        }
    }
    if skipped.iter().any(|&s| s != skipped[0]) {
        return Err(format!("the ranks skipped different numbers of steps: {skipped:?}"));
    }
    let (params, loss) = out.ok_or("rank 0 returned nothing")?;
    SKIPPED.with(|c| c.set(skipped[0]));
    Ok((sorted_values(params), loss))
}

thread_local! {
    /// The steps the last run on this thread skipped (the same on every rank, or the run is an error).
    static SKIPPED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// One rank, no pipeline: the whole GPT in a plain engine at 4 micro-batches per step over `steps`, from the
/// checkpoint in `load` when given. Returns the parameters and the last step's loss.
fn plain_engine(
    corpus: &Corpus,
    config: &Config,
    steps: std::ops::Range<u64>,
    load: Option<&std::path::Path>,
) -> (Params, f64) {
    let cfg = gpt_config(corpus);
    let (mut vs, gpt) = support::build_model(SEED, None, |vs| Gpt::new(vs.root(), &cfg)).unwrap();
    support::to_config_precision(config, &mut vs);
    let comm = Box::new(threads::group(1, Duration::from_secs(20)).remove(0));
    let mut engine = Engine::new(&vs, config.clone(), comm, EngineOptions::default()).unwrap();
    if let Some(dir) = load {
        engine.load_checkpoint(dir, None).unwrap();
    }
    let mut loss = f64::NAN;
    for step in steps {
        for m in 0..4 {
            let (x, y) = corpus.batch(SEED, step, GLOBAL_BATCH, support::micro_batch_range(0, 1, m, 3), cfg.block);
            let logits = gpt.forward(&x).to_kind(tch::Kind::Float);
            engine.backward(&logits.view([-1, cfg.vocab]).cross_entropy_for_logits(&y.view([-1]))).unwrap();
            if let zerorun::StepOutcome::Stepped { loss: l, .. } = engine.step().unwrap() {
                loss = l;
            }
        }
    }
    (full_parameters(&mut engine), loss)
}

fn train_all(_: usize) -> bool {
    true
}

#[test]
fn every_schedule_and_zero_stage_matches_single_process_adamw() {
    let corpus = Corpus::load();
    let reference = reference(&corpus);
    // (world, stages, accumulation, ZeRO stage, pipeline section)
    let runs: Vec<(usize, usize, u64, u8, Value)> = vec![
        (2, 2, 4, 0, json!({})),
        (2, 2, 4, 1, json!({"schedule": "1f1b"})),
        (2, 2, 4, 2, json!({"schedule": "gpipe"})),
        (4, 2, 2, 1, json!({"schedule": "1f1b"})),
        (4, 2, 3, 2, json!({"schedule": "1f1b"})),
        (4, 4, 4, 1, json!({"schedule": "gpipe"})),
        (4, 4, 6, 2, json!({"schedule": "1f1b", "partition": "uniform"})),
        (2, 2, 4, 2, json!({"schedule": "interleaved", "virtual_stages": 2})),
        (3, 3, 3, 1, json!({"schedule": "interleaved", "virtual_stages": 2})),
        (6, 3, 3, 2, json!({"schedule": "1f1b", "partition": "type:^blocks"})),
    ];
    for (world, stages, gas, stage, pipeline) in runs {
        let what = format!("{world} ranks, {stages} stages, {gas} micro-batches, ZeRO {stage}, pipeline {pipeline}");
        let c = config(stage, gas, pipeline, json!({}));
        let (params, _) =
            run_pipeline(&corpus, world, &c, Some(stages), train_all).unwrap_or_else(|e| panic!("{what}: {e}"));
        let d = max_relative_difference(&params, &reference);
        assert!(d < 1e-5, "{what}: max relative difference {d}");
    }
}

#[test]
fn a_head_tied_to_the_embedding_trains_as_one_weight() {
    let corpus = Corpus::load();
    let reference = reference_of(&corpus, true);
    // The tied model is touchier than the untied one: one stage on two data-parallel ranks already ends 4e-5 from
    // the reference (AdamW amplifies the reduction order's rounding of near-zero gradients), so 1e-4 here; a
    // replica's gradient left out moves the weights by far more.
    // The embedding on stage 0, the head on the last: a replica, its gradient sent to stage 0 before stage 0's last
    // backward, the new value sent back after the step; the norm counts the weight once. Also on one stage (no
    // exchange) and on the same stages' data-parallel replicas.
    for (world, stages, gas, stage, schedule) in
        [(2, 1, 2, 1, "1f1b"), (2, 2, 4, 1, "1f1b"), (4, 4, 4, 2, "gpipe"), (4, 2, 2, 0, "1f1b")]
    {
        let c = config(stage, gas, json!({"schedule": schedule}), json!({}));
        let (params, _) = run_model(&corpus, world, &c, Some(stages), train_all, pipeline_model_tied)
            .unwrap_or_else(|e| panic!("{world} ranks, {stages} stages: {e}"));
        let d = max_relative_difference(&params, &reference);
        assert!(d < 1e-4, "{world} ranks, {stages} stages, ZeRO {stage}, {schedule}: max relative difference {d}");
    }
    let c = config(1, 4, json!({"schedule": "interleaved"}), json!({}));
    let e = run_model(&corpus, 2, &c, Some(2), train_all, pipeline_model_tied).unwrap_err();
    assert!(e.contains("tied weights across stages run with the gpipe and 1f1b schedules"), "{e}");
}

#[test]
fn checkpoints_resume_at_another_cut_and_degree_and_without_a_pipeline() {
    let corpus = Corpus::load();
    let reference = reference(&corpus);
    let half = STEPS / 2;
    let dir = tempdir("reshard");
    // (pipe 2, data 2), ZeRO 2 (each stage's optimizer state partitioned over its data group), half the steps.
    let saving = config(2, 2, json!({}), json!({}));
    let first = Run { steps: 0..half, load_from: None, save_to: Some(&dir), report_to: Some(&dir) };
    let (at_half, _) = run_with(&corpus, 4, &saving, Some(2), train_all, pipeline_model, &first).unwrap();
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(format!("global_step{half}/manifest.json"))).unwrap())
            .unwrap();
    assert_eq!(manifest["pipeline_stages"], 2);
    // The memory report: one file per rank of the job, each with its stage, layers and times.
    for rank in 0..4 {
        let report: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(format!("memory_rank{rank}.json"))).unwrap())
                .unwrap();
        assert_eq!((report["rank"].as_u64(), report["world_size"].as_u64()), (Some(rank), Some(4)));
        let stage = &report["pipeline"];
        assert_eq!(stage["stage"].as_u64(), Some(rank / 2));
        assert_eq!(stage["layers"], if rank < 2 { "embed..blocks.1" } else { "blocks.2..head" });
        assert!(stage["compute_us"].as_u64().unwrap() > 0 && stage["step_us"].as_u64() >= stage["compute_us"].as_u64());
    }
    // `zerorun consolidate` assembles the whole model from the stages' files.
    let out = dir.join("full.safetensors");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["consolidate", dir.to_str().unwrap(), out.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(status.success());
    let consolidated = sorted_values(Tensor::read_safetensors(&out).unwrap());
    assert_eq!(max_relative_difference(&consolidated, &at_half), 0.0);
    // The rest at (pipe 4, data 1) and at (pipe 1, data 2), ZeRO 1; both end at the reference.
    for (world, stages, stage, gas) in [(4, 4, 1, 4), (2, 1, 1, 2)] {
        let c = config(stage, gas, json!({}), json!({}));
        let rest = Run { steps: half..STEPS, load_from: Some(&dir), save_to: None, report_to: None };
        let (params, _) = run_with(&corpus, world, &c, Some(stages), train_all, pipeline_model, &rest)
            .unwrap_or_else(|e| panic!("resuming at {stages} stages on {world} ranks: {e}"));
        let d = max_relative_difference(&params, &reference);
        assert!(d < 1e-5, "resumed at {stages} stages on {world} ranks: max relative difference {d}");
    }
    // And in a plain engine, one rank, the whole model.
    let (resumed, _) = plain_engine(&corpus, &config(1, 4, json!({}), json!({})), half..STEPS, Some(&dir));
    let d = max_relative_difference(&resumed, &reference);
    assert!(d < 1e-5, "resumed without a pipeline: max relative difference {d}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zerorun-pipeline-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_pipeline_section_alone_sets_the_stages_and_the_cut() {
    let corpus = Corpus::load();
    let reference = reference(&corpus);
    // 6 layers (embeddings, 4 blocks, head) cut by explicit boundaries; no program value for the stages.
    let c = config(1, 4, json!({"stages": 2, "partition": [0, 1, 6]}), json!({}));
    let (params, _) = run_pipeline(&corpus, 2, &c, None, train_all).unwrap();
    assert!(max_relative_difference(&params, &reference) < 1e-5);
    let cfg = gpt_config(&corpus);
    let placement = StagePlacement::new(&c.pipeline, None, 1, 2).unwrap();
    let (_vs, stage) =
        support::build_model(SEED, None, |vs| pipeline_model(&cfg).build_stage(vs, &placement, &c.pipeline.partition))
            .unwrap();
    assert_eq!(stage.unwrap().layers().to_vec(), vec![1usize..6]);
}

#[test]
fn bf16_stages_train_like_one_bf16_rank() {
    let corpus = Corpus::load();
    let bf16 = json!({"bf16": {"enabled": true}});
    let c = config(1, 4, json!({}), bf16.clone());
    let (pipelined, pipe_loss) = run_pipeline(&corpus, 2, &c, Some(2), train_all).unwrap();
    // One rank, no pipeline, the same model and batches.
    let (single, loss) = plain_engine(&corpus, &config(1, 4, json!({}), bf16), 0..STEPS, None);
    // bf16 rounds the residual stream's gradient sums in another order across the cut: a few ulps, no more.
    assert!((pipe_loss - loss).abs() < 1e-2, "loss {pipe_loss} vs {loss}");
    let d = max_relative_difference(&pipelined, &single);
    assert!(d < 3e-2, "max relative difference {d}");
}

#[test]
fn an_fp16_overflow_on_any_stage_skips_the_step_on_every_rank() {
    let corpus = Corpus::load();
    // A loss scale of 2^40 overflows fp16 gradients on every stage at first; each skip halves it (hysteresis 1)
    // until steps are taken. Every rank must skip the same steps; the run then trains to a finite loss.
    let fp16 = json!({"fp16": {"enabled": true, "initial_scale_power": 22, "hysteresis": 1, "loss_scale_window": 100}});
    for (world, stages, gas, stage) in [(2, 2, 4, 1), (4, 2, 2, 2), (4, 4, 4, 0)] {
        let c = config(stage, gas, json!({}), fp16.clone());
        let (params, loss) = run_pipeline(&corpus, world, &c, Some(stages), train_all)
            .unwrap_or_else(|e| panic!("{world} ranks, {stages} stages: {e}"));
        let skipped = SKIPPED.with(|c| c.get());
        assert!((1..STEPS).contains(&skipped), "{world} ranks, {stages} stages: {skipped} steps skipped");
        assert!(loss.is_finite() && params.iter().all(|(_, v)| v.iter().all(|x| x.is_finite())));
    }
}

/// `async_training` inside a pipeline: each stage's engine runs the mode over its data-parallel group. Bounded
/// staleness 0 at stage 1 ends where the synchronous pipeline does, local SGD every step with plain SGD where
/// synchronous SGD does (2 stages x 2 data-parallel ranks, clipping off: it needs one step's global norm); a
/// checkpoint between local SGD's meetings is refused on every rank.
#[test]
fn asynchronous_modes_run_inside_pipeline_stages() {
    let corpus = Corpus::load();
    let pipe = json!({"stages": 2});
    let off = json!({"gradient_clipping": 0});
    let with =
        |mode: Value, optimizer: Value| json!({"gradient_clipping": 0, "async_training": mode, "optimizer": optimizer});
    let adamw = json!({"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}});
    let (sync, _) = run_pipeline(&corpus, 4, &config(1, 2, pipe.clone(), off.clone()), None, train_all).unwrap();
    let ssp = with(json!({"mode": "bounded_staleness", "staleness": 0}), adamw);
    let (fresh, _) = run_pipeline(&corpus, 4, &config(1, 2, pipe.clone(), ssp), None, train_all).unwrap();
    let d = max_relative_difference(&fresh, &sync);
    assert!(d < 1e-6, "bounded staleness 0 vs synchronous: {d:e}");
    let sgd = json!({"type": "SGD", "params": {"lr": 0.05}});
    let plain = json!({"gradient_clipping": 0, "optimizer": sgd});
    let (sync_sgd, _) = run_pipeline(&corpus, 4, &config(0, 2, pipe.clone(), plain), None, train_all).unwrap();
    let local = with(json!({"mode": "local_sgd", "sync_every": 1}), sgd.clone());
    let (local, _) = run_pipeline(&corpus, 4, &config(0, 2, pipe.clone(), local), None, train_all).unwrap();
    let d = max_relative_difference(&local, &sync_sgd);
    assert!(d < 1e-6, "local SGD every step vs synchronous SGD: {d:e}");
    // STEPS is not a multiple of 4: the checkpoint at the end falls between meetings.
    let apart = with(json!({"mode": "local_sgd", "sync_every": 4}), sgd);
    let dir = tempdir("async-between-meetings");
    let run = Run { steps: 0..STEPS, load_from: None, save_to: Some(&dir), report_to: None };
    let e = run_with(&corpus, 4, &config(0, 2, pipe, apart), None, train_all, pipeline_model, &run).unwrap_err();
    assert!(e.contains("between meetings"), "{e}");
    assert!(!dir.join("latest").exists(), "nothing saved");
}

#[test]
fn bad_setups_say_what_to_change() {
    let corpus = Corpus::load();
    let err = |world, c: &Config, stages| run_pipeline(&corpus, world, c, stages, train_all).unwrap_err();
    let e = err(2, &config(3, 4, json!({}), json!({})), Some(2));
    assert!(e.contains("zero_optimization.stage") && e.contains("stage 3"), "{e}");
    let e = err(3, &config(1, 4, json!({}), json!({})), Some(2));
    assert!(e.contains("2 pipeline stages x a data-parallel degree must equal the world size 3"), "{e}");
    let e = err(2, &config(1, 4, json!({"stages": 4}), json!({})), Some(2));
    assert!(e.contains("pipeline.stages is 4 but the program asks for 2"), "{e}");
    // Fewer micro-batches than stages: refused, unless allowed (then it trains as the reference does).
    let e = err(4, &config(1, 2, json!({}), json!({})), Some(4));
    assert!(e.contains("2 micro-batches for 4 stages") && e.contains("allow_fewer_micro_batches"), "{e}");
    let allowed = config(1, 2, json!({"allow_fewer_micro_batches": true}), json!({}));
    let (params, _) = run_pipeline(&corpus, 4, &allowed, Some(4), train_all).unwrap();
    assert!(max_relative_difference(&params, &reference(&corpus)) < 1e-5);
    let e = err(2, &config(1, 3, json!({"schedule": "interleaved"}), json!({})), Some(2));
    assert!(e.contains("must be a multiple of the stages"), "{e}");
    let e = err(2, &config(1, 4, json!({"partition": [0, 2]}), json!({})), Some(2));
    assert!(e.contains("pipeline.partition: the boundaries [0, 2] must be 2 + 1"), "{e}");
    assert!(Config::from_value(json!({"train_batch_size": 4, "pipeline": {"schedule": "zigzag"}}))
        .unwrap_err()
        .to_string()
        .contains("pipeline.schedule"));
    assert!(Config::from_value(json!({"train_batch_size": 4, "pipeline": {"virtual_stages": 2}}))
        .unwrap_err()
        .to_string()
        .contains("pipeline.virtual_stages"));
}

#[test]
fn a_stage_that_dies_is_an_error_on_the_others_not_a_hang() {
    let corpus = Corpus::load();
    let c = config(1, 4, json!({}), json!({"comms_timeout": 3}));
    let started = std::time::Instant::now();
    // Rank 1 (the last stage) leaves before the first step.
    let e = run_pipeline(&corpus, 2, &c, Some(2), |rank| rank != 1).unwrap_err();
    assert!(e.starts_with("rank 0:") && e.contains("rank 1"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
}

#[test]
fn the_schedule_command_prints_the_table_bubble_and_peaks() {
    let zerorun = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_zerorun")).args(args).output().expect("zerorun runs")
    };
    let out = zerorun(&["pipeline", "schedule", "--stages", "2", "--micro-batches", "2", "--schedule", "1f1b"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("stage 0: F0 F1  . B0  . B1\nstage 1:  . F0 B0 F1 B1  .\n"), "{text}");
    assert!(text.contains("bubble: 0.3333"), "{text}");
    assert!(text.contains("peak activations held per stage: 2 1"), "{text}");
    let out = zerorun(&[
        "pipeline",
        "schedule",
        "--stages",
        "4",
        "--micro-batches",
        "8",
        "--schedule",
        "interleaved",
        "--virtual",
        "2",
        "--json",
    ]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((v["steps"].as_u64(), v["virtual"].as_u64()), (Some(2 * (2 * 8 + 3)), Some(2)));
    assert!((v["bubble"].as_f64().unwrap() - 3.0 / 19.0).abs() < 1e-12);
    let out = zerorun(&["pipeline", "schedule", "--stages", "4", "--micro-batches", "2"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("2 micro-batches for 4 stages"));
    let out =
        zerorun(&["pipeline", "schedule", "--stages", "4", "--micro-batches", "2", "--allow-fewer-micro-batches"]);
    assert!(out.status.success());
}
