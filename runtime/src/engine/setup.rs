//! How an [`Engine`](crate::engine::Engine) is put together, one decision per function: what the stage asks for
//! ([`StagePlan`]), which parameters and in what layout ([`arrange`]), where they live ([`pack`] for stages 0-2;
//! stage 3 shards unit by unit in `unit_walk.rs`, and may move its shard to NVMe: `swap_parameters_out`), this
//! rank's optimizer and where its states live (`zero/optim/build.rs`), the gradient buffers (`zero/grads/`) and
//! the loss scaler. `Engine::new_materialized` calls them in that order.
use tch::{nn, Device, Tensor};

use crate::comm::Communicator;
use crate::config::{Config, OptimizerConfig, Precision, ZeroConfig};
use crate::engine::async_training::{meetings, Synchronization};
use crate::engine::counters;
use crate::engine::data_groups::{check_shard_groups, DataGroups};
use crate::engine::device::{allocator, native, views, Residence};
use crate::engine::parallel::placement::{Placement, PlacementInputs};
use crate::engine::reporting::Reporting;
use crate::engine::zero::builders::{BuiltModel, UnitBuilders};
use crate::engine::zero::layout::{FlatLayout, UnitRanks};
use crate::engine::zero::plan::{self, GradientPath, StagePlan};
use crate::engine::zero::{expert_units, frozen, grads, optim, pack, parameters, sizing, units, variables};
use crate::engine::{engine_comm, Engine, EngineOptions};
use crate::error::{Error, Result};
use crate::mesh::{Dim, Mesh};

/// The model's trainable parameters in layout order, and the layout.
pub(super) struct Arrangement {
    pub named: Vec<(String, Tensor)>,
    pub layout: FlatLayout,
    /// The units' name prefixes (one unit of everything when none were given).
    pub unit_prefixes: Vec<Vec<String>>,
    /// The frozen parameters of each unit (units of the model, or the one unit of everything), by name.
    pub frozen_by_unit: Vec<Vec<(String, Tensor)>>,
    /// Why stage 1 keeps its flat buffer although the units split experts over their positions (said at start).
    pub experts_kept_flat: Option<&'static str>,
}

