//! Slurm's view of a job, from the variables `srun` and `sbatch` set: a process started by `srun` (one task per
//! rank) finds its place with no launcher (`RankInfo::from_env`), and `zerorun launch` inside an allocation starts
//! one launcher per node through `srun` (`src/cli/launch_slurm.rs`).
//!
//! Only a job *step* (`srun`, which sets SLURM_STEP_ID) is a set of ranks: a batch script also sees SLURM_PROCID=0
//! and SLURM_NTASKS=N, but it is one process, and taking it for rank 0 of N would wait forever for the others.

/// The variables of a process that `srun` started, as a job's ranks read them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmStep {
    /// SLURM_PROCID: this task's rank in the step.
    pub rank: usize,
    /// SLURM_STEP_NUM_TASKS (else SLURM_NTASKS): tasks in the step.
    pub world_size: usize,
    /// SLURM_LOCALID: this task's rank on its node.
    pub local_rank: usize,
    /// Tasks on this node (SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID).
    pub local_world_size: usize,
    /// SLURM_NODEID: this node's index in the step.
    pub node: usize,
    /// The step's hosts (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST), expanded.
    pub hosts: Vec<String>,
    /// SLURM_JOB_ID.
    pub job_id: u64,
}

/// Where the ranks of a Slurm job meet unless MASTER_PORT says otherwise: a port from the job id, so two jobs
/// sharing a first node do not collide (the launcher's own rendezvous takes the next port too).
pub fn port_of_job(job_id: u64) -> u16 {
    15000 + (job_id % 20000) as u16 * 2
}

fn number(name: &str, value: &str) -> Result<usize, String> {
    value.trim().parse().map_err(|_| format!("{name}={value:?} is not a number"))
}

impl SlurmStep {
    /// This process's step, when `srun` started it (SLURM_STEP_ID and SLURM_PROCID set among the variables `var`
    /// gives: `RankInfo::from_env` passes the environment); else None.
    pub fn from_vars(var: super::rank_info::Lookup) -> Result<Option<SlurmStep>, String> {
        let (Some(_), Some(procid)) = (var("SLURM_STEP_ID").or_else(|| var("SLURM_STEPID")), var("SLURM_PROCID"))
        else {
            return Ok(None);
        };
        let rank = number("SLURM_PROCID", &procid)?;
        let tasks = var("SLURM_STEP_NUM_TASKS").or_else(|| var("SLURM_NTASKS")).unwrap_or_else(|| "1".into());
        let world_size = number("SLURM_STEP_NUM_TASKS", &tasks)?;
        let local_rank = number("SLURM_LOCALID", &var("SLURM_LOCALID").unwrap_or_else(|| "0".into()))?;
        let node = number("SLURM_NODEID", &var("SLURM_NODEID").unwrap_or_else(|| "0".into()))?;
        let list =
            var("SLURM_STEP_NODELIST").or_else(|| var("SLURM_JOB_NODELIST")).or_else(|| var("SLURM_NODELIST")).ok_or(
                "srun set no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: the first host is where the ranks meet",
            )?;
        let hosts = expand_hostlist(&list).map_err(|e| format!("SLURM_STEP_NODELIST={list:?}: {e}"))?;
        let per_node = var("SLURM_STEP_TASKS_PER_NODE").or_else(|| var("SLURM_TASKS_PER_NODE"));
        let local_world_size = match per_node {
            Some(text) => {
                let counts = expand_counts(&text).map_err(|e| format!("SLURM_STEP_TASKS_PER_NODE={text:?}: {e}"))?;
                *counts.get(node).ok_or_else(|| {
                    format!("SLURM_STEP_TASKS_PER_NODE={text:?} names {} nodes; SLURM_NODEID is {node}", counts.len())
                })?
            }
            None => world_size / hosts.len().max(1),
        };
        let job_id = var("SLURM_JOB_ID").or_else(|| var("SLURM_JOBID")).unwrap_or_else(|| "0".into());
        let job_id = number("SLURM_JOB_ID", &job_id)? as u64;
        if rank >= world_size || local_rank >= local_world_size.max(1) {
            return Err(format!(
                "SLURM_PROCID={rank} SLURM_LOCALID={local_rank} do not fit {world_size} tasks, {local_world_size} on this node"
            ));
        }
        Ok(Some(SlurmStep { rank, world_size, local_rank, local_world_size, node, hosts, job_id }))
    }
}

