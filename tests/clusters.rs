//! Where clusters run, against the real components: a cluster of two simulated hosts (network namespaces, each
//! with OpenSSH's sshd and a Slurm slurmd, slurmctld on the first, munge; `tests/cluster/hosts.sh`) runs the same
//! MLP job from a hostfile over ssh, as a program `srun` starts (no launcher), and as `zerorun launch` in an
//! `sbatch` script; each ends with the weights of two `zerorun launch --nnodes 2` on loopback, bitwise. SIGKILL of
//! one host's ranks stops the whole job within 5 s naming the host and rank, with nothing left running on any
//! host; so does Ctrl-C of the hostfile launch. Bad input (an unreachable host, a hostfile line, more ranks than
//! slots, an allocation that does not match `--nproc-per-node`) gets its error. Needs root (`make test` runs as
//! root in CI) and `make setup`'s openssh-server, slurmd, slurmctld and munge.
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

#[path = "common/examples.rs"]
mod examples;

const ZERORUN: &str = env!("CARGO_BIN_EXE_zerorun");
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cluster/hosts.sh");

/// A simulated cluster of two hosts, removed (daemons, processes, namespaces) when dropped.
struct Cluster {
    name: String,
    dir: PathBuf,
}

impl Cluster {
    fn up() -> Cluster {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        for tool in ["sshd", "slurmd", "slurmctld", "munged", "srun", "ssh"] {
            let found = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"].iter().any(|d| Path::new(d).join(tool).exists());
            assert!(found, "{tool} is not installed: `make setup` installs openssh-server, slurmd, slurmctld, munge");
        }
        let name = format!("zt{}{}", std::process::id() % 100_000, NEXT.fetch_add(1, Ordering::Relaxed));
        let dir = std::env::temp_dir().join(format!("zerorun-{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        let cluster = Cluster { name, dir };
        let o = Command::new("bash").args([SCRIPT, "up", &cluster.name]).arg(&cluster.dir).arg("2").output().unwrap();
        assert!(o.status.success(), "the cluster did not come up:\n{}", String::from_utf8_lossy(&o.stderr));
        cluster
    }

    /// A command on `host` (in its namespaces), with this cluster's ssh and Slurm configuration.
    fn on(&self, host: &str, args: &[&str]) -> Command {
        let mut c = Command::new("bash");
        c.args([SCRIPT, "on", &self.name, host])
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("SLURM_CONF", self.dir.join("slurm.conf"))
            .env("ZERORUN_SSH_OPTIONS", format!("-F {}", self.dir.join("ssh_config").display()));
        c
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    /// The processes running on `host` (in its network namespace): pid and command line (arguments joined by
    /// spaces).
    fn processes(&self, host: &str) -> Vec<(i32, String)> {
        let o = Command::new("ip").args(["netns", "pids", &format!("{}-{host}", self.name)]).output().unwrap();
        String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .filter_map(|pid| {
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                Some((pid.parse().ok()?, String::from_utf8_lossy(&cmd).replace('\0', " ")))
            })
            .collect()
    }

    /// The job's processes still running on any host (ranks or launchers).
    fn leftovers(&self) -> Vec<String> {
        ["node0", "node1"]
            .iter()
            .flat_map(|h| self.processes(h))
            .filter(|(_, cmd)| cmd.contains("examples/mlp") || cmd.contains(" launch "))
            .map(|(pid, cmd)| format!("{pid}: {cmd}"))
            .collect()
    }

    /// The job's processes on `host`: its ranks, and with `launcher` its launcher too.
    fn job_on(&self, host: &str, launcher: bool) -> Vec<i32> {
        self.processes(host)
            .into_iter()
            .filter(|(_, cmd)| {
                let argv0 = cmd.split(' ').next().unwrap_or_default();
                argv0.ends_with("examples/mlp") || (launcher && cmd.contains("examples/mlp"))
            })
            .map(|(pid, _)| pid)
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash").args([SCRIPT, "down", &self.name]).arg(&self.dir).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const MLP_FLAGS: [&str; 12] =
    ["--steps", "6", "--seed", "3", "--in", "16", "--hidden", "48", "--layers", "4", "--out", "4"];

fn config(dir: &Path) -> PathBuf {
    let cfg = dir.join("zero2.json");
    std::fs::write(&cfg, r#"{"train_batch_size": 12, "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}}, "zero_optimization": {"stage": 2}}"#).unwrap();
    cfg
}

fn ok(what: &str, o: &Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{what} failed:\n{out}\n{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// The reference: two launchers as two nodes on loopback (`--nnodes 2`), 2 ranks each.
fn two_launchers(mlp: &Path, cfg: &Path, out: &Path) {
    let port = 20000 + (std::process::id() % 20000) as u16;
    let launchers: Vec<Child> = (0..2)
        .map(|node| {
            Command::new(ZERORUN)
                .args(["launch", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", &node.to_string()])
                .args(["--master-addr", "127.0.0.1", "--master-port", &port.to_string(), "--"])
                .arg(mlp)
                .arg("--config")
                .arg(cfg)
                .args(MLP_FLAGS)
                .arg("--save-final")
                .arg(out)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, l) in launchers.into_iter().enumerate() {
        ok(&format!("reference launcher {i}"), &l.wait_with_output().unwrap());
    }
}

#[test]
fn hostfile_srun_and_sbatch_end_with_the_weights_of_two_launchers() {
    let mlp = examples::example("mlp");
    let cluster = Cluster::up();
    let cfg = config(&cluster.dir);
    let reference = cluster.dir.join("reference.safetensors");
    two_launchers(&mlp, &cfg, &reference);
    let reference = std::fs::read(&reference).unwrap();

    // A hostfile over ssh, from node0: one command, every host's lines prefixed with it.
    let hostfile = cluster.file("hostfile", "# the simulated hosts\nnode0 slots=2\nnode1 slots=2\n");
    let out = cluster.dir.join("hostfile.safetensors");
    let o = cluster
        .on("node0", &[ZERORUN, "launch", "--hostfile", hostfile.to_str().unwrap(), "--", mlp.to_str().unwrap()])
        .args(["--config", cfg.to_str().unwrap()])
        .args(MLP_FLAGS)
        .args(["--save-final", out.to_str().unwrap()])
        .output()
        .unwrap();
    let text = ok("the hostfile launch", &o);
    assert!(text.lines().any(|l| l.starts_with("[node0] [rank 0] step 6 loss")), "{text}");
    assert!(text.lines().any(|l| l.starts_with("[node1] [rank 2] peak_rss_bytes")), "{text}");
    assert!(std::fs::read(&out).unwrap() == reference, "the hostfile job's weights differ from the reference");

    // srun starts the ranks themselves: no launcher, Slurm's variables.
    let out = cluster.dir.join("srun.safetensors");
    let o = cluster
        .on("node0", &["srun", "--nodes=2", "--ntasks-per-node=2", mlp.to_str().unwrap()])
        .args(["--config", cfg.to_str().unwrap()])
        .args(MLP_FLAGS)
        .args(["--save-final", out.to_str().unwrap()])
        .output()
        .unwrap();
    let text = ok("srun", &o);
    assert!(text.contains("summary: 4 ranks, ZeRO stage 2, 6 optimizer steps"), "{text}");
    assert!(std::fs::read(&out).unwrap() == reference, "the srun job's weights differ from the reference");

    // sbatch: `zerorun launch` in the batch script starts one launcher per node through srun.
    let out = cluster.dir.join("sbatch.safetensors");
    let log = cluster.dir.join("sbatch.log");
    let script = cluster.file(
        "job.sh",
        &format!(
            "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n{ZERORUN} launch -- {} --config {} {} --save-final {}\n",
            mlp.display(),
            cfg.display(),
            MLP_FLAGS.join(" "),
            out.display()
        ),
    );
    let o = cluster
        .on("node0", &["sbatch", "--wait", "-o", log.to_str().unwrap(), script.to_str().unwrap()])
        .output()
        .unwrap();
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    ok(&format!("sbatch ({log_text})"), &o);
    assert!(log_text.contains("[rank 0] summary: 4 ranks, ZeRO stage 2, 6 optimizer steps"), "{log_text}");
    assert!(std::fs::read(&out).unwrap() == reference, "the sbatch job's weights differ from the reference");

    // The allocation and --nproc-per-node must agree.
    let bad = cluster.file(
        "bad.sh",
        &format!("#!/bin/bash\n{ZERORUN} launch --nproc-per-node 3 -- {} --config {}\n", mlp.display(), cfg.display()),
    );
    let log = cluster.dir.join("bad.log");
    let o = cluster
        .on("node0", &["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=2", "-o", log.to_str().unwrap()])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!o.status.success(), "a mismatched allocation ran");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains(
            "error: --nproc-per-node 3 does not match the Slurm allocation's 2 tasks per node (SLURM_NTASKS_PER_NODE)"
        ),
        "{text}"
    );
}

/// Starts a long hostfile job from node0 and waits for its third step; returns the driver and its stderr lines.
fn long_job(cluster: &Cluster, mlp: &Path) -> (Child, std::sync::mpsc::Receiver<String>) {
    let cfg = config(&cluster.dir);
    let hostfile = cluster.file("hostfile", "node0 slots=2\nnode1 slots=2\n");
    let mut driver = cluster
        .on("node0", &[ZERORUN, "launch", "--hostfile", hostfile.to_str().unwrap(), "--", mlp.to_str().unwrap()])
        .args(["--config", cfg.to_str().unwrap(), "--steps", "1000000", "--in", "16", "--hidden", "48"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = driver.stdout.take().unwrap();
    let stderr = driver.stderr.take().unwrap();
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("[node0] [rank 0] step 3 ") {
                let _ = started_tx.send(());
            }
        }
    });
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    started_rx.recv_timeout(Duration::from_secs(120)).expect("the job reached no third step");
    (driver, rx)
}

/// Waits for the driver to end; returns its exit status and how long that took.
fn ended_within(driver: &mut Child, limit: Duration) -> (std::process::ExitStatus, Duration) {
    let start = Instant::now();
    loop {
        if let Some(s) = driver.try_wait().unwrap() {
            return (s, start.elapsed());
        }
        if start.elapsed() > limit {
            let _ = driver.kill();
            panic!("the job did not stop within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigkill_of_a_hosts_ranks_or_ctrl_c_stops_every_host() {
    let mlp = examples::example("mlp");
    let cluster = Cluster::up();

    let (mut driver, stderr) = long_job(&cluster, &mlp);
    let victims = cluster.job_on("node1", false);
    assert_eq!(victims.len(), 2, "node1 runs two ranks");
    for pid in &victims {
        // SAFETY: kill(2) on the test's own job's ranks.
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
    let (status, took) = ended_within(&mut driver, Duration::from_secs(30));
    assert!(took <= Duration::from_secs(5), "the job took {took:?} to stop");
    assert!(!status.success());
    let lines: Vec<String> = stderr.try_iter().collect();
    let error = lines.iter().find(|l| l.starts_with("error: ")).cloned().unwrap_or_default();
    assert!(
        error.contains("(node 1, host node1) was killed by signal 9 (SIGKILL)") && error.contains("host node0"),
        "the error names no host and rank: {error}\n{}",
        lines.join("\n")
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(cluster.leftovers(), Vec::<String>::new(), "left running after the failure");

    // Ctrl-C on the command that started it all: every host's ranks stop.
    let (mut driver, _stderr) = long_job(&cluster, &mlp);
    // SAFETY: kill(2) on the test's own child.
    unsafe { libc::kill(driver.id() as i32, libc::SIGINT) };
    let (status, took) = ended_within(&mut driver, Duration::from_secs(30));
    assert!(!status.success() && took <= Duration::from_secs(10), "Ctrl-C: {status:?} after {took:?}");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(cluster.leftovers(), Vec::<String>::new(), "left running after Ctrl-C");
}

#[test]
fn hostfile_forwards_the_environment_and_names_bad_hosts_and_lines() {
    let cluster = Cluster::up();
    // ZERORUN_* from here and ~/.deepspeed_env's lines reach every host's ranks; --ssh-port reaches ssh.
    std::fs::write(cluster.dir.join(".deepspeed_env"), "DS_SAYS=from-deepspeed-env\n# a comment\n").unwrap();
    let hosts = cluster.file("hosts-env", "node0 slots=1\nnode1 slots=1\n");
    let o = cluster
        .on("node0", &[ZERORUN, "launch", "--hostfile", hosts.to_str().unwrap(), "--ssh-port", "2222", "--"])
        .args(["sh", "-c", "echo \"env $ZERORUN_TEST_VALUE $DS_SAYS $(hostname) $RANK\""])
        .env("ZERORUN_TEST_VALUE", "from-here")
        .env("HOME", &cluster.dir)
        .output()
        .unwrap();
    let text = ok("the environment job", &o);
    for line in [
        "[node0] [rank 0] env from-here from-deepspeed-env node0 0",
        "[node1] [rank 1] env from-here from-deepspeed-env node1 1",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
    }

    let run = |hostfile: &str, extra: &[&str]| {
        let hosts = cluster.file("hosts-bad", hostfile);
        let o = cluster
            .on("node0", &[ZERORUN, "launch", "--hostfile", hosts.to_str().unwrap()])
            .args(extra)
            .args(["--", "true"])
            .output()
            .unwrap();
        assert!(!o.status.success(), "{hostfile:?} ran");
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        err.lines().find(|l| l.starts_with("error: ")).unwrap_or(&err).to_string()
    };
    let path = cluster.dir.join("hosts-bad");
    assert_eq!(
        run("node0 slots=2\nnode1 slots=two\n", &[]),
        format!("error: {}:2: \"node1 slots=two\" is not `HOST slots=N` (N >= 1)", path.display())
    );
    assert_eq!(
        run("node0 slots=2\nnode1 slots=2\n", &["--nproc-per-node", "3"]),
        "error: --nproc-per-node 3: more ranks asked than slots: host \"node0\" has 2 slots"
    );
    // An address nothing answers at: named within ssh's connect timeout.
    let start = Instant::now();
    let err = run("node0 slots=1\n10.214.0.99 slots=1\n", &[]);
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    assert!(err.starts_with("error: host 10.214.0.99 failed over ssh (unreachable"), "{err}");
    assert!(cluster.leftovers().is_empty(), "left running: {:?}", cluster.leftovers());
}

/// `--nnodes 1:2 --max-restarts 1` over a hostfile: a host lost mid-run (its launcher and ranks SIGKILLed) and the
/// job goes on from the latest checkpoint on the host left, to the end.
#[test]
fn an_elastic_hostfile_job_goes_on_without_a_lost_host() {
    let mlp = examples::example("mlp");
    let cluster = Cluster::up();
    let cfg = config(&cluster.dir);
    let ck = cluster.dir.join("ck");
    let hostfile = cluster.file("hostfile", "node0 slots=2\nnode1 slots=2\n");
    let hosts = hostfile.to_str().unwrap();
    let driver = cluster
        .on("node0", &[ZERORUN, "launch", "--hostfile", hosts, "--nnodes", "1:2", "--max-restarts", "1", "--"])
        .arg(&mlp)
        .args(["--config", cfg.to_str().unwrap(), "--steps", "24", "--in", "16", "--hidden", "48"])
        .args(["--checkpoint-dir", ck.to_str().unwrap(), "--save-every", "2", "--resume"])
        .args(["--slow-rank", "0", "--slow-ms", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !ck.join("latest").exists() {
        assert!(start.elapsed() < Duration::from_secs(120), "no checkpoint was written");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The whole host: its launcher and its ranks.
    let job = cluster.job_on("node1", true);
    assert!(job.len() >= 3, "node1's launcher and two ranks: {job:?}");
    for pid in job {
        // SAFETY: kill(2) on the test's own job.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let o = driver.wait_with_output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "the elastic job failed:\n{out}\n{err}");
    assert!(err.contains("restarting (1 of 1) on 1 node from the latest checkpoint"), "{err}");
    assert!(out.contains("[node0] [rank 0] summary: 2 ranks, ZeRO stage 2, 24 optimizer steps"), "{out}");
    assert!(cluster.leftovers().is_empty(), "left running: {:?}", cluster.leftovers());
}

/// Under Slurm, SIGKILL of one host's ranks stops the whole job within 5 s, the host and rank named: by the
/// launchers' protocol in an `sbatch` script, by Slurm itself when `srun` started the ranks.
#[test]
fn sigkill_under_slurm_stops_every_host() {
    let mlp = examples::example("mlp");
    let cluster = Cluster::up();
    let cfg = config(&cluster.dir);
    let long = format!("{} --config {} --steps 1000000 --in 16 --hidden 48", mlp.display(), cfg.display());
    for (name, body) in [
        ("sbatch-launch", format!("{ZERORUN} launch -- {long}")),
        ("sbatch-srun", format!("srun --kill-on-bad-exit=1 {long}")),
    ] {
        let log = cluster.dir.join(format!("{name}.log"));
        let script = cluster.file(&format!("{name}.sh"), &format!("#!/bin/bash\n{body}\n"));
        let submitted = cluster
            .on("node0", &["sbatch", "--nodes=2", "--ntasks-per-node=2", "-o", log.to_str().unwrap()])
            .arg(&script)
            .output()
            .unwrap();
        ok(&format!("{name}: sbatch"), &submitted);
        let start = Instant::now();
        while !std::fs::read_to_string(&log).unwrap_or_default().contains("step 3 ") {
            assert!(start.elapsed() < Duration::from_secs(120), "{name}: no third step");
            std::thread::sleep(Duration::from_millis(50));
        }
        let victims = cluster.job_on("node1", false);
        assert_eq!(victims.len(), 2, "{name}: node1 runs two ranks");
        for pid in &victims {
            // SAFETY: kill(2) on the test's own job's ranks.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
        }
        let killed = Instant::now();
        while !cluster.leftovers().is_empty() {
            assert!(killed.elapsed() <= Duration::from_secs(5), "{name}: still running: {:?}", cluster.leftovers());
            std::thread::sleep(Duration::from_millis(50));
        }
        // The batch script's last lines land in the log as the job ends.
        let wanted = if name == "sbatch-launch" {
            "(node 1, host node1) was killed by signal 9 (SIGKILL)"
        } else {
            "node1: task"
        };
        let mut text = String::new();
        while killed.elapsed() < Duration::from_secs(30) {
            text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains(wanted) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(text.contains(wanted), "{name}: the log names no host and rank ({wanted:?}):\n{text}");
        eprintln!("{name}: {}", text.lines().filter(|l| l.contains(wanted)).collect::<Vec<_>>().join(" | "));
    }
}