/// Orders the trainable parameters (by unit in execution order where the plan lays out by units, by name
/// within), checks their device and dtype, and lays them out; assigns the frozen parameters to the same units.
/// `trainable` and `frozen` come sorted by name. The config gives the bucket size (hooked stage 2), the precision
/// and the expert-parallel degree (stages 1-3 split a unit of one position's experts over that position's ranks;
/// at stage 1 the plan learns it here, [`StagePlan::split_units_over_groups`], unless `flat_at_stage_1` says why
/// stage 1 keeps its flat buffer).
pub(super) fn arrange(
    trainable: Vec<(String, Tensor)>,
    frozen: Vec<(String, Tensor)>,
    options: &EngineOptions,
    plan: &mut StagePlan,
    config: &Config,
    world_size: usize,
    flat_at_stage_1: Option<&'static str>,
) -> Result<Arrangement> {
    let (reduce_bucket_size, precision) = (config.zero_optimization.reduce_bucket_size, config.precision());
    let expert_parallel = config.expert_parallel.size() as usize;
    let mut named = trainable;
    if named.is_empty() {
        let why = if frozen.is_empty() {
            "the VarStore has no trainable parameters"
        } else {
            "every parameter of the VarStore is frozen (requires_grad false): nothing to train"
        };
        return Err(Error::Usage(why.into()));
    }
    let unit_prefixes = options.units.clone().unwrap_or_else(|| vec![vec![String::new()]]);
    // Trainable and frozen parameters are claimed by the units together: a unit may hold only frozen ones.
    let all_names: Vec<String> = named.iter().chain(&frozen).map(|(n, _)| n.clone()).collect();
    let unit_of_all = units::assign(&unit_prefixes, &all_names)?;
    let (trainable_units, frozen_units) = unit_of_all.split_at(named.len());
    let mut frozen_by_unit: Vec<Vec<(String, Tensor)>> = (0..unit_prefixes.len()).map(|_| Vec::new()).collect();
    for ((name, t), &u) in frozen.into_iter().zip(frozen_units) {
        frozen_by_unit[u].push((name, t));
    }
    let mut experts_kept_flat = None;
    if plan.stage() == 1 && expert_parallel > 1 && options.units.is_some() {
        let names: Vec<Vec<&str>> = (0..unit_prefixes.len())
            .map(|u| named.iter().zip(trainable_units).filter(|(_, &v)| v == u).map(|((n, _), _)| n.as_str()).collect())
            .collect();
        let split = expert_units::unit_ranks(&names, expert_parallel, world_size)?.iter().any(|r| *r != UnitRanks::All);
        let why = flat_at_stage_1.or(frozen_by_unit.iter().flatten().next().map(|_| "with frozen parameters"));
        match (split, why) {
            (true, None) => plan.split_units_over_groups(),
            (true, Some(why)) => experts_kept_flat = Some(why),
            (false, _) => {}
        }
    }
    let hooked = plan.gradients == GradientPath::Hooks;
    let unit_of = if hooked {
        let sizes: Vec<usize> = named.iter().map(|(_, t)| t.numel()).collect();
        plan::bucket_cuts(&sizes, reduce_bucket_size)
    } else {
        trainable_units.to_vec()
    };
    let unit_count = if hooked { unit_of.last().map_or(0, |b| b + 1) } else { unit_prefixes.len() };
    if plan.lays_out_by_units() {
        // Units lay parameters out unit by unit, in execution order (stable: by name within a unit).
        let mut order: Vec<usize> = (0..named.len()).collect();
        order.sort_by_key(|&i| unit_of[i]);
        let mut taken: Vec<Option<(String, Tensor)>> = named.into_iter().map(Some).collect();
        named = order.iter().map(|&i| taken[i].take().expect("each index once")).collect();
    }
    check_parameters(&named, precision)?;
    let specs: Vec<(String, Vec<i64>, bool)> = named
        .iter()
        .map(|(n, t)| {
            let shape = t.size();
            let decay = !options.no_weight_decay.is_some_and(|f| f(n, &shape));
            (n.clone(), shape, decay)
        })
        .collect();
    let layout = if plan.lays_out_by_units() {
        let mut by_unit: Vec<Vec<(String, Vec<i64>, bool)>> = vec![Vec::new(); unit_count];
        let mut sorted_units = unit_of;
        sorted_units.sort_unstable();
        for (spec, u) in specs.into_iter().zip(sorted_units) {
            by_unit[u].push(spec);
        }
        // Units (stage 3, stage 2 with units, stage 1 so split) split a unit of one expert-parallel position's experts
        // over the ranks at that position.
        let names: Vec<Vec<&str>> = by_unit.iter().map(|u| u.iter().map(|(n, _, _)| n.as_str()).collect()).collect();
        let by_groups = matches!(plan.gradients, GradientPath::UnitWalk | GradientPath::UnitsAfterBackward);
        let e = if by_groups { expert_parallel } else { 1 };
        let ranks = crate::engine::zero::expert_units::unit_ranks(&names, e, world_size)?;
        FlatLayout::with_unit_ranks(&by_unit, &ranks, world_size)
    } else {
        FlatLayout::new(&specs, world_size)
    };
    Ok(Arrangement { named, layout, unit_prefixes, frozen_by_unit, experts_kept_flat })
}

/// Whether the unit inputs activation checkpointing keeps wait in host memory: `cpu_checkpointing` with
/// checkpointing on, on the device path (on a host run they are in host memory already: said once).
fn inputs_to_host(config: &Config, options: &EngineOptions, residence: Residence) -> bool {
    if !config.activation_checkpointing.cpu_checkpointing {
        return false;
    }
    if !options.activation_checkpointing {
        tracing::warn!("activation_checkpointing.cpu_checkpointing: no effect, the engine checkpoints no activations (EngineOptions::activation_checkpointing is off)");
        return false;
    }
    if !residence.device_path() {
        tracing::warn!("activation_checkpointing.cpu_checkpointing: no effect on a CPU run, the checkpointed inputs are in host memory already");
        return false;
    }
    true
}