/// Expands Slurm's hostlist syntax: `node[01-03,7],gpu5` is node01 node02 node03 node7 gpu5; ranges keep their
/// zero padding, and a name may hold several bracket groups (`r[1-2]n[1-2]`: r1n1 r1n2 r2n1 r2n2).
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top_level(list)? {
        if item.is_empty() {
            continue;
        }
        hosts.extend(expand_item(&item)?);
    }
    if hosts.is_empty() {
        return Err("no host in the list".into());
    }
    Ok(hosts)
}

/// The list's items: commas outside brackets separate them.
fn split_top_level(list: &str) -> Result<Vec<String>, String> {
    let (mut items, mut current, mut depth) = (Vec::new(), String::new(), 0i32);
    for c in list.trim().chars() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err("unbalanced or nested brackets".into());
        }
        if c == ',' && depth == 0 {
            items.push(std::mem::take(&mut current));
        } else {
            current.push(c);
        }
    }
    if depth != 0 {
        return Err("a bracket is not closed".into());
    }
    items.push(current);
    Ok(items)
}

/// One item: a prefix, then a bracket group's values, then the rest expanded the same way.
fn expand_item(item: &str) -> Result<Vec<String>, String> {
    let Some(open) = item.find('[') else { return Ok(vec![item.to_string()]) };
    let close = open + item[open..].find(']').ok_or("a bracket is not closed")?;
    let (prefix, group, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let mut values = Vec::new();
    for part in group.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (lo, hi) = (range_end(a, part)?, range_end(b, part)?);
                if lo > hi {
                    return Err(format!("range {part:?} runs backwards"));
                }
                let width = a.len();
                values.extend((lo..=hi).map(|v| format!("{v:0width$}")));
            }
            None => {
                range_end(part, part)?;
                values.push(part.to_string());
            }
        }
    }
    let tails = expand_item(rest)?;
    Ok(values.iter().flat_map(|v| tails.iter().map(move |t| format!("{prefix}{v}{t}"))).collect())
}

fn range_end(text: &str, part: &str) -> Result<u64, String> {
    text.parse().map_err(|_| format!("{part:?} in brackets is not a number or a range of numbers"))
}

/// Expands Slurm's counts per node: `2(x3),1` is 2 2 2 1.
pub fn expand_counts(text: &str) -> Result<Vec<usize>, String> {
    let mut counts = Vec::new();
    for part in text.split(',') {
        let (count, times) = match part.split_once("(x") {
            Some((c, t)) => (c, t.strip_suffix(')').ok_or_else(|| format!("{part:?} lacks its ')'"))?),
            None => (part, "1"),
        };
        let count: usize = count.trim().parse().map_err(|_| format!("{part:?} is not a count"))?;
        let times: usize = times.trim().parse().map_err(|_| format!("{part:?}: the repeat is not a number"))?;
        counts.extend(std::iter::repeat(count).take(times));
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostlists_expand_as_slurm_writes_them() {
        let e = |s: &str| expand_hostlist(s).unwrap();
        assert_eq!(e("node[0-1]"), ["node0", "node1"]);
        assert_eq!(e("node[01-03,7],gpu5"), ["node01", "node02", "node03", "node7", "gpu5"]);
        assert_eq!(e("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(e("login"), ["login"]);
        assert_eq!(e("a[008-010]-ib"), ["a008-ib", "a009-ib", "a010-ib"]);
        assert!(expand_hostlist("node[1-").unwrap_err().contains("not closed"));
        assert!(expand_hostlist("node[3-1]").unwrap_err().contains("backwards"));
        assert!(expand_hostlist("node[a-b]").unwrap_err().contains("not a number"));
        assert!(expand_hostlist("").is_err());
    }

    #[test]
    fn counts_per_node_expand() {
        assert_eq!(expand_counts("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(expand_counts("4").unwrap(), [4]);
        assert!(expand_counts("2(x3").is_err());
    }

    #[test]
    fn ports_differ_per_job_and_leave_room_for_the_launcher() {
        assert_ne!(port_of_job(41), port_of_job(42));
        assert_eq!(port_of_job(7) % 2, 0);
        assert!(port_of_job(19_999) < u16::MAX - 1);
    }
}
