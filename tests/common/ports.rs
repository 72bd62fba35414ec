//! A port for a test's job to listen on, and the one after it free too (a launcher of several nodes listens on
//! `--master-port + 1`). Picked below the kernel's ephemeral range: the job's own connections (the store's, gloo's
//! pairs) take their local ports from that range, and one of them could take the port after a kernel-picked one
//! between the pick and the launcher's bind ("Address already in use", seen once in a loaded run).
use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

pub fn free_port() -> u16 {
    static TRIED: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse::<u32>().ok()))
        .unwrap_or(32768);
    // Even ports of [low - 8192, low): pairs (p, p + 1) that stay below the range. Each process starts at its own
    // place (its pid), each call one pair on, so the test binaries running at once try different ports first.
    let (base, pairs) = (ephemeral_low.saturating_sub(8192).max(1024) & !1, 4095);
    let start = std::process::id() * 7919;
    for _ in 0..pairs {
        let k = start.wrapping_add(TRIED.fetch_add(1, Ordering::Relaxed)) % pairs;
        let p = (base + 2 * k) as u16;
        let bound =
            TcpListener::bind(("127.0.0.1", p)).and_then(|a| TcpListener::bind(("127.0.0.1", p + 1)).map(|b| (a, b)));
        if bound.is_ok() {
            return p;
        }
    }
    panic!("no two free ports in a row below the ephemeral range ({base}..{ephemeral_low})")
}