/// Stage 3 without units makes the whole model one unit, gathered only inside `engine.forward`: unless it is
/// small enough to stay gathered (the persistence thresholds), the model's own forward would meet empty tensors.
/// `numel`: trainable and frozen elements.
pub(super) fn check_whole_model_persists(z: &ZeroConfig, numel: u64) -> Result<()> {
    if numel < z.stage3_param_persistence_threshold && numel <= z.stage3_model_persistence_threshold {
        return Ok(());
    }
    Err(Error::Usage(format!(
        "stage 3 partitions the parameters and gathers a unit's only while it runs, but the engine was built without the model's units: name them (`EngineOptions::units`, each unit's parameter-name prefixes) and enter each with `engine.unit(name, ..)` where your forward runs it, or pass a UnitModel (`EngineOptions::default().units_of(&model)`; `zerorun::Whole(|x| model.forward(x))` for one unit) and compute the loss from `engine.forward(&model, input)` ({numel} parameters is over zero_optimization.stage3_param_persistence_threshold = {}{}, under which the model would stay gathered)",
        z.stage3_param_persistence_threshold,
        if z.stage3_param_persistence_threshold == 100_000 { ", its default: \"auto\" sizes it from the units" } else { "" }
    )))
}

/// The one device every variable of the model is on: the CPU, or one CUDA device (the engine's buffers go there
/// too). A variable elsewhere is an error naming it.
pub(super) fn model_device<'a>(vars: impl Iterator<Item = &'a (String, Tensor)>) -> Result<Device> {
    let mut first: Option<(Device, &str)> = None;
    for (name, t) in vars {
        let device = t.device();
        if !matches!(device, Device::Cpu | Device::Cuda(_)) {
            return Err(Error::Parameter {
                name: name.clone(),
                why: format!("is on {device:?}; the engine trains on the CPU or a CUDA device"),
            });
        }
        match first {
            None => first = Some((device, name)),
            Some((d, f)) if d != device => {
                return Err(Error::Parameter {
                    name: name.clone(),
                    why: format!("is on {device:?} but `{f}` on {d:?}; the engine keeps a model on one device: build the VarStore on it (`nn::VarStore::new(zerorun::local_device())`) or move it with `vs.set_device`"),
                })
            }
            Some(_) => {}
        }
    }
    Ok(first.map_or(Device::Cpu, |(d, _)| d))
}

/// Every parameter is in the dtype the config trains in.
fn check_parameters(named: &[(String, Tensor)], precision: Precision) -> Result<()> {
    let kind = views::kind_of(precision);
    for (name, t) in named {
        if t.kind() != kind {
            let hint = match precision {
                Precision::Fp32 => "the config trains in fp32: keep the VarStore in Float",
                Precision::Bf16 => "bf16.enabled is true: convert the VarStore with `vs.bfloat16()` first",
                Precision::Fp16 => "fp16.enabled is true: convert the VarStore with `vs.half()` first",
            };
            return Err(Error::Parameter { name: name.clone(), why: format!("has dtype {:?}; {hint}", t.kind()) });
        }
    }
    Ok(())
}

/// The `aio` section as the offload crate takes it.
pub(super) fn io_config(config: &Config) -> zerorun_offload::IoConfig {
    zerorun_offload::IoConfig {
        block_size: config.aio.block_size as usize,
        queue_depth: config.aio.queue_depth as usize,
        intra_op_parallelism: config.aio.intra_op_parallelism as usize,
    }
}

