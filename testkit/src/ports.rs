//! Ports kept out of the kernel's choice of ephemeral ports while a test needs them free.
//!
//! librdkafka's mock cluster listens on ephemeral ports. A test that takes a mock broker
//! down closes its listener, and bringing it up binds the same port again; if any
//! connection on the machine was given that port as its local port meanwhile, the bind
//! fails and librdkafka aborts the whole test process (an assertion in
//! `rd_kafka_mock_broker_cmd`). Listing the ports in `net.ipv4.ip_local_reserved_ports`
//! keeps the kernel from handing them to new connections; binding them explicitly still
//! works. Writing that file needs root (as CI runs): elsewhere the reservation is skipped
//! with a line on stderr, and the race stays as rare as it was.

use std::collections::BTreeSet;
use std::sync::Mutex;

const RESERVED: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";

/// What the file held before this process reserved anything, and what it reserves now.
static STATE: Mutex<Option<(String, BTreeSet<u16>)>> = Mutex::new(None);

/// The ports of `servers` (`host:port,host:port`), reserved until dropped.
#[must_use = "the ports are released when this is dropped"]
pub struct ReservedPorts(Vec<u16>);

impl ReservedPorts {
    pub fn of(servers: &str) -> ReservedPorts {
        let ports: Vec<u16> = servers
            .split(',')
            .filter_map(|s| s.rsplit(':').next()?.parse().ok())
            .collect();
        update(|reserved| reserved.extend(&ports));
        ReservedPorts(ports)
    }
}

impl Drop for ReservedPorts {
    fn drop(&mut self) {
        update(|reserved| {
            for port in &self.0 {
                reserved.remove(port);
            }
        });
    }
}

fn update(change: impl FnOnce(&mut BTreeSet<u16>)) {
    let mut state = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let (original, reserved) = state.get_or_insert_with(|| {
        let original = std::fs::read_to_string(RESERVED).unwrap_or_default();
        (original.trim().to_owned(), BTreeSet::new())
    });
    change(reserved);
    let list = original
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .chain(reserved.iter().map(u16::to_string))
        .collect::<Vec<_>>()
        .join(",");
    // An empty write is refused; "0"-free lists are what the kernel takes.
    let list = if list.is_empty() {
        "\n".to_owned()
    } else {
        list + "\n"
    };
    if let Err(e) = std::fs::write(RESERVED, list) {
        eprintln!("testkit: could not reserve mock broker ports in {RESERVED} ({e}); continuing");
    }
}
