//! The MLP example as separate processes under `zerorun launch` (shm backend with shared buffer regions,
//! communication thread with prefetch at stage 3, per-unit reduction at stage 2, and stage 2 of a plain loop reducing
//! from gradient hooks, and models built unit by unit from builders) ends at the parameters of one process at stage
//! 0, within 1e-5, and prints the same per-step losses. So do two launchers as two nodes (`--nnodes 2`, the gloo
//! backend over loopback, its collectives in two levels: shm inside a node, gloo across) at stages 0-3, and two torchrun agents as two nodes (static rendezvous, `--no-python`).
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "common/examples.rs"]
mod examples;
#[path = "common/ports.rs"]
mod ports;

fn mlp_example() -> PathBuf {
    examples::example("mlp")
}

fn run(mlp: &Path, dir: &Path, ranks: usize, zero: &str, extra: &[&str], out: &Path) -> Vec<String> {
    let cfg = dir.join(format!("c{ranks}-{}.json", out.file_stem().unwrap().to_string_lossy()));
    std::fs::write(&cfg, format!(r#"{{"train_batch_size": 12, "gradient_clipping": 1.0, "optimizer": {{"type": "AdamW", "params": {{"lr": 0.003, "weight_decay": 0.01}}}}, "zero_optimization": {zero}}}"#)).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["launch", "--nproc-per-node", &ranks.to_string(), "--"])
        .arg(mlp)
        .args([
            "--config",
            cfg.to_str().unwrap(),
            "--steps",
            "8",
            "--seed",
            "3",
            "--in",
            "16",
            "--hidden",
            "48",
            "--layers",
            "4",
            "--out",
            "4",
        ])
        .args(["--save-final", out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{ranks} ranks, {zero}: {}\n{text}", String::from_utf8_lossy(&o.stderr));
    text.lines()
        .filter_map(|l| l.strip_prefix("[rank 0] "))
        .filter(|l| l.starts_with("step "))
        .map(step_and_loss)
        .collect()
}

fn load(p: &Path) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<_> = tch::Tensor::read_safetensors(p)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(t.reshape([-1])).unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// `step N loss X` of an example's step line (which goes on with the step's time and throughput).
fn step_and_loss(line: &str) -> String {
    line.split(" time ").next().unwrap_or(line).to_string()
}

/// The run's per-step losses and final parameters (`out`) match the reference's within 1e-5.
fn assert_matches(name: &str, losses: &[String], ref_losses: &[String], out: &Path, reference: &[(String, Vec<f32>)]) {
    assert_eq!(losses.len(), ref_losses.len(), "{name}: losses");
    for (a, b) in losses.iter().zip(ref_losses) {
        let (x, y): (f64, f64) =
            (a.rsplit(' ').next().unwrap().parse().unwrap(), b.rsplit(' ').next().unwrap().parse().unwrap());
        assert!((x - y).abs() <= 1e-5 * y.abs(), "{name}: `{a}` vs `{b}`");
    }
    let got = load(out);
    assert_eq!(got.iter().map(|p| &p.0).collect::<Vec<_>>(), reference.iter().map(|p| &p.0).collect::<Vec<_>>());
    for ((n, x), (_, y)) in got.iter().zip(reference) {
        let scale = y.iter().map(|v| v.abs()).fold(1e-6f32, f32::max);
        let d = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max) / scale;
        assert!(d <= 1e-5, "{name}: {n} differs by {d:e}");
    }
}

#[test]
fn processes_at_stages_2_and_3_match_one_process() {
    let mlp = mlp_example();
    let dir = std::env::temp_dir().join(format!("zerorun-launch-eq-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let reference = dir.join("ref.safetensors");
    let ref_losses = run(&mlp, &dir, 1, r#"{"stage": 0}"#, &[], &reference);
    assert_eq!(ref_losses.len(), 8);
    let reference = load(&reference);
    for (name, zero, extra) in [
        ("stage2", r#"{"stage": 2}"#, &[][..]),
        // A plain loop: no units, stage 2 reduces bucket by bucket from gradient hooks (small buckets: several).
        ("stage2-plain", r#"{"stage": 2, "reduce_bucket_size": 300}"#, &["--plain-loop"][..]),
        (
            "stage3",
            r#"{"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1}"#,
            &[][..],
        ),
        // Built unit by unit (UnitBuilders): the same initial weights, so the same run.
        (
            "stage3-builders",
            r#"{"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}"#,
            &["--builders"][..],
        ),
        ("stage1-builders", r#"{"stage": 1}"#, &["--builders"][..]),
    ] {
        let out = dir.join(format!("{name}.safetensors"));
        let losses = run(&mlp, &dir, 3, zero, extra, &out);
        assert_eq!(losses.len(), 8, "{name}");
        assert_matches(name, &losses, &ref_losses, &out, &reference);
    }
    // Pretrained weights into builders: a stage-3 run from `--init` (each unit read from the mapped file as it is
    // packed) is the one-process run from the same file.
    let init = dir.join("ref.safetensors");
    let from_init = dir.join("from-init.safetensors");
    let ref_losses = run(&mlp, &dir, 1, r#"{"stage": 0}"#, &["--init", init.to_str().unwrap()], &from_init);
    let out = dir.join("builders-init.safetensors");
    let losses = run(
        &mlp,
        &dir,
        3,
        r#"{"stage": 3, "stage3_param_persistence_threshold": 0}"#,
        &["--builders", "--init", init.to_str().unwrap()],
        &out,
    );
    assert_ne!(
        ref_losses,
        run(&mlp, &dir, 1, r#"{"stage": 0}"#, &[], &dir.join("fresh.safetensors")),
        "--init must change the start"
    );
    assert_matches("builders --init", &losses, &ref_losses, &out, &load(&from_init));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two launchers on this host as nodes 0 and 1 (`--nnodes 2 --nproc-per-node 2`): four gloo ranks, their
/// collectives in two levels (shm inside a node, gloo across) unless `hierarchy` is `flat`. Node 0's losses and the
/// line its ranks log about their collectives.
fn run_two_nodes(mlp: &Path, dir: &Path, zero: &str, hierarchy: &str, out: &Path) -> (Vec<String>, String) {
    let cfg = dir.join(format!("nodes-{}.json", out.file_stem().unwrap().to_string_lossy()));
    std::fs::write(&cfg, format!(r#"{{"train_batch_size": 12, "gradient_clipping": 1.0, "optimizer": {{"type": "AdamW", "params": {{"lr": 0.003, "weight_decay": 0.01}}}}, "zero_optimization": {zero}}}"#)).unwrap();
    let port = ports::free_port().to_string();
    let launchers: Vec<_> = (0..2)
        .map(|node| {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerorun"));
            cmd.args(["launch", "--nnodes", "2", "--node-rank", &node.to_string(), "--nproc-per-node", "2"])
                .args(["--master-addr", "127.0.0.1", "--master-port", &port, "--"])
                .env("ZERORUN_HIERARCHY", hierarchy)
                .env("RUST_LOG", "zerorun_runtime::gloo=info");
            mlp_on_node(&mut cmd, mlp, &cfg, out)
        })
        .collect();
    let (losses, stderr) = node_zero_output(launchers, zero, "[rank 0] ");
    let said = stderr.lines().find(|l| l.starts_with("[rank 0]") && l.contains("collectives: ")).unwrap_or_default();
    (losses, said.split("collectives: ").nth(1).unwrap_or_default().to_string())
}

/// The MLP example's arguments for the two-node runs (8 steps), its output piped.
fn mlp_on_node(cmd: &mut Command, mlp: &Path, cfg: &Path, out: &Path) -> std::process::Child {
    cmd.arg(mlp)
        .args(["--config", cfg.to_str().unwrap(), "--steps", "8", "--seed", "3", "--in", "16"])
        .args(["--hidden", "48", "--layers", "4", "--out", "4", "--save-final", out.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for every node's process (each must succeed) and returns node 0's `step` lines: those of its output that
/// start with `rank0_prefix` (`[rank 0] ` under `zerorun launch`), the prefix removed.
fn node_zero_losses(nodes: Vec<std::process::Child>, what: &str, rank0_prefix: &str) -> Vec<String> {
    node_zero_output(nodes, what, rank0_prefix).0
}

/// [`node_zero_losses`], with node 0's standard error.
fn node_zero_output(nodes: Vec<std::process::Child>, what: &str, rank0_prefix: &str) -> (Vec<String>, String) {
    let (mut losses, mut stderr) = (Vec::new(), String::new());
    for (node, child) in nodes.into_iter().enumerate() {
        let o = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(o.status.success(), "node {node}, {what}: {}\n{text}", String::from_utf8_lossy(&o.stderr));
        if node == 0 {
            stderr = String::from_utf8_lossy(&o.stderr).into_owned();
            losses = text
                .lines()
                .filter_map(|l| l.strip_prefix(rank0_prefix))
                .filter(|l| l.starts_with("step "))
                .map(step_and_loss)
                .collect();
        }
    }
    (losses, stderr)
}

/// Two hosts of two ranks each: collectives in two levels at every stage, and flat over gloo when asked, match one
/// process within 1e-5, and so do shard groups of a host at stages 2 and 3; in bf16 the two levels (each host's sum first) keep the flat run's losses.
#[test]
fn two_launchers_as_two_nodes_match_one_process_at_stages_0_to_3() {
    let mlp = mlp_example();
    let dir = std::env::temp_dir().join(format!("zerorun-two-nodes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let reference = dir.join("ref.safetensors");
    let ref_losses = run(&mlp, &dir, 1, r#"{"stage": 0}"#, &[], &reference);
    let reference = load(&reference);
    const TWO_LEVELS: &str = "shared memory inside each host, gloo across hosts rank=0 hosts=2 per_host=2";
    // Shard groups of a host (MiCS): the group is the host's shared-memory group, the replicas the cross-host one.
    const MICS: &str = r#", "mics_shard_size": 2"#;
    for (stage, hierarchy, said, keys) in [
        (0, "auto", TWO_LEVELS, ""),
        (1, "auto", TWO_LEVELS, ""),
        (2, "auto", TWO_LEVELS, ""),
        (3, "auto", TWO_LEVELS, ""),
        (3, "flat", "flat over gloo", ""),
        (2, "auto", TWO_LEVELS, MICS),
        (3, "auto", TWO_LEVELS, MICS),
    ] {
        let name = format!("stage{stage}-{hierarchy}{}", if keys.is_empty() { "" } else { "-mics" });
        let out = dir.join(format!("nodes-{name}.safetensors"));
        let (losses, logged) = run_two_nodes(&mlp, &dir, &format!(r#"{{"stage": {stage}{keys}}}"#), hierarchy, &out);
        assert!(logged.starts_with(said), "{name}: node 0 said {logged:?}");
        assert_eq!(losses.len(), 8, "{name}");
        assert_matches(&name, &losses, &ref_losses, &out, &reference);
    }
    // ZeRO++: gradients quantized across hosts (stages 2, 3), weights in every gather and backward's gathers from
    // the host's secondary copies (3) stay within 2% of the unquantized losses (`ref_losses`: one process).
    let ref_values: Vec<f64> = ref_losses.iter().map(|l| l.rsplit(' ').next().unwrap().parse().unwrap()).collect();
    for (stage, keys) in [
        (2, r#""zero_quantized_gradients": true"#),
        (3, r#""zero_quantized_gradients": true, "zero_quantized_weights": true, "zero_hpz_partition_size": 2"#),
    ] {
        let out = dir.join(format!("nodes-zeropp-stage{stage}.safetensors"));
        let (losses, _) = run_two_nodes(&mlp, &dir, &format!(r#"{{"stage": {stage}, {keys}}}"#), "auto", &out);
        assert_eq!(losses.len(), 8, "ZeRO++ stage {stage}");
        for (step, (l, want)) in losses.iter().zip(&ref_values).enumerate() {
            let got: f64 = l.rsplit(' ').next().unwrap().parse().unwrap();
            assert!(
                (got - want).abs() <= 0.02 * want.abs(),
                "ZeRO++ stage {stage} step {}: {got} against {want}",
                step + 1
            );
        }
    }
    for stage in [2, 3] {
        let zero = format!(r#"{{"stage": {stage}}}, "bf16": {{"enabled": true}}"#);
        let runs: Vec<Vec<f64>> = ["flat", "auto"]
            .iter()
            .map(|h| {
                let out = dir.join(format!("nodes-bf16-stage{stage}-{h}.safetensors"));
                let losses = run_two_nodes(&mlp, &dir, &zero, h, &out).0;
                losses.iter().map(|l| l.rsplit(' ').next().unwrap().parse().unwrap()).collect()
            })
            .collect();
        assert_eq!(runs[0].len(), 8, "bf16 stage {stage}");
        for (step, (flat, two)) in runs[0].iter().zip(&runs[1]).enumerate() {
            assert!(
                (flat - two).abs() <= 1e-2 * flat.abs(),
                "bf16 stage {stage} step {}: flat {flat}, two levels {two}",
                step + 1
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn two_torchrun_nodes_match_one_process() {
    // make setup's venv has torch, and so torchrun.
    let torchrun = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/torchrun");
    assert!(torchrun.is_file(), "{} (make setup installs torch into .venv)", torchrun.display());
    let mlp = mlp_example();
    let dir = std::env::temp_dir().join(format!("zerorun-torchrun-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let reference = dir.join("ref.safetensors");
    let ref_losses = run(&mlp, &dir, 1, r#"{"stage": 0}"#, &[], &reference);
    let cfg = dir.join("torchrun.json");
    std::fs::write(&cfg, r#"{"train_batch_size": 12, "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}}, "zero_optimization": {"stage": 2}}"#).unwrap();
    let out = dir.join("torchrun.safetensors");
    let port = ports::free_port().to_string();
    let agents: Vec<_> = (0..2)
        .map(|node| {
            let mut cmd = Command::new(&torchrun);
            cmd.args(["--nnodes", "2", "--node-rank", &node.to_string(), "--nproc-per-node", "1"])
                .args(["--master-addr", "127.0.0.1", "--master-port", &port, "--no-python"])
                .env_remove("ZERORUN_BACKEND");
            mlp_on_node(&mut cmd, &mlp, &cfg, &out)
        })
        .collect();
    let losses = node_zero_losses(agents, "torchrun", "");
    assert_eq!(losses.len(), 8, "rank 0's losses");
    assert_matches("torchrun", &losses, &ref_losses, &out, &load(&reference));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The example GPT at stage 3 under `zerorun launch` builds its model unit by unit by default: the same losses and
/// final weights as building it whole first (`--whole-model`).
#[test]
fn the_gpt_built_unit_by_unit_trains_as_the_whole_model() {
    let gpt = examples::example("gpt");
    let dir = std::env::temp_dir().join(format!("zerorun-launch-gpt-units-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("zero3.json");
    std::fs::write(&cfg, r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}"#).unwrap();
    let run = |extra: &[&str], out: &Path| -> Vec<String> {
        let o = Command::new(env!("CARGO_BIN_EXE_zerorun"))
            .args(["launch", "--nproc-per-node", "2", "--"])
            .arg(&gpt)
            .args(["--config", cfg.to_str().unwrap(), "--steps", "4", "--layers", "2", "--embd", "32"])
            .args(["--heads", "4", "--block", "16", "--save-final", out.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(o.status.success(), "{extra:?}: {}\n{text}", String::from_utf8_lossy(&o.stderr));
        text.lines()
            .filter_map(|l| l.strip_prefix("[rank 0] "))
            .filter(|l| l.starts_with("step "))
            .map(step_and_loss)
            .collect()
    };
    let whole = dir.join("whole.safetensors");
    let ref_losses = run(&["--whole-model"], &whole);
    assert_eq!(ref_losses.len(), 4);
    let units = dir.join("units.safetensors");
    let losses = run(&[], &units);
    assert_matches("gpt by units", &losses, &ref_losses, &units, &load(&whole));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A mixture of experts whose expert-parallel group is both nodes (E = 4 on 2 nodes x 2 ranks, the llama
/// example's Mixtral from flags): the group is split as a two-level group of its own and its all-to-alls run in two
/// levels (shared memory inside a node, gloo across). Only the rows' route differs from the flat all-to-all, so the
/// losses and weights are bitwise the same; one node of four ranks has them within 1e-5.
#[test]
fn an_expert_parallel_group_across_two_nodes_exchanges_in_two_levels() {
    let llama = examples::example("llama");
    let dir = std::env::temp_dir().join(format!("zerorun-moe-nodes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("ds.json");
    std::fs::write(&cfg, r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}, "zero_optimization": {"stage": 2}}"#).unwrap();
    let args = |out: &Path| -> Vec<String> {
        let flags = "--experts 4 --top-k 2 --layers 2 --hidden 64 --ffn 96 --heads 4 --steps 4 --expert-parallel 4";
        let mut v: Vec<String> = vec!["--config".into(), cfg.to_str().unwrap().into()];
        v.extend(flags.split(' ').map(String::from));
        v.extend(["--save-final".into(), out.to_str().unwrap().into()]);
        v
    };
    let two_nodes = |all_to_all: &str| -> (Vec<String>, String, PathBuf) {
        let out = dir.join(format!("{all_to_all}.safetensors"));
        let port = ports::free_port().to_string();
        let nodes: Vec<_> = (0..2)
            .map(|node| {
                Command::new(env!("CARGO_BIN_EXE_zerorun"))
                    .args(["launch", "--nnodes", "2", "--node-rank", &node.to_string(), "--nproc-per-node", "2"])
                    .args(["--master-addr", "127.0.0.1", "--master-port", &port, "--"])
                    .arg(&llama)
                    .args(args(&out))
                    .env("ZERORUN_ALL_TO_ALL", all_to_all)
                    .env("RUST_LOG", "zerorun_comm::hierarchical=info")
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let (losses, stderr) = node_zero_output(nodes, all_to_all, "[rank 0] ");
        (losses, stderr, out)
    };
    let (two_level, said, two_level_out) = two_nodes("two-level");
    assert!(
        said.lines().any(|l| l.starts_with("[rank 0]")
            && l.contains("a group of whole hosts: two levels")
            && l.contains("two_level_all_to_all=true")),
        "rank 0 did not say its expert-parallel group runs in two levels:\n{said}"
    );
    let (flat, _, flat_out) = two_nodes("flat");
    assert_eq!(two_level.len(), 4, "{two_level:?}");
    assert_eq!(two_level, flat, "the two-level all-to-all gives the flat one's losses, bitwise");
    assert_eq!(load(&two_level_out), load(&flat_out), "and its weights");
    let one_out = dir.join("one-node.safetensors");
    let o = Command::new(env!("CARGO_BIN_EXE_zerorun"))
        .args(["launch", "--nproc-per-node", "4", "--"])
        .arg(&llama)
        .args(args(&one_out))
        .output()
        .unwrap();
    assert!(o.status.success(), "one node: {}", String::from_utf8_lossy(&o.stderr));
    let one: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("[rank 0] "))
        .filter(|l| l.starts_with("step "))
        .map(step_and_loss)
        .collect();
    assert_matches("experts across two nodes", &two_level, &one, &two_level_out, &load(&one_out));
    let _ = std::fs::remove_dir_all(&dir);
}
