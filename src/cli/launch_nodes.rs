//! The launchers of a multi-node job tell each other when a rank fails, so every launcher stops its ranks and names
//! the rank that failed first, whichever node it was on. Node 0's launcher listens at the master address on
//! `--master-port` + 1; the others connect to it (retrying while it starts). A failure is one line,
//! `FAIL <rank> <node> <how>`, sent to node 0, which passes it on to every other node. Plain TCP from std: the
//! launcher links no libtorch, and the ranks' own rendezvous (gloo's TCPStore) stays theirs.
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A failure another node reported: the rank (in the job), its node, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFailure {
    pub rank: usize,
    pub node: usize,
    pub how: String,
}

impl RemoteFailure {
    fn parse(line: &str) -> Option<RemoteFailure> {
        let rest = line.strip_prefix("FAIL ")?;
        let mut it = rest.splitn(3, ' ');
        let rank = it.next()?.parse().ok()?;
        let node = it.next()?.parse().ok()?;
        Some(RemoteFailure { rank, node, how: it.next()?.to_string() })
    }

    fn line(&self) -> String {
        format!("FAIL {} {} {}\n", self.rank, self.node, self.how.replace('\n', " "))
    }
}

/// This launcher's links to the others.
pub struct NodeLinks {
    node: usize,
    /// Node 0: a stream per other node; other nodes: the stream to node 0 (once connected).
    streams: Arc<Mutex<Vec<TcpStream>>>,
    /// The first failure another node reported.
    remote: Arc<Mutex<Option<RemoteFailure>>>,
}

impl NodeLinks {
    /// Starts listening (node 0) or connecting (the others) in the background; never blocks the launch.
    pub fn start(node: usize, master_addr: &str, port: u16) -> std::io::Result<NodeLinks> {
        let links = NodeLinks { node, streams: Arc::new(Mutex::new(Vec::new())), remote: Arc::new(Mutex::new(None)) };
        let side_port = port.checked_add(1).unwrap_or(port);
        if node == 0 {
            let listener = TcpListener::bind(("0.0.0.0", side_port))?;
            let (streams, remote) = (links.streams.clone(), links.remote.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming().flatten() {
                    if let Ok(reader) = stream.try_clone() {
                        streams.lock().unwrap_or_else(|p| p.into_inner()).push(stream);
                        read_failures(reader, remote.clone(), Some(streams.clone()));
                    }
                }
            });
        } else {
            let addr = format!("{master_addr}:{side_port}");
            let (streams, remote) = (links.streams.clone(), links.remote.clone());
            std::thread::spawn(move || {
                let start = Instant::now();
                while start.elapsed() < Duration::from_secs(600) {
                    if let Ok(stream) = TcpStream::connect(&addr) {
                        if let Ok(reader) = stream.try_clone() {
                            streams.lock().unwrap_or_else(|p| p.into_inner()).push(stream);
                            read_failures(reader, remote, None);
                        }
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            });
        }
        Ok(links)
    }

    /// Tells the other nodes that `rank` of this node failed, and how.
    pub fn report(&self, rank: usize, how: &str) {
        let line = RemoteFailure { rank, node: self.node, how: how.to_string() }.line();
        for s in self.streams.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
            let _ = s.write_all(line.as_bytes());
        }
    }

    /// The first failure another node reported, if any.
    pub fn remote_failure(&self) -> Option<RemoteFailure> {
        self.remote.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Reads failure lines from one link; node 0 passes each on to every other link (`relay`).
fn read_failures(
    stream: TcpStream,
    remote: Arc<Mutex<Option<RemoteFailure>>>,
    relay: Option<Arc<Mutex<Vec<TcpStream>>>>,
) {
    std::thread::spawn(move || {
        let from = stream.peer_addr().ok();
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            let Some(failure) = RemoteFailure::parse(&line) else { continue };
            remote.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(failure.clone());
            if let Some(relay) = &relay {
                for s in relay.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
                    if s.peer_addr().ok() != from {
                        let _ = s.write_all(failure.line().as_bytes());
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_line_round_trips() {
        let f = RemoteFailure { rank: 5, node: 1, how: "was killed by signal 9 (SIGKILL)".into() };
        assert_eq!(RemoteFailure::parse(f.line().trim_end()), Some(f));
        assert_eq!(RemoteFailure::parse("hello"), None);
    }
}
