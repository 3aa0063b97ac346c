//! A throwaway NATS cluster ([`NatsCluster`]): `n` `nats-server` processes with JetStream,
//! routed to each other in one cluster, each with its own client, route and monitoring
//! port on 127.0.0.1 and its own JetStream store, all in one scratch directory. Helpers
//! create replicated streams, say which server leads a stream (and make it step down),
//! which leads JetStream's meta group and which hold a named client connection, and read a stream back from any server
//! still alive.
//!
//! [`NatsCluster::start`] returns once every server listens and the JetStream meta leader
//! counts every other server as a current peer (before that, a replicated stream can be
//! refused with "no suitable peers for placement"); [`NatsCluster::create_stream`] once
//! the stream has a leader and every replica is current. Each cluster has its own name, so
//! servers of two clusters started side by side never join each other. [`NatsCluster::kill`] (SIGKILL) and [`NatsCluster::restart`]
//! (same ports, same store) play a server's crash in a test; [`NatsCluster::stop`] (SIGTERM,
//! or SIGUSR2 for lame-duck mode) and [`NatsCluster::wait_stopped`] an operator's graceful
//! stop, as in a rolling restart.
//!
//! Torn down by `Drop`: every server is killed and the directory removed; the servers
//! also get SIGKILL if the thread that started them dies without unwinding.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::nats::{read_stream_with, stream_info};
use crate::process::{die_with_parent, free_port, scratch_dir, send_signal, wait_for_port};
use crate::{Signal, StoredMessage};

/// How long the cluster gets to elect a leader (meta or stream) before a helper fails.
const ELECTION_LIMIT: Duration = Duration::from_secs(30);
/// How long a server asked to stop gets to exit before [`NatsCluster::wait_stopped`] kills it.
const STOP_LIMIT: Duration = Duration::from_secs(30);

/// `n` routed `nats-server -js` processes in one cluster.
pub struct NatsCluster {
    dir: PathBuf,
    nodes: Vec<Node>,
}

/// One server of the cluster.
struct Node {
    /// `server_name`, which JetStream reports as a stream's leader: `n0`, `n1`, ...
    name: String,
    port: u16,
    /// The monitoring port (`/connz`).
    http_port: u16,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// Asked to stop ([`NatsCluster::stop`]) and not yet seen to exit.
    stopping: bool,
}