impl Engine {
    /// [`Engine::new`] where stage 3's unit parameters may still lack their values (`builders.rs`): `materialize`
    /// gives unit `i`'s variables (name, tensor) their storage and values right before the unit is packed.
    pub(super) fn new_materialized(
        vs: &nn::VarStore,
        config: Config,
        comm: Box<dyn Communicator>,
        replicas: Option<Box<dyn Communicator>>,
        options: EngineOptions,
        mut materialize: Option<&mut units::Materialize>,
    ) -> Result<Engine> {
        // The process floor: what is resident before the engine allocates, less the model's own variables
        // (built by the program already; they are model states, which the engine then takes over).
        // Blocks an earlier engine's allocator kept are freed memory, not the floor.
        allocator::release_kept();
        let model_bytes: usize = vs.variables().values().map(native::storage_nbytes).sum();
        let floor_rss_bytes = crate::report::memory::rss().0.saturating_sub(model_bytes as u64);
        // From here on libtorch's CPU tensors are counted, by owner (the memory report's measured categories).
        let counting = crate::report::allocations::Counting::start();
        let _owner = crate::report::allocations::owned_by(crate::report::allocations::Owner::Engine);
        if !options.keep_allocator_settings {
            allocator::fix_mmap_threshold();
            allocator::keep_freed_blocks()?;
        }
        let (world_size, rank) = (comm.world_size(), comm.rank());
        let expert_parallel = config.expert_parallel.size() as usize;
        let replica_count = replicas.as_ref().map_or(1, |r| r.world_size());
        check_shard_groups(&config, world_size, replica_count)?;
        // The batch spans every data-parallel rank: the shard groups' ranks times the groups.
        let data_world_size = world_size * replica_count;
        if config.sequence_parallel_size > 1 && replica_count > 1 {
            return Err(Error::Unsupported {
                key: "sequence_parallel_size",
                value: config.sequence_parallel_size.to_string(),
                why: "with shard groups (mics_shard_size, hpZ) not yet: ZeRO runs over every data x sequence rank",
            });
        }
        let batch = config.batch_sizes(data_world_size)?;
        if let (Some(OptimizerConfig::Lamb(_)), 1..) = (&config.optimizer, config.zero_optimization.stage) {
            return Err(Error::Unsupported {
                key: "optimizer.type",
                value: "\"Lamb\"".into(),
                why: "Lamb's trust ratios are per tensor, and at stages 1-3 a tensor's elements are split across ranks; it runs at stage 0",
            });
        }
        let z = &config.zero_optimization;
        let precision = config.precision();
        let kind = views::kind_of(precision);
        let mut plan = StagePlan::new(z.stage, options.units.is_some(), z.overlap_comm, z.reduce_scatter, world_size);
        // Stage 0's all-reduce in backward reduces the staging buffer the `.grad` tensors are views of, in place,
        // over one group, every step: not across shard groups' replicas, not when asynchronous training keeps
        // gradients local or serves them stale, not with a communication dtype other than the model's.
        let one_bit = config.optimizer.as_ref().is_some_and(|o| o.one_bit().is_some());
        crate::engine::compression::powersgd::check(&config, &plan, precision, replica_count)?;
        plan.all_reduce_in_backward &= replica_count == 1
            && !config.async_training.is_async()
            // The 1-bit optimizers decide step by step whether gradients are averaged at all; PowerSGD averages
            // the whole flat buffer at once.
            && !one_bit
            && config.gradient_compression.powersgd().is_none()
            && views::comm_kind(config.communication_data_type, precision) == views::kind_of(precision);
        // Stage 0 steps each bucket as its all-reduce lands; a single rank has no all-reduce, and its ordinary step
        // gives the same values.
        // (The config allows the key at stages 0 and 3 only.)
        let stage_0 = !plan.partitions_parameters();
        plan.steps_in_backward = config.optimizer_in_backward && (!stage_0 || plan.all_reduce_in_backward);
        if config.optimizer_in_backward && stage_0 && world_size > 1 && !plan.all_reduce_in_backward {
            return Err(crate::config::ConfigError::Conflict {
                path: "optimizer_in_backward".into(),
                message: "stage 0 steps each bucket as its all-reduce in backward lands, which runs over one group of ranks, in the model's dtype, every step: not with asynchronous training or a `communication_data_type` other than the model's".into(),
            }
            .into());
        }
        if config.optimizer_in_backward && batch.gradient_accumulation_steps > 1 {
            // The config checks a given value; this is the value the batch rule resolved.
            return Err(crate::config::ConfigError::Conflict {
                path: "optimizer_in_backward".into(),
                message: format!(
                    "accumulation needs a gradient shard to add micro-batches in: the batch sizes resolve to gradient_accumulation_steps {} at {data_world_size} ranks (train_batch_size {} = micro batch {} x ranks); it must be 1",
                    batch.gradient_accumulation_steps, batch.train_batch_size, batch.train_micro_batch_size_per_gpu
                ),
            }
            .into());
        }
        // Buffers the collectives read go where the peers map them (the shm backend's shared region).
        let shared = comm.prefers_shared_buffers();
        let variables::Variables { trainable, frozen, buffers } = variables::classify(vs);
        let device = model_device(trainable.iter().chain(&frozen).chain(&buffers))?;
        let residence = Residence::of(device);
        let claim = variables::Claim::new(trainable.iter().chain(&frozen).chain(&buffers))?;
        let config = sizing::size_hooked_buckets(config, &plan, &trainable, rank);
        // Stage 1 splits a unit of one position's experts over that position's ranks as stages 2-3 do, unless what
        // it runs reads the whole flat buffer on every rank.
        let flat_at_stage_1 = match () {
            _ if one_bit => Some("with a 1-bit optimizer (its signs cover the flat buffer)"),
            _ if config.gradient_compression.powersgd().is_some() => {
                Some("with PowerSGD (its factors cover the flat buffer)")
            }
            _ if config.async_training.is_async() => {
                Some("with asynchronous training (its exchanges cover the flat buffer)")
            }
            _ if replica_count > 1
                || config.zero_optimization.zero_hpz_partition_size > 1
                || config.zero_optimization.zero_quantized_weights =>
            {
                Some("with shard groups, hpZ or quantized weights")
            }
            _ => None,
        };
        let Arrangement { named, layout, unit_prefixes, frozen_by_unit, experts_kept_flat } =
            arrange(trainable, frozen, &options, &mut plan, &config, world_size, flat_at_stage_1)?;
        let experts_group = if layout.has_groups() {
            expert_units::check_supported(&config, &frozen_by_unit, replica_count)?;
            Some(expert_units::position_group(comm.as_ref(), expert_parallel)?)
        } else {
            if expert_parallel > 1 && rank == 0 && layout.slots.iter().any(|s| crate::moe::is_expert_parameter(&s.name))
            {
                match experts_kept_flat {
                    Some(why) => tracing::info!("expert_parallel.autoep_size {expert_parallel} at stage 1 {why}: every rank holds every expert's parameters, which ZeRO splits over all ranks"),
                    None => tracing::info!("expert_parallel.autoep_size {expert_parallel} at stage {}: every rank holds every expert's parameters, which ZeRO splits over all ranks; at stages 1-3 a unit of each position's experts (MoeLayer::expert_units) is kept by that position's ranks alone", plan.stage()),
                }
            }
            None
        };
        let config = sizing::size_from_model(config, &layout, &plan, rank);
        let z = &config.zero_optimization;
        let frozen_numel: Vec<u64> =
            frozen_by_unit.iter().map(|u| u.iter().map(|(_, t)| t.numel() as u64).sum()).collect();
        if plan.partitions_parameters() && options.units.is_none() {
            check_whole_model_persists(z, layout.numel as u64 + frozen_numel.iter().sum::<u64>())?;
        }
        // Every rank starts from rank 0's model: trainable parameters are broadcast as they are packed, frozen
        // parameters and buffers here (stage 3 partitions the frozen ones, broadcasting unit by unit).
        let frozen_whole: Vec<(String, Tensor)> = if plan.partitions_parameters() {
            Vec::new()
        } else {
            frozen_by_unit.iter().flatten().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()
        };
        let broadcast: Vec<&Tensor> = frozen_whole.iter().chain(&buffers).map(|(_, t)| t).collect();
        variables::broadcast_values(comm.as_ref(), &broadcast)?;
        let (flat_params, mut swapped_params, params, mut sharded_units) = if plan.partitions_parameters() {
            let materialize = materialize.as_deref_mut();
            crate::engine::zero::unit_walk::shard_units(
                &layout,
                named,
                &frozen_numel,
                (kind, residence),
                comm.as_ref(),
                &config,
                materialize,
            )
            .map(|s| (s.shard, s.swapped, s.params, s.units))?
        } else {
            let (flat, params, units) = pack::pack(&layout, named, kind, comm.as_ref(), &plan, shared, residence)?;
            (flat, None, params, units)
        };
        let mut frozen_units = if plan.partitions_parameters() && frozen_by_unit.iter().any(|u| !u.is_empty()) {
            let persistent: Vec<bool> = sharded_units.iter().map(|u| u.persistent).collect();
            Some(frozen::FrozenUnits::new(frozen_by_unit, &persistent, comm.as_ref(), residence, materialize)?)
        } else {
            None
        };
        // A released parameter's error names its unit (stage 3: only its units are ever released).
        for (u, unit) in sharded_units.iter_mut().enumerate().filter(|_| plan.partitions_parameters()) {
            let name = unit_prefixes.get(u).and_then(|p| p.first()).map_or("", String::as_str);
            unit.describe(&layout.slots[layout.units[u].slots.clone()], name)?;
            if let Some(frozen) = frozen_units.as_mut() {
                let slots = frozen.layout.slots[frozen.layout.units[u].slots.clone()].to_vec();
                frozen.units[u].describe(&slots, name)?;
            }
        }

        // A 16-bit model's fp32 master starts from the values: read back unit by unit where they are on NVMe.
        let values = match (&mut swapped_params, precision) {
            (Some(s), Precision::Bf16 | Precision::Fp16) => s.read_all(layout.shard_len(rank))?,
            _ => flat_params.shallow_clone(),
        };
        // A 1-bit optimizer exchanges its momentum itself at stage 0; at stage 1 the engine exchanges the gradient
        // and the step's change as signs around an exact step of the partition (compression::ShardedSigns).
        let (exchange, sharded_signs) = match (one_bit, plan.partitions_optimizer()) {
            (false, _) => (None, None),
            (true, false) => (Some(crate::engine::compression::exchange(&config, comm.as_ref(), replica_count)?), None),
            (true, true) => {
                crate::engine::compression::check_sharded(&config, precision, replica_count)?;
                let group = crate::engine::compression::own_group(comm.as_ref())?;
                (None, Some(crate::engine::compression::ShardedSigns::new(group, &layout)))
            }
        };
        let (shard, optimizer_device) =
            optim::build::optimizer_shard(&config, &plan, &layout, &values, rank, residence, exchange)?;
        drop(values);
        let scheduler = optim::build::scheduler(&config, shard.base_lr);
        let gradients = grads::Gradients::new(
            &config,
            &plan,
            &layout,
            &params,
            (rank, data_world_size),
            shared,
            residence,
            optimizer_device,
        )?;
        let mut gradients = gradients;
        gradients.sharded_signs = sharded_signs;
        let scaler = optim::build::loss_scaler(&config);
        if precision == Precision::Fp16 && rank == 0 && device == Device::Cpu {
            // Every parameter is on the CPU (checked in `arrange`).
            tracing::warn!("fp16 on the CPU: libtorch runs Half matmuls with a slow reference kernel on most CPUs (hundreds of times slower than bf16); bf16.enabled saves the same memory at full speed");
        }
        tracing::info!(
            rank,
            world_size,
            shard_groups = replica_count,
            stage = plan.stage(),
            ?precision,
            params = layout.numel,
            partition = layout.shard_len(rank),
            units = layout.units.len(),
            ?device,
            ?optimizer_device,
            "zerorun engine ready"
        );
        let shard = optim::OptimizerShard { scheduler, scaler, ..shard };
        let sync = match meetings::Meetings::new(&config.async_training, &flat_params) {
            Some(m) => Synchronization::Meetings(m),
            None => Synchronization::Synchronous,
        };
        let (replicas, fault_tolerance) = super::fault_tolerant::wrap(&config, comm.as_ref(), replicas, batch)?;
        // The communication logger records training's collectives, not set-up's.
        let (watch, comm, replicas) = super::watching::Watch::wrap_comms(&config, comm, replicas);
        let inputs_to_host = inputs_to_host(&config, &options, residence);
        // Stage 1 with units split over groups: the units `engine.unit` refuses on this rank.
        let not_held: std::collections::HashSet<String> = match plan.gradients {
            GradientPath::UnitsAfterBackward => (layout.units.iter().zip(&unit_prefixes))
                .filter(|(span, _)| !span.holds(rank))
                .flat_map(|(_, prefixes)| prefixes.iter().cloned())
                .collect(),
            _ => Default::default(),
        };
        let mut engine = Engine {
            comm: match experts_group {
                Some(group) => engine_comm::EngineComm::new(comm, replicas, plan.threaded_comm())
                    .with_experts(group, plan.threaded_comm()),
                None => engine_comm::EngineComm::new(comm, replicas, plan.threaded_comm()),
            }
            .with_fault_tolerance(fault_tolerance),
            residence,
            config,
            plan,
            batch,
            states: crate::engine::zero::ModelStates {
                layout,
                params,
                parameters: parameters::Parameters::new(flat_params, swapped_params, sharded_units, frozen_units),
                frozen: frozen_whole,
                buffers,
                buffer_sync: options.buffers,
                _claim: claim,
            },
            walk: crate::engine::zero::unit_walk::Walk {
                not_held,
                unit_prefixes,
                records: Vec::new(),
                activation_checkpointing: options.activation_checkpointing,
                inputs_to_host,
                inputs_sent_bytes: 0,
                chain: options.activation_checkpointing || crate::engine::zero::unit_walk::chain_walk_from_env(),
                scopes: None,
                forward_marked: false,
            },
            gradients,
            shard,
            progress: counters::Progress::default(),
            report: Reporting { floor_rss_bytes, counting, ..Reporting::default() },
            placement: Placement::default(),
            in_flight: Default::default(),
            sync,
            watch,
        };
        engine.start_bounded_staleness()?;
        if engine.config.monitor.flops_profiler.profile_step == 1 && engine.profiling_this_step() {
            engine.start_whole_step_profile();
        }
        if plan.hooks_gradients() {
            engine.gradients.hooks =
                Some(crate::engine::zero::grads::hooks::GradHooks::install(&engine.states.params)?);
        }
        engine.gradients.mark = engine.gradient_fingerprint();
        allocator::return_freed_memory();
        engine.report.init_peak_rss_bytes = crate::report::memory::rss().1;
        engine.report.sample_events = engine.memory_report_dir().is_some();
        engine.report.snapshot = engine.report.sample_events
            && engine.report.counting.is_some()
            && std::env::var(crate::report::allocations::SNAPSHOT_ENV).is_ok_and(|v| v.trim() == "1");
        if engine.report.snapshot {
            crate::report::allocations::trace(true);
        }
        engine.memory_event_initialized();
        Ok(engine)
    }
}

