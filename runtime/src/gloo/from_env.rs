//! The communicator the environment asks for, gloo included, and gloo in two levels when ranks span hosts.
use std::time::Duration;

use super::GlooComm;
use crate::comm::rank_info::RankInfo;
use crate::comm::{CommError, CommResult, Communicator};

/// The communicator the environment asks for, gloo included (the other backends come from
/// [`crate::comm::env::communicator_from_env`]).
pub fn communicator_from_env(timeout: Duration) -> CommResult<Box<dyn Communicator>> {
    // A fault-tolerant job's restarted replica group: its peers are mid-run, there is no world group to join.
    if crate::fault_tolerance::incarnation().is_some() {
        let info = RankInfo::from_env()?;
        return Ok(Box::new(crate::fault_tolerance::RejoiningWorld { rank: info.rank, world_size: info.world_size }));
    }
    let comm = backend_from_env(timeout)?;
    // Under `zerorun launch`: the launcher watches this rank's heartbeat (a hung rank is found and named).
    Ok(if crate::comm::heartbeat::start_from_env() {
        Box::new(crate::comm::heartbeat::Watched::new(comm, crate::comm::heartbeat::Heartbeat))
    } else {
        comm
    })
}

fn backend_from_env(timeout: Duration) -> CommResult<Box<dyn Communicator>> {
    use crate::comm::rank_info::Backend;
    let info = RankInfo::from_env()?;
    match info.backend {
        Backend::Gloo => {
            let world: Box<dyn Communicator> = Box::new(GlooComm::from_env(&info, timeout)?);
            two_levels(world, &info, timeout)
        }
        // NCCL across hosts: its id goes out through gloo's TCPStore rather than a shared-memory segment.
        #[cfg(feature = "nccl")]
        Backend::Nccl if info.local_world_size != info.world_size => {
            let boot_info = RankInfo { run_id: format!("{}-nccl", info.run_id), ..info.clone() };
            let boot = GlooComm::from_env(&boot_info, timeout)?;
            Ok(Box::new(crate::comm::nccl::NcclComm::with_bootstrap(&info, Some(&boot))?))
        }
        _ => crate::comm::env::communicator_from_env(timeout),
    }
}

/// `ZERORUN_HIERARCHY`: `auto` (the default) runs the collectives of ranks that span hosts in two levels, shared
/// memory inside a host and gloo across; `flat` keeps every collective on gloo among all ranks (to compare).
const HIERARCHY_VAR: &str = "ZERORUN_HIERARCHY";

/// `ZERORUN_ALL_TO_ALL`: `two-level` (the default) runs a two-level group's all-to-alls in two levels as well;
/// `flat` sends each part straight to its rank over gloo (to compare).
const ALL_TO_ALL_VAR: &str = "ZERORUN_ALL_TO_ALL";

/// Whether `var` asks for `default` (also when unset; true) or `other` (false); anything else names both.
fn either(var: &str, default: &str, other: &str, rank: usize) -> CommResult<bool> {
    match std::env::var(var) {
        Err(_) => Ok(true),
        Ok(v) if v == default => Ok(true),
        Ok(v) if v == other => Ok(false),
        Ok(v) => Err(CommError::BadArgument {
            op: "gloo",
            rank,
            what: format!("{var}={v:?}: expected `{default}` or `{other}`"),
        }),
    }
}

/// The job's gloo group in two levels when its ranks span hosts with several on each (agreed by every rank, see
/// [`crate::comm::hierarchical::agree_layout`]), else as it is.
fn two_levels(world: Box<dyn Communicator>, info: &RankInfo, timeout: Duration) -> CommResult<Box<dyn Communicator>> {
    use crate::comm::hierarchical::{agree_layout, Hierarchical};
    if info.world_size == info.local_world_size {
        return Ok(world);
    }
    let wanted = either(HIERARCHY_VAR, "auto", "flat", info.rank)?;
    let two_level_all_to_all = either(ALL_TO_ALL_VAR, "two-level", "flat", info.rank)?;
    let Some(layout) = agree_layout(world.as_ref(), info.local_rank, info.local_world_size, wanted)? else {
        tracing::info!(rank = info.rank, "collectives: flat over gloo");
        return Ok(world);
    };
    let host = info.rank / layout.per_host;
    // The host's own shared-memory group, named apart from every other host's (they may share /dev/shm).
    let host_info = RankInfo {
        rank: info.local_rank,
        world_size: layout.per_host,
        run_id: format!("{}.host{host}", info.run_id),
        ..info.clone()
    };
    let local = Box::new(crate::comm::shm::ShmComm::join(&host_info, timeout)?);
    tracing::info!(
        rank = info.rank,
        hosts = layout.hosts,
        per_host = layout.per_host,
        "collectives: shared memory inside each host, gloo across hosts"
    );
    Ok(Box::new(Hierarchical::over(world, local)?.with_two_level_all_to_all(two_level_all_to_all)))
}

#[cfg(test)]
mod tests {
    use super::either;

    /// Unset or the default spelling: true; the other: false; anything else names the variable and both spellings.
    #[test]
    fn a_switch_takes_its_two_spellings_and_names_anything_else() {
        // A variable of this test alone: tests run in parallel and share the environment.
        const VAR: &str = "ZERORUN_TEST_EITHER_SWITCH";
        assert!(either(VAR, "two-level", "flat", 3).unwrap());
        for (value, expected) in [("two-level", Some(true)), ("flat", Some(false)), ("Flat", None)] {
            std::env::set_var(VAR, value);
            match expected {
                Some(b) => assert_eq!(either(VAR, "two-level", "flat", 3).unwrap(), b, "{value}"),
                None => assert_eq!(
                    either(VAR, "two-level", "flat", 3).unwrap_err().to_string(),
                    "gloo on rank 3: ZERORUN_TEST_EITHER_SWITCH=\"Flat\": expected `two-level` or `flat`"
                ),
            }
        }
        std::env::remove_var(VAR);
    }
}
