//! Groups, point-to-point and the mesh on 4 ranks: what a program that builds its own parallelism reads from
//! zerorun (the guide's "Several processes and hosts" chapter shows this file).
//!
//!     cargo run --example groups                          # 4 ranks as threads
//!     zerorun launch --nproc-per-node 4 target/debug/examples/groups
use std::time::Duration;

use zerorun::runtime::comm::topology::Topology;
use zerorun::runtime::comm::{Collectives, Communicator, ReduceOp};
use zerorun::{Config, Dim, Mesh, MeshOptions};

#[path = "support/mod.rs"]
mod support;

fn main() {
    zerorun::init_logging();
    let config: Config =
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 1}}"#.parse().expect("a valid config");
    match support::run_ranks(4, Duration::from_secs(60), |comm| on_rank(comm, &config)) {
        Ok(Some(line)) => println!("{line}"),
        Ok(None) => {}
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

fn on_rank(comm: Box<dyn Communicator>, config: &Config) -> Result<String, String> {
    let e = |e: zerorun::runtime::comm::CommError| e.to_string();
    let rank = comm.rank();
    // ANCHOR: groups
    // MPI_Comm_split: ranks of one color form a group, ordered by key, then by rank.
    let pairs = comm.split(Some((rank / 2) as u32), rank as i64).map_err(e)?.expect("every rank has a color");
    let mut sum = vec![rank as f32; 4];
    pairs.all_reduce(&mut sum, ReduceOp::Sum).map_err(e)?;
    // The group of some ranks: every rank calls it with the same list; the others get None.
    let first_two = comm.new_group(&[0, 1]).map_err(e)?;
    // Point to point: a send returns once the receiver has the data; sizes and types must match on both ends.
    // Both ends of a blocking pair must not send first: even ranks send, odd ranks receive.
    let mut got = [0f32; 3];
    if let Some(g) = &first_two {
        if g.rank() == 0 {
            g.send(&[1.0, 2.0, 3.0], 1).map_err(e)?;
        } else {
            g.recv(&mut got, 0).map_err(e)?;
        }
    }
    // Named axes, last fastest (DeepSpeed's ProcessTopology): this rank's data-parallel group.
    let topo = Topology::new(&[("pipe", 2), ("data", 2)]).map_err(|t| t.to_string())?;
    let data = topo.communicator(comm.as_ref(), &["data"]).map_err(e)?;
    // ANCHOR_END: groups
    let data_size = data.world_size();
    // ANCHOR: mesh
    // One mesh per job: pipe x replicate x shard x tensor, every parallelism's group one of its dimensions.
    let mesh = Mesh::from_config(comm, config, MeshOptions { tensor_parallel: Some(2), ..Default::default() })
        .map_err(|m| m.to_string())?;
    let zero = mesh.group(&[Dim::Replicate, Dim::Shard]).map_err(e)?; // ZeRO's data-parallel ranks
    let tp = mesh.tensor_parallel().map_err(|t| t.to_string())?; // the layers' group: adjacent ranks
                                                                 // ANCHOR_END: mesh
    Ok(format!(
        "rank {rank}: pair sum {}, received {got:?}, data group of {data_size}, ZeRO group of {}, tensor rank {} of {}",
        sum[0],
        zero.world_size(),
        tp.rank(),
        tp.size()
    ))
}