impl NatsCluster {
    /// Starts `n` servers routed to each other and waits until the JetStream meta leader
    /// counts all of them.
    pub fn start(n: usize) -> Result<NatsCluster> {
        let dir = scratch_dir("nats-cluster")?;
        let cluster_name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "outbox-test".into());
        let routes: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let route_urls: Vec<String> = routes
            .iter()
            .map(|p| format!("\"nats-route://127.0.0.1:{p}\""))
            .collect();
        let mut nodes = Vec::with_capacity(n);
        for (i, route_port) in routes.iter().enumerate() {
            let name = format!("n{i}");
            let node = Node {
                port: free_port(),
                http_port: free_port(),
                config: dir.join(format!("{name}.conf")),
                log: dir.join(format!("{name}.log")),
                name,
                child: None,
                stopping: false,
            };
            std::fs::write(
                &node.config,
                format!(
                    "server_name: {name}\nlisten: \"127.0.0.1:{port}\"\n\
                     http: \"127.0.0.1:{http}\"\n\
                     jetstream {{\n  store_dir: \"{store}\"\n}}\n\
                     cluster {{\n  name: {cluster}\n  listen: \"127.0.0.1:{route_port}\"\n  \
                     routes: [{routes}]\n  no_advertise: true\n}}\n",
                    name = node.name,
                    cluster = cluster_name,
                    port = node.port,
                    http = node.http_port,
                    store = dir.join(format!("js-{}", node.name)).display(),
                    routes = route_urls.join(", "),
                ),
            )?;
            nodes.push(node);
        }
        let mut cluster = NatsCluster { dir, nodes };
        for i in 0..n {
            cluster.spawn(i)?;
        }
        cluster.wait_for_meta_group()?;
        Ok(cluster)
    }

    fn spawn(&mut self, i: usize) -> Result<()> {
        let node = &mut self.nodes[i];
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log)?;
        let binary = std::env::var_os("NATS_SERVER").unwrap_or_else(|| "nats-server".into());
        let mut cmd = Command::new(&binary);
        cmd.arg("-c").arg(&node.config);
        cmd.stdout(log_file.try_clone()?).stderr(log_file);
        die_with_parent(&mut cmd);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("start {binary:?} (install the nats-server package)"))?;
        wait_for_port(node.port, &mut child, "nats-server", &node.log)?;
        node.child = Some(child);
        node.stopping = false;
        Ok(())
    }

    /// Polls the monitoring endpoint `/jsz` until the JetStream meta leader reports every
    /// other server as a current replica of the meta group. On timeout, the error carries
    /// each server's log tail.
    fn wait_for_meta_group(&self) -> Result<()> {
        let deadline = Instant::now() + ELECTION_LIMIT;
        let mut last = String::from("no server answered /jsz");
        while Instant::now() < deadline {
            for i in self.alive() {
                let Ok(body) = self.monitor(i, "/jsz") else {
                    continue;
                };
                let Ok(jsz) = serde_json::from_str::<serde_json::Value>(&body) else {
                    continue;
                };
                let meta = &jsz["meta_cluster"];
                if meta["leader"].as_str() != Some(self.nodes[i].name.as_str()) {
                    continue;
                }
                let replicas = meta["replicas"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or(&[]);
                let current = replicas
                    .iter()
                    .filter(|r| r["current"].as_bool() == Some(true))
                    .count();
                if current + 1 == self.nodes.len() {
                    return Ok(());
                }
                last = format!(
                    "meta leader {} counts {current} of {} other servers as current",
                    self.nodes[i].name,
                    self.nodes.len() - 1
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "the NATS cluster did not form within {ELECTION_LIMIT:?} ({last})\n{}",
            self.log_tails()
        )
    }

    /// The index of the JetStream meta leader, as the first live server's `/jsz` names it
    /// (`None` while there is none, or no server answers).
    pub fn meta_leader(&self) -> Option<usize> {
        self.alive().into_iter().find_map(|i| {
            let body = self.monitor(i, "/jsz").ok()?;
            let (_, meta) = body.split_once("\"meta_cluster\"")?;
            let (_, rest) = meta.split_once("\"leader\": \"")?;
            let name = rest.split('"').next()?;
            self.nodes.iter().position(|n| n.name == name)
        })
    }

    /// Indices of the servers running now, less those asked to stop (which refuse new
    /// clients, or are about to).
    pub fn alive(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].child.is_some() && !self.nodes[i].stopping)
            .collect()
    }

    /// Client URLs of every server, alive or not, in index order.
    pub fn urls(&self) -> Vec<String> {
        (0..self.nodes.len()).map(|i| self.url(i)).collect()
    }

    /// Client URL of server `i`.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].port)
    }

    /// A client of some server that is running now.
    pub async fn client(&self) -> Result<async_nats::Client> {
        let addrs: Vec<async_nats::ServerAddr> = self
            .alive()
            .into_iter()
            .map(|i| self.url(i).parse())
            .collect::<std::result::Result<_, _>>()?;
        if addrs.is_empty() {
            bail!("no server of the cluster is running");
        }
        Ok(async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect(addrs)
            .await?)
    }

    /// Creates a file-backed stream capturing `subjects` with `replicas` replicas and a
    /// 2-minute duplicate window; returns once it has a leader and every replica is current.
    pub async fn create_stream(
        &self,
        name: &str,
        subjects: &[&str],
        replicas: usize,
    ) -> Result<()> {
        let js = async_nats::jetstream::new(self.client().await?);
        let config = async_nats::jetstream::stream::Config {
            name: name.to_owned(),
            subjects: subjects.iter().map(|s| s.to_string()).collect(),
            duplicate_window: Duration::from_secs(120),
            num_replicas: replicas,
            ..Default::default()
        };
        let deadline = Instant::now() + ELECTION_LIMIT;
        // Right after the meta leader is elected, the other servers may not have caught up
        // with it yet: a create can fail ("insufficient resources") and succeed a moment later.
        loop {
            match js.create_stream(config.clone()).await {
                Ok(_) => break,
                Err(e) if Instant::now() > deadline => {
                    bail!("create stream {name}: {e}\n{}", self.log_tails())
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        self.wait_for_stream_current(name).await
    }

    /// Waits until `stream` has a leader and every replica the cluster reports is current.
    pub async fn wait_for_stream_current(&self, stream: &str) -> Result<()> {
        let deadline = Instant::now() + ELECTION_LIMIT;
        loop {
            if let Ok(Some(cluster)) = self.stream_cluster(stream).await {
                if cluster.leader.is_some() && cluster.replicas.iter().all(|r| r.current) {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "stream {stream} has no leader with current replicas after {ELECTION_LIMIT:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stream_cluster(
        &self,
        stream: &str,
    ) -> Result<Option<async_nats::jetstream::stream::ClusterInfo>> {
        // Only a stream's leader answers for it: without one, the request times out. A
        // short timeout keeps the callers' polling (and a measured election) fine-grained.
        let js = async_nats::jetstream::ContextBuilder::new()
            .timeout(Duration::from_millis(250))
            .build(self.client().await?);
        Ok(stream_info(&js, stream).await?.cluster)
    }

    /// The index of the server leading `stream` now (JetStream's `cluster.leader`).
    pub async fn stream_leader(&self, stream: &str) -> Result<usize> {
        let leader = self
            .stream_cluster(stream)
            .await?
            .and_then(|c| c.leader)
            .with_context(|| format!("stream {stream} has no leader"))?;
        self.nodes
            .iter()
            .position(|n| n.name == leader)
            .with_context(|| format!("stream leader {leader:?} is not a server of this cluster"))
    }

    /// How many messages `stream` holds, as some live server reports it.
    pub async fn stream_messages(&self, stream: &str) -> Result<u64> {
        let js = async_nats::jetstream::new(self.client().await?);
        Ok(stream_info(&js, stream).await?.state.messages)
    }

    /// Indices of the live servers holding a client connection named `client_name`
    /// (from their `/connz`).
    pub fn servers_with_client(&self, client_name: &str) -> Vec<usize> {
        let needle = format!("\"name\": \"{client_name}\"");
        self.alive()
            .into_iter()
            .filter(|&i| {
                self.monitor(i, "/connz")
                    .map(|body| body.contains(&needle))
                    .unwrap_or(false)
            })
            .collect()
    }

    /// Every message stored in `stream`, in stream order, read from a live server. Retried
    /// for `ELECTION_LIMIT`: right after a server died, creating the reading consumer can
    /// time out until the cluster has settled who leads what.
    pub async fn read_stream(&self, stream: &str) -> Result<Vec<StoredMessage>> {
        let deadline = Instant::now() + ELECTION_LIMIT;
        loop {
            match read_stream_with(self.client().await?, stream).await {
                Ok(messages) => return Ok(messages),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// Asks `stream`'s leader to step down (`$JS.API.STREAM.LEADER.STEPDOWN`) and waits for
    /// a new leader with current replicas; returns its index.
    pub async fn step_down(&self, stream: &str) -> Result<usize> {
        let old = self.stream_leader(stream).await?;
        let client = self.client().await?;
        client
            .request(
                format!("$JS.API.STREAM.LEADER.STEPDOWN.{stream}"),
                "".into(),
            )
            .await
            .map_err(|e| anyhow::anyhow!("step down the leader of {stream}: {e}"))?;
        let deadline = Instant::now() + ELECTION_LIMIT;
        loop {
            if let Ok(leader) = self.stream_leader(stream).await {
                if leader != old {
                    self.wait_for_stream_current(stream).await?;
                    return Ok(leader);
                }
            }
            if Instant::now() > deadline {
                bail!("{stream} kept leader n{old} for {ELECTION_LIMIT:?} after a step-down");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills server `i` (SIGKILL); its store survives for [`Self::restart`].
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Asks server `i` to stop gracefully, as an operator does in a rolling restart, and
    /// returns at once ([`Self::wait_stopped`] waits for the exit): [`Signal::Term`] shuts
    /// it down, [`Signal::Usr2`] puts it in lame-duck mode (no new clients, those it has
    /// closed over `lame_duck_duration`, then the same shutdown). Either way nats-server
    /// 2.9 first steps down every Raft group it leads, naming a current follower to take
    /// over (`stepdownRaftNodes`, `transferRaftLeaders` in `server/raft.go`). From now on
    /// it is not in [`Self::alive`].
    pub fn stop(&mut self, i: usize, signal: Signal) -> Result<()> {
        let node = &mut self.nodes[i];
        let child = node
            .child
            .as_ref()
            .with_context(|| format!("{} is not running", node.name))?;
        send_signal(child.id(), signal)
            .with_context(|| format!("send {signal:?} to {}", node.name))?;
        node.stopping = true;
        Ok(())
    }

    /// Waits for server `i`, asked to [`Self::stop`], to exit; one still running after
    /// `STOP_LIMIT` is killed, and the error carries its log tail. Its store survives for
    /// [`Self::restart`].
    pub async fn wait_stopped(&mut self, i: usize) -> Result<()> {
        let deadline = Instant::now() + STOP_LIMIT;
        while let Some(child) = self.nodes[i].child.as_mut() {
            if child.try_wait()?.is_some() {
                self.nodes[i].child = None;
                break;
            }
            if Instant::now() > deadline {
                self.kill(i);
                bail!(
                    "{} did not exit within {STOP_LIMIT:?} of being asked to stop\n{}",
                    self.nodes[i].name,
                    self.log_tail(i, 15)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Starts server `i` again on the same ports and store.
    pub fn restart(&mut self, i: usize) -> Result<()> {
        self.kill(i);
        self.spawn(i)
    }

    /// The last `lines` lines of server `i`'s log, for a failing test's message.
    pub fn log_tail(&self, i: usize, lines: usize) -> String {
        let log = std::fs::read_to_string(&self.nodes[i].log).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Every server's last log lines, headed by its name.
    fn log_tails(&self) -> String {
        let tails: Vec<String> = (0..self.nodes.len())
            .map(|i| format!("--- {} ---\n{}", self.nodes[i].name, self.log_tail(i, 15)))
            .collect();
        tails.join("\n")
    }

    /// The body of a plain HTTP GET of `path` on server `i`'s monitoring port.
    fn monitor(&self, i: usize, path: &str) -> std::io::Result<String> {
        let addr = format!("127.0.0.1:{}", self.nodes[i].http_port);
        Ok(crate::process::http_get_within(&addr, path, Duration::from_secs(2))?.1)
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
