//! `zerorun bench cluster --hosts H --ranks-per-host K --link RATE [--json] -- PROGRAM ARGS...`: a cluster of H
//! hosts simulated on this machine, to measure what crosses hosts. Each host is a network namespace joined to a
//! switch namespace by a veth pair whose two ends are limited with `tc ... tbf` to RATE (so RATE in each direction);
//! one `zerorun launch --nnodes H` runs in each, its ranks speaking gloo across hosts (or, with `--launcher torchrun`,
//! one `torchrun` per host running a PyTorch program: how DeepSpeed is measured beside zerorun). It prints the median step
//! (from the program's `step N loss X time T ms` lines), the bytes each rank sent across hosts (the host's link,
//! counted by the kernel) and inside its host (loopback), and the link floor: the busiest host's cross-host bytes of
//! a step over RATE. Each host's launcher and ranks are pinned to its share of this machine's CPUs, as a real host
//! owns its cores (`--cores-per-host`). Needs root (CAP_NET_ADMIN); the namespaces are removed however the run
//! ends (a signal included), and only their own addresses (10.213.0.0/24) are used.
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use super::{emit, CliError};

#[derive(Args)]
pub struct ClusterArgs {
    /// Hosts (network namespaces).
    #[arg(long, default_value_t = 2)]
    pub hosts: usize,
    /// Ranks per host.
    #[arg(long, default_value_t = 1)]
    pub ranks_per_host: usize,
    /// Each host link's rate in each direction, as `tc` writes it: 1gbit, 10gbit, 500mbit.
    #[arg(long, default_value = "1gbit")]
    pub link: String,
    /// One JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// What starts each host's ranks: `zerorun launch`, or `torchrun` (from PATH; gloo is told the host's
    /// interface with GLOO_SOCKET_IFNAME) for a PyTorch program, e.g. DeepSpeed's side of a comparison. The
    /// program prints rank 0's `[rank 0] step N loss X time T ms` lines itself then.
    #[arg(long, value_enum, default_value_t = Launcher::Zerorun)]
    pub launcher: Launcher,
    /// Keep each host's output: DIR/hostN.out and DIR/hostN.err (the launcher's stdout and stderr, every
    /// rank's lines), e.g. for the program's wall-clock breakdown.
    #[arg(long, value_name = "DIR")]
    pub log: Option<PathBuf>,
    /// CPUs each simulated host owns: host i's launcher and ranks run on the i-th N of this machine's CPUs, as a
    /// real host's run on its own, so a launcher shares only its host's cores among its ranks (libtorch, MKL and
    /// rayon threads) and hosts do not take each other's. Left out, the machine's CPUs split evenly among the hosts
    /// (shared by all when there are fewer CPUs than hosts); 0 shares them all.
    #[arg(long, value_name = "N")]
    pub cores_per_host: Option<usize>,
    /// More flags for every host's `zerorun launch` (repeat it), e.g. `--launch-arg=--fault-tolerant`.
    #[arg(long = "launch-arg", value_name = "FLAG", allow_hyphen_values = true)]
    pub launch_args: Vec<String>,
    /// The program to run on every host (its arguments follow), e.g. an example with its flags.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Launcher {
    Zerorun,
    Torchrun,
}

/// `tc`'s rate spelling, in bits per second.
fn parse_rate(rate: &str) -> Option<f64> {
    let lower = rate.trim().to_ascii_lowercase();
    let digits = lower.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(lower.len());
    let (number, unit) = lower.split_at(digits);
    let scale = match unit {
        "bit" | "" => 1.0,
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        "tbit" => 1e12,
        _ => return None,
    };
    number.parse::<f64>().ok().filter(|v| *v > 0.0).map(|v| v * scale)
}