impl Engine {
    /// Builds the model from `builders` on `vs` (which should hold nothing else yet) and the engine over it, with
    /// the builders' units (see the module doc). Returns the engine and the model to run through
    /// `engine.forward`. The values equal those of building every unit in order from the same generator state.
    pub fn from_builders<'a>(
        vs: &nn::VarStore,
        config: Config,
        comm: Box<dyn Communicator>,
        options: EngineOptions,
        builders: UnitBuilders<'a>,
    ) -> Result<(Engine, BuiltModel<'a>)> {
        builders.build_engine(vs, config, comm, options)
    }

    /// The engine for the model on `vs` on `mesh`: ZeRO over the mesh's data-parallel ranks and, with pipeline
    /// stages or tensor parallelism, its place among the model's other parts (the norm's group, the placements
    /// the mesh's tensor-parallel layers recorded). A data-parallel mesh's engine runs on its communicator itself.
    pub(crate) fn on_mesh(vs: &nn::VarStore, config: Config, mesh: Mesh, options: EngineOptions) -> Result<Engine> {
        let mesh = mesh.with_shard_groups(config.zero_optimization.mics_shard_size)?;
        if mesh.shape().tensor > 1 || mesh.shape().pipeline > 1 {
            crate::mesh::refuse_adjacent_groups(&config, "with tensor parallelism or pipeline stages not yet")?;
        }
        if mesh.shape().replicate > 1 {
            return Engine::on_shard_groups(vs, config, mesh, options);
        }
        if mesh.shape().data() == mesh.world_size() && !Placement::records_slices(&mesh) {
            return Engine::new(vs, config, mesh.into_world(), options);
        }
        let data = mesh.group(&[Dim::Replicate, Dim::Shard])?;
        let mut engine = Engine::new(vs, config, data, options)?;
        engine.join_mesh(&mesh)?;
        engine.placement.mesh = Some(mesh);
        Ok(engine)
    }

    /// MiCS (`mics_shard_size`): ZeRO over the mesh's shard group, its reduced gradients all-reduced across the
    /// replicas ([`DataGroups::of_mesh`]).
    fn on_shard_groups(vs: &nn::VarStore, config: Config, mesh: Mesh, options: EngineOptions) -> Result<Engine> {
        // A fault-tolerant job's restarted group: its groups from the store, its values from a live group's.
        if let (true, Some(k)) = (config.fault_tolerance.enabled, crate::fault_tolerance::incarnation()) {
            let groups = super::fault_tolerant::rejoining_groups(&config, mesh.shape().shard, mesh.world(), k)?;
            let DataGroups { shard, replicas, .. } = groups;
            let mut engine = Engine::new_materialized(vs, config, shard, replicas, options, None)?;
            super::fault_tolerant::rejoin(&mut engine, k)?;
            return Ok(engine);
        }
        Engine::on_data_groups(vs, config, DataGroups::of_mesh(mesh)?, options)
    }

    /// The engine on `groups`, every replica starting from the first group's values of `vs`.
    pub(super) fn on_data_groups(
        vs: &nn::VarStore,
        config: Config,
        groups: DataGroups,
        options: EngineOptions,
    ) -> Result<Engine> {
        groups.start_replicas_alike(vs)?;
        let DataGroups { shard, replicas, mesh } = groups;
        let mut engine = Engine::new_materialized(vs, config, shard, replicas, options, None)?;
        engine.placement.mesh = mesh;
        Ok(engine)
    }

    /// Takes this engine's place among the model's other parts on `mesh` (see [`Placement::on_mesh`]).
    /// Collective over the mesh.
    pub(crate) fn join_mesh(&mut self, mesh: &Mesh) -> Result<()> {
        let values = if Placement::records_slices(mesh) { Some(self.optimized_values()?) } else { None };
        let whole_only = self.states.buffers.iter().map(|(n, _)| n.clone());
        let whole_only = whole_only.chain(self.frozen_specs().into_iter().map(|s| s.0)).collect();
        let inputs = PlacementInputs {
            layout: &self.states.layout,
            optimized: &self.shard.optimized,
            rank: self.comm.rank(),
            pieces: self.optimized_pieces(self.comm.rank()),
            values,
            whole_only,
            data: self.comm.as_ref(),
            partitions_optimizer: self.plan.partitions_optimizer(),
        };
        self.placement = Placement::on_mesh(mesh, inputs)?;
        Ok(())
    }
}
