//! The plumbing every harness shares: free ports, scratch directories, child processes
//! that die with their owner, waiting for a server to listen, and waiting for a child
//! with its resource usage.
//!
//! Starts nothing itself. What it sets up is torn down by its users: a scratch directory
//! is removed by the owning server's `Drop` (or, when its owner died without one, when the
//! next is made), and [`die_with_parent`] makes the kernel send SIGKILL to a child whose
//! spawning thread exits without unwinding.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// A free TCP port on 127.0.0.1 (bound, read, released), never one this process was given
/// before: the kernel may hand out a released port again at once, and a server given the
/// same port for two listeners fails to start (CI: a NATS cluster node's monitor and route
/// ports, both 35185, "address already in use").
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("bind an ephemeral port on 127.0.0.1");
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// A fresh empty directory under the system temp dir, removed by the server's Drop.
///
/// A Drop that never ran (the owner killed by SIGKILL, a test runner's timeout or Ctrl-C
/// of the benchmark) leaves its directories behind: a PostgreSQL cluster's is gigabytes
/// after a benchmark. So first the directories of owners that are gone are removed.
pub(crate) fn scratch_dir(kind: &str) -> Result<PathBuf> {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    remove_orphaned_scratch_dirs();
    let dir = std::env::temp_dir().join(format!(
        "{SCRATCH_PREFIX}{kind}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    Ok(dir)
}

/// Every scratch directory's name starts so: `outbox-relay-<kind>-<owner pid>-<n>`.
const SCRATCH_PREFIX: &str = "outbox-relay-";

/// Removes the scratch directories whose owner process no longer exists. The servers in
/// them died with their owner (see [`die_with_parent`]). A directory whose pid was taken
/// by another process since is left alone: that costs disk space, never a live server's
/// files.
fn remove_orphaned_scratch_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(owner) = name.to_str().and_then(scratch_owner) else {
            continue;
        };
        if !Path::new("/proc").join(owner.to_string()).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// The owner pid in a scratch directory's name (`outbox-relay-<kind>-<pid>-<n>`).
fn scratch_owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(SCRATCH_PREFIX)?;
    let mut parts = rest.rsplitn(3, '-');
    parts.next()?.parse::<usize>().ok()?;
    let pid = parts.next()?.parse().ok()?;
    parts.next().filter(|kind| !kind.is_empty())?;
    Some(pid)
}

/// Makes the child receive SIGKILL when the thread that spawned it exits (so a failed
/// test leaves no process behind).
pub fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

pub(crate) fn wait_for_port(port: u16, child: &mut Child, what: &str, log: &Path) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            bail!("{what} exited with {status} before accepting connections:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!("{what} did not accept connections on port {port} within 30s")
}

/// What a child used, once it exited.
#[derive(Debug, Clone, Copy)]
pub struct ChildUsage {
    /// The exit code; -1 when a signal ended it.
    pub code: i32,
    /// User + system CPU seconds (`wait4`).
    pub cpu_secs: f64,
    /// Peak resident memory, MiB: the highest `VmHWM` of `/proc/<pid>/status`, sampled every
    /// 10 ms while it runs. Not `ru_maxrss`: Linux starts a spawned child's `ru_maxrss` at
    /// the spawning process's own peak (taken over at exec), so it reports the parent's
    /// size whenever that is the larger (the benchmark, holding a Kafka producer, showed
    /// 35 MB for relays whose own peak was 24 MB).
    pub peak_rss_mb: f64,
}

/// Waits for the child `pid` to exit and says what it used (blocking).
pub fn wait_with_usage(pid: i32) -> std::io::Result<ChildUsage> {
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut peak_kib = 0u64;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(kib) = vm_hwm_kib(pid) {
                    peak_kib = peak_kib.max(kib);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            peak_kib
        })
    };
    let mut status = 0;
    // SAFETY: rusage is plain old data; wait4 fills it for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak_kib = sampler.join().unwrap_or(0);
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok(ChildUsage {
        code,
        cpu_secs: secs(usage.ru_utime) + secs(usage.ru_stime),
        peak_rss_mb: peak_kib as f64 / 1024.0,
    })
}

/// `VmHWM` of a live process, KiB (`None` once it has exited).
fn vm_hwm_kib(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Kills a server's child process (SIGKILL) and reaps it; `None` afterwards.
pub(crate) fn kill_child(child: &mut Option<std::process::Child>) {
    if let Some(mut child) = child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A signal the tests and the harnesses send to a process (SIGKILL is `Child::kill`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// SIGTERM: drain and exit.
    Term,
    /// SIGINT: the same as SIGTERM for the relay (Ctrl-C).
    Int,
    /// SIGQUIT: PostgreSQL's immediate shutdown.
    Quit,
    /// SIGSTOP: the process freezes with its connections, transactions and locks open.
    Stop,
    /// SIGCONT: a stopped process thaws.
    Cont,
    /// SIGUSR2: nats-server's lame-duck mode (`nats-server --signal ldm`).
    Usr2,
}

impl Signal {
    fn number(self) -> libc::c_int {
        match self {
            Signal::Term => libc::SIGTERM,
            Signal::Int => libc::SIGINT,
            Signal::Quit => libc::SIGQUIT,
            Signal::Stop => libc::SIGSTOP,
            Signal::Cont => libc::SIGCONT,
            Signal::Usr2 => libc::SIGUSR2,
        }
    }
}

/// Sends `signal` to process `pid`: the one way the tests, the harnesses, the benchmark
/// and the soak signal a process. An error when it could not be delivered (no such
/// process, not permitted).
pub fn send_signal(pid: u32, signal: Signal) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(std::io::Error::other)?;
    // SAFETY: kill(2) touches no memory; a bad pid is an error it reports.
    if unsafe { libc::kill(pid, signal.number()) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Sends `signal` to a server's child process, if it runs (SIGSTOP/SIGCONT: a server
/// that stalls with its connections open, then thaws).
pub(crate) fn signal_child(child: &Option<std::process::Child>, signal: Signal) {
    if let Some(child) = child {
        let _ = send_signal(child.id(), signal);
    }
}

/// A plain HTTP/1.0 GET of `path` from `addr` (`host:port`): (status code, body).
/// Blocking, 5 s timeouts. Enough for the relay's endpoints and nats-server's monitoring.
pub fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    http_get_within(addr, path, Duration::from_secs(5))
}

/// The value of the first sample in Prometheus text `metrics` whose line starts with
/// `prefix` (a metric name with its labels, or with a trailing space).
pub fn sample(metrics: &str, prefix: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// [`sample`] of a fresh `GET /metrics` from `addr`; `None` unless it answered 200.
pub fn scrape(addr: &str, prefix: &str) -> Option<f64> {
    match http_get(addr, "/metrics") {
        Ok((200, body)) => sample(&body, prefix),
        _ => None,
    }
}

/// [`http_get`] with `timeout` for the writes and reads (a stopped server still accepts).
pub(crate) fn http_get_within(
    addr: &str,
    path: &str,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}
