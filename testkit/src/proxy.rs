//! A TCP proxy for network faults between the relay and a server: it forwards bytes both
//! ways and, on request, freezes every connection (bytes stop, sockets stay open, as a
//! stalled network or a silent firewall does), drops them all (both sockets closed), or
//! delays every chunk by a fixed latency; or freezes only the connections open now, new
//! ones flowing (a path that lost its established flows: a NAT or firewall table reset).
//!
//! It runs on a thread of its own with its own Tokio runtime, so it works the same under
//! any test runtime; dropping the [`Proxy`] stops it and closes every connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to the bytes it forwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward at once.
    None,
    /// Hold every byte until the fault changes; sockets stay open.
    Freeze,
    /// Forward each chunk after this delay (each direction).
    Latency(Duration),
}

/// A running proxy to one upstream address.
pub struct Proxy {
    addr: SocketAddr,
    fault: watch::Sender<Fault>,
    /// Bumped by [`Proxy::drop_connections`]: connections of an older generation close.
    generation: watch::Sender<u64>,
    /// Connections numbered up to this one (from 1, in accept order) are frozen.
    frozen_upto: watch::Sender<u64>,
    accepted: Arc<Mutex<u64>>,
    /// See [`Proxy::round_trips`].
    turns: Arc<AtomicU64>,
    /// See [`Proxy::awaiting_answers`].
    awaiting: Arc<AtomicU64>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Proxy {
    /// Listens on a free 127.0.0.1 port and forwards each connection to `upstream`.
    pub fn start(upstream: SocketAddr) -> Result<Proxy> {
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").context("bind proxy")?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let (fault, fault_rx) = watch::channel(Fault::None);
        let (generation, generation_rx) = watch::channel(0u64);
        let (frozen_upto, frozen_rx) = watch::channel(0u64);
        let accepted = Arc::new(Mutex::new(0));
        let (stop, stop_rx) = tokio::sync::oneshot::channel();
        let counter = accepted.clone();
        let turns = Arc::new(AtomicU64::new(0));
        let awaiting = Arc::new(AtomicU64::new(0));
        let counts = Counts {
            turns: turns.clone(),
            awaiting: awaiting.clone(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("proxy-{}", addr.port()))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("proxy runtime");
                runtime.block_on(async move {
                    let listener = TcpListener::from_std(std_listener).expect("proxy listener");
                    let watches = Watches {
                        fault: fault_rx,
                        generation: generation_rx,
                        frozen_upto: frozen_rx,
                    };
                    let accept = accept_loop(listener, upstream, watches, counter, counts);
                    tokio::select! {
                        _ = accept => {}
                        _ = stop_rx => {}
                    }
                });
            })?;
        Ok(Proxy {
            addr,
            fault,
            generation,
            frozen_upto,
            accepted,
            turns,
            awaiting,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Sets the fault for every connection, present and future.
    pub fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// Closes every connection open now (new ones are accepted as before).
    pub fn drop_connections(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    /// Freezes every connection open now, for good: their bytes stop and their sockets stay
    /// open, while connections accepted later flow.
    pub fn freeze_open_connections(&self) {
        let upto = self.accepted();
        self.frozen_upto.send_modify(|n| *n = (*n).max(upto));
    }

    /// Round trips so far, over every connection: the times a client sent something after
    /// the last thing it sent was answered (its first send included). Requests sent one
    /// behind the other without waiting for an answer (pipelined) count once, as long as
    /// their answers take longer to come back than the client takes to send them: count
    /// with a latency set.
    pub fn round_trips(&self) -> u64 {
        self.turns.load(Ordering::SeqCst)
    }

    /// Connections whose last request has had no answer delivered yet. After the server
    /// has answered everything (its sessions idle), this reaches 0 once the proxy has passed
    /// the answers on; a latency set before then would hold back an answer and make the
    /// client's next request look like part of the same turn.
    pub fn awaiting_answers(&self) -> u64 {
        self.awaiting.load(Ordering::SeqCst)
    }

    /// Connections accepted since start.
    pub fn accepted(&self) -> u64 {
        *self.accepted.lock().unwrap()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.set(Fault::None);
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What every connection watches.
#[derive(Clone)]
struct Watches {
    fault: watch::Receiver<Fault>,
    generation: watch::Receiver<u64>,
    frozen_upto: watch::Receiver<u64>,
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    watches: Watches,
    accepted: Arc<Mutex<u64>>,
    counts: Counts,
) {
    while let Ok((client, _)) = listener.accept().await {
        let serial = {
            let mut n = accepted.lock().unwrap();
            *n += 1;
            *n
        };
        let Watches {
            fault,
            generation,
            frozen_upto,
        } = watches.clone();
        let counts = counts.clone();
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(upstream).await else {
                return; // the client sees its connection closed, as with a dead server
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let born = *generation.borrow();
            let (client_read, client_write) = client.into_split();
            let (server_read, server_write) = server.into_split();
            let frozen = Frozen {
                serial,
                upto: frozen_upto,
            };
            // The client was answered (or has yet to speak): its next send is a new turn.
            let answered = Arc::new(AtomicBool::new(true));
            let up_turns = Turns::Up {
                answered: answered.clone(),
                counts: counts.clone(),
            };
            let up = pump(
                client_read,
                server_write,
                fault.clone(),
                frozen.clone(),
                up_turns,
            );
            let down = pump(
                server_read,
                client_write,
                fault,
                frozen,
                Turns::Down {
                    answered: answered.clone(),
                    awaiting: counts.awaiting.clone(),
                },
            );
            let mut generation = generation;
            // Either direction ending (EOF, error) or a newer generation closes both.
            tokio::select! {
                _ = up => {}
                _ = down => {}
                _ = generation.wait_for(|g| *g != born) => {}
            }
            // A closed connection awaits nothing.
            if !answered.swap(true, Ordering::SeqCst) {
                counts.awaiting.fetch_sub(1, Ordering::SeqCst);
            }
        });
    }
}

/// Connection `serial`'s part of [`Proxy::freeze_open_connections`].
#[derive(Clone)]
struct Frozen {
    serial: u64,
    upto: watch::Receiver<u64>,
}

/// The proxy's counters: [`Proxy::round_trips`] and [`Proxy::awaiting_answers`].
#[derive(Clone)]
struct Counts {
    turns: Arc<AtomicU64>,
    awaiting: Arc<AtomicU64>,
}

/// A connection's part of the [`Counts`], by direction.
enum Turns {
    /// Client to server: a chunk read while `answered` is a new turn, and awaits an answer.
    Up {
        answered: Arc<AtomicBool>,
        counts: Counts,
    },
    /// Server to client: a chunk delivered sets `answered`.
    Down {
        answered: Arc<AtomicBool>,
        awaiting: Arc<AtomicU64>,
    },
}

/// Copies `from` to `to`, applying the fault: a chunk read at time t is written at
/// t + latency (chunks keep their order and overlap their waits, as on a long link), and
/// nothing is written while frozen.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut fault: watch::Receiver<Fault>,
    mut frozen: Frozen,
    turns: Turns,
) {
    // Bounded: a frozen or slow writer pushes back on the reader, as TCP would.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(tokio::time::Instant, Vec<u8>)>(64);
    let turns = &turns;
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if let Turns::Up { answered, counts } = turns {
                if answered.swap(false, Ordering::SeqCst) {
                    counts.turns.fetch_add(1, Ordering::SeqCst);
                    counts.awaiting.fetch_add(1, Ordering::SeqCst);
                }
            }
            let chunk = (tokio::time::Instant::now(), buf[..n].to_vec());
            if tx.send(chunk).await.is_err() {
                return;
            }
        }
    };
    let write = async move {
        while let Some((read_at, chunk)) = rx.recv().await {
            while frozen.serial <= *frozen.upto.borrow_and_update() {
                if frozen.upto.changed().await.is_err() {
                    return;
                }
            }
            loop {
                let now = *fault.borrow_and_update();
                match now {
                    Fault::None => break,
                    Fault::Latency(d) => {
                        tokio::time::sleep_until(read_at + d).await;
                        break;
                    }
                    Fault::Freeze => {
                        if fault.changed().await.is_err() {
                            return;
                        }
                    }
                }
            }
            // Answered before the answer is written, not after: once written, the client
            // may read it and send its next request, and the other pump read that, before
            // this task runs again; the request then counted as no new round trip (seen
            // once in CI: a claim and its commit counted 1 instead of 2).
            if let Turns::Down { answered, awaiting } = turns {
                if !answered.swap(true, Ordering::SeqCst) {
                    awaiting.fetch_sub(1, Ordering::SeqCst);
                }
            }
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    };
    // Reading ended (EOF): what was read is still written, then the pump ends.
    tokio::join!(read, write);
}