/// Runs `ip`/`tc` (or a command in a namespace); its error names the command.
fn sh(args: &[&str]) -> Result<String, CliError> {
    let out = Command::new(args[0]).args(&args[1..]).stdin(Stdio::null()).output().map_err(|e| CliError::Io {
        context: format!("running `{}` (iproute2 installed?)", args.join(" ")),
        source: e,
    })?;
    if !out.status.success() {
        return Err(CliError::Usage(format!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The namespaces of one run, removed when dropped.
struct Cluster {
    prefix: String,
    hosts: usize,
}

impl Cluster {
    fn host(&self, i: usize) -> String {
        format!("{}h{i}", self.prefix)
    }

    fn switch(&self) -> String {
        format!("{}sw", self.prefix)
    }

    fn address(i: usize) -> String {
        format!("10.213.0.{}", i + 1)
    }

    /// Makes the switch (a bridge in a namespace) and the hosts, each on a veth limited to `rate` both ways.
    fn build(prefix: String, hosts: usize, rate: &str) -> Result<Cluster, CliError> {
        let cluster = Cluster { prefix, hosts };
        let sw = cluster.switch();
        sh(&["ip", "netns", "add", &sw])?;
        sh(&["ip", "-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        sh(&["ip", "-n", &sw, "link", "set", "br0", "up"])?;
        for i in 0..hosts {
            let (ns, host_end, switch_end) =
                (cluster.host(i), format!("{}e{i}", cluster.prefix), format!("{}s{i}", cluster.prefix));
            sh(&["ip", "netns", "add", &ns])?;
            sh(&["ip", "link", "add", &host_end, "type", "veth", "peer", "name", &switch_end])?;
            sh(&["ip", "link", "set", &host_end, "netns", &ns])?;
            sh(&["ip", "link", "set", &switch_end, "netns", &sw])?;
            sh(&["ip", "-n", &ns, "link", "set", &host_end, "name", "eth0"])?;
            sh(&["ip", "-n", &ns, "addr", "add", &format!("{}/24", Cluster::address(i)), "dev", "eth0"])?;
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
            sh(&["ip", "-n", &sw, "link", "set", &switch_end, "master", "br0"])?;
            sh(&["ip", "-n", &sw, "link", "set", &switch_end, "up"])?;
            // RATE out of the host and RATE into it: a full-duplex link of that speed.
            for (space, dev) in [(&ns, "eth0"), (&sw, switch_end.as_str())] {
                sh(&[
                    "ip", "netns", "exec", space, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", "256kb", "latency", "100ms",
                ])?;
            }
        }
        Ok(cluster)
    }

    /// Bytes sent by host `i` on `dev`.
    fn tx_bytes(&self, i: usize, dev: &str) -> Result<u64, CliError> {
        let text =
            sh(&["ip", "netns", "exec", &self.host(i), "cat", &format!("/sys/class/net/{dev}/statistics/tx_bytes")])?;
        text.trim().parse().map_err(|_| CliError::Usage(format!("tx_bytes of {dev} on host {i}: {text:?}")))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.hosts {
            let _ = Command::new("ip").args(["netns", "del", &self.host(i)]).stderr(Stdio::null()).status();
        }
        let _ = Command::new("ip").args(["netns", "del", &self.switch()]).stderr(Stdio::null()).status();
    }
}

/// Median of the `time T ms` of rank 0's `step N loss X time T ms` lines, the first two (warm-up) left out when
/// there are more; how many steps there were; and the last step's loss (runs of two programs on the same data and
/// weights are seen to train alike).
fn median_step(output: &str) -> Option<(f64, usize, Option<f64>)> {
    let lines: Vec<&str> = output.lines().filter_map(|l| l.strip_prefix("[rank 0] step ")).collect();
    let last_loss = lines.last().and_then(|l| l.split(" loss ").nth(1)?.split_whitespace().next()?.parse().ok());
    let mut times: Vec<f64> = lines
        .iter()
        .filter_map(|l| l.split(" time ").nth(1)?.split(" ms").next()?.trim().parse::<f64>().ok())
        .collect();
    let steps = times.len();
    if times.len() > 2 {
        times.drain(..2);
    }
    times.sort_by(f64::total_cmp);
    times.get(times.len() / 2).map(|t| (t / 1e3, steps, last_loss))
}

/// The CPUs this process may run on (its affinity mask).
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

/// Each host's CPUs (`--cores-per-host`), or `None` where the hosts share the machine's.
fn host_cpus(requested: Option<usize>, hosts: usize, cpus: &[usize]) -> Result<Option<Vec<Vec<usize>>>, CliError> {
    let per_host = match requested {
        Some(0) => return Ok(None),
        Some(n) if n * hosts > cpus.len() => {
            return Err(CliError::Usage(format!(
                "--cores-per-host {n}: {hosts} hosts need {} CPUs and this process may use {}",
                n * hosts,
                cpus.len()
            )))
        }
        Some(n) => n,
        None if cpus.len() < hosts => return Ok(None),
        None => cpus.len() / hosts,
    };
    Ok(Some(cpus.chunks(per_host).take(hosts).map(<[usize]>::to_vec).collect()))
}

/// The first `name` on PATH: a namespace's `ip netns exec` would find it too, but its error would not say what
/// was missing.
fn find_in_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(name)).find(|p| p.is_file())
}

pub fn run(a: ClusterArgs) -> Result<(), CliError> {
    if a.hosts < 2 || a.ranks_per_host == 0 {
        return Err(CliError::Usage("bench cluster: --hosts at least 2 and --ranks-per-host at least 1".into()));
    }
    let rate_bits = parse_rate(&a.link).ok_or_else(|| {
        CliError::Usage(format!("--link {:?}: a rate as tc writes it (1gbit, 500mbit, 10gbit)", a.link))
    })?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(CliError::Usage(
            "bench cluster makes network namespaces and rate-limited links, which needs root (CAP_NET_ADMIN): run it with sudo".into(),
        ));
    }
    let zerorun = std::env::current_exe().map_err(|e| CliError::Io { context: "finding zerorun".into(), source: e })?;
    let torchrun = match a.launcher {
        Launcher::Torchrun => find_in_path("torchrun").ok_or_else(|| {
            CliError::Usage("--launcher torchrun: no `torchrun` on PATH (activate the venv with torch)".into())
        })?,
        Launcher::Zerorun => PathBuf::new(),
    };
    let program = PathBuf::from(&a.command[0]);
    let program =
        if program.components().count() > 1 { std::fs::canonicalize(&program).unwrap_or(program) } else { program };
    // The namespaces go whatever happens: Drop, and on SIGINT/SIGTERM the launchers are stopped first.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())
            .map_err(|e| CliError::Io { context: "installing signal handlers".into(), source: e })?;
    }
    let pinned = host_cpus(a.cores_per_host, a.hosts, &allowed_cpus())?;
    let cluster = Cluster::build(format!("zr{}", std::process::id() % 100_000), a.hosts, &a.link)?;
    let before: Vec<(u64, u64)> = (0..a.hosts)
        .map(|i| Ok((cluster.tx_bytes(i, "eth0")?, cluster.tx_bytes(i, "lo")?)))
        .collect::<Result<_, CliError>>()?;
    let port = "29500";
    let mut launchers = Vec::new();
    for i in 0..a.hosts {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &cluster.host(i)]);
        let (nnodes, node_rank, per_host) = (a.hosts.to_string(), i.to_string(), a.ranks_per_host.to_string());
        match a.launcher {
            Launcher::Zerorun => {
                cmd.arg(&zerorun)
                    .args(["--quiet", "launch", "--nnodes", &nnodes, "--node-rank", &node_rank])
                    .args(["--nproc-per-node", &per_host, "--backend", "gloo"])
                    .args(["--master-addr", &Cluster::address(0), "--master-port", port])
                    .args(&a.launch_args)
                    .arg("--")
                    // gloo binds this host's address (its hostname is the machine's, not the namespace's).
                    .env("ZERORUN_HOST_ADDR", Cluster::address(i));
            }
            Launcher::Torchrun => {
                cmd.arg(&torchrun)
                    .args(["--nnodes", &nnodes, "--node-rank", &node_rank, "--nproc-per-node", &per_host])
                    .args(["--master-addr", &Cluster::address(0), "--master-port", port])
                    .env("GLOO_SOCKET_IFNAME", "eth0");
            }
        }
        cmd.arg(&program).args(&a.command[1..]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        if let Some(cpus) = &pinned {
            // SAFETY: a zeroed cpu_set_t is an empty set, and CPU_SET writes inside it (the CPUs came from one).
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            for &c in &cpus[i] {
                unsafe { libc::CPU_SET(c, &mut set) };
            }
            // SAFETY: between fork and exec only sched_setaffinity runs, on a set built before the fork.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        launchers.push(
            cmd.spawn().map_err(|e| CliError::Io { context: format!("starting host {i}'s launcher"), source: e })?,
        );
    }
    // Wait for every launcher; a signal stops them all.
    let mut outputs: Vec<Option<std::process::Output>> = (0..a.hosts).map(|_| None).collect();
    let mut children: Vec<Option<std::process::Child>> = launchers.into_iter().map(Some).collect();
    while outputs.iter().any(Option::is_none) {
        for (i, slot) in children.iter_mut().enumerate() {
            let done = slot.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
            if done {
                outputs[i] = slot.take().and_then(|c| c.wait_with_output().ok());
            }
        }
        if stop.load(Ordering::Relaxed) {
            for c in children.iter_mut().flatten() {
                // SAFETY: kill(2) on a child we started.
                unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let after: Vec<(u64, u64)> = (0..a.hosts)
        .map(|i| Ok((cluster.tx_bytes(i, "eth0")?, cluster.tx_bytes(i, "lo")?)))
        .collect::<Result<_, CliError>>()?;
    drop(cluster);
    let outputs: Vec<std::process::Output> = outputs.into_iter().map(|o| o.expect("waited")).collect();
    if let Some(dir) = &a.log {
        let io = |path: &std::path::Path| {
            let context = format!("writing the hosts' output to {}", path.display());
            move |source: std::io::Error| CliError::Io { context, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        for (i, o) in outputs.iter().enumerate() {
            for (ext, bytes) in [("out", &o.stdout), ("err", &o.stderr)] {
                let path = dir.join(format!("host{i}.{ext}"));
                std::fs::write(&path, bytes).map_err(io(&path))?;
            }
        }
    }
    for (i, o) in outputs.iter().enumerate() {
        if !o.status.success() {
            return Err(CliError::Usage(format!(
                "host {i}'s launcher failed:\n{}",
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .rev()
                    .take(12)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n")
            )));
        }
    }
    let host0 = String::from_utf8_lossy(&outputs[0].stdout);
    let (step_s, steps, last_loss) = median_step(&host0).ok_or_else(|| {
        CliError::Usage("the program printed no `step N loss X time T ms` lines on rank 0 (the examples do)".into())
    })?;
    let k = a.ranks_per_host as f64;
    let cross: Vec<f64> = before.iter().zip(&after).map(|(b, e)| e.0.saturating_sub(b.0) as f64).collect();
    let inside: Vec<f64> = before.iter().zip(&after).map(|(b, e)| e.1.saturating_sub(b.1) as f64).collect();
    let per_step = |total: f64| total / steps.max(1) as f64;
    let busiest = cross.iter().copied().fold(0.0, f64::max);
    let floor_s = per_step(busiest) * 8.0 / rate_bits;
    let report = serde_json::json!({
        "hosts": a.hosts, "ranks_per_host": a.ranks_per_host, "link": a.link, "link_bits_per_s": rate_bits,
        "steps": steps, "median_step_s": step_s, "last_loss": last_loss,
        "cores_per_host": pinned.as_ref().map(|p| p[0].len()),
        "cross_host_bytes_per_rank_per_step": cross.iter().map(|&b| per_step(b) / k).collect::<Vec<_>>(),
        "inside_host_bytes_per_rank_per_step": inside.iter().map(|&b| per_step(b) / k).collect::<Vec<_>>(),
        "link_floor_s": floor_s, "step_over_floor": step_s / floor_s.max(1e-12),
    });
    if a.json {
        return emit(&report.to_string());
    }
    let mib = |b: f64| b / 1048576.0;
    let mut text = format!(
        "{} hosts x {} ranks ({}), links of {} each way, {steps} steps: median step {:.3} s, link floor {:.3} s ({:.2}x the floor)\nhost  cross-host MiB/rank/step  inside-host MiB/rank/step",
        a.hosts,
        a.ranks_per_host,
        pinned.as_ref().map_or("CPUs shared by the hosts".into(), |p| format!("{} CPUs per host", p[0].len())),
        a.link,
        step_s,
        floor_s,
        step_s / floor_s.max(1e-12)
    );
    for i in 0..a.hosts {
        text.push_str(&format!(
            "\n{i:>4}  {:>24.2}  {:>25.2}",
            mib(per_step(cross[i]) / k),
            mib(per_step(inside[i]) / k)
        ));
    }
    emit(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_step_lines_are_read() {
        assert_eq!(parse_rate("1gbit"), Some(1e9));
        assert_eq!(parse_rate("500mbit"), Some(5e8));
        assert_eq!(parse_rate("fast"), None);
        let out = "[rank 0] step 1 loss 2.0 time 900 ms 10 tokens/s\n[rank 1] step 1 loss 2.0 time 1 ms\n[rank 0] step 2 loss 1.9 time 100 ms 1 tokens/s\n[rank 0] step 3 loss 1.8 time 200 ms 1 tokens/s\n[rank 0] step 4 loss 1.7 time 300 ms 1 tokens/s\n";
        assert_eq!(median_step(out), Some((0.3, 4, Some(1.7))));
    }

    #[test]
    fn hosts_get_disjoint_cpus() {
        let cpus = [0, 1, 2, 3, 5];
        assert_eq!(host_cpus(None, 2, &cpus).unwrap(), Some(vec![vec![0, 1], vec![2, 3]]));
        assert_eq!(host_cpus(Some(1), 2, &cpus).unwrap(), Some(vec![vec![0], vec![1]]));
        assert_eq!(host_cpus(None, 8, &cpus).unwrap(), None);
        assert_eq!(host_cpus(Some(0), 2, &cpus).unwrap(), None);
        let err = host_cpus(Some(3), 2, &cpus).unwrap_err().to_string();
        assert!(err.contains("--cores-per-host 3: 2 hosts need 6 CPUs and this process may use 5"), "{err}");
    }
}
