//! A throwaway `nats-server -js` ([`NatsServer`]) on a free 127.0.0.1 port with its
//! JetStream store in a scratch directory: open, with password users one of whom may not
//! publish to some subjects, or TLS with one nkey user. Helpers create streams and read
//! back what they stored ([`StoredMessage`]).
//!
//! Torn down by `Drop`: a paused server is resumed, then killed (SIGKILL) and its
//! directory removed; the server also gets SIGKILL if the thread that started it dies
//! without unwinding. [`NatsServer::kill`], [`NatsServer::pause`] and
//! [`NatsServer::start_again`] play a broker's faults in a test.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::process::{die_with_parent, free_port, scratch_dir, wait_for_port};
use crate::tls::TestCa;

/// A throwaway `nats-server -js`.
pub struct NatsServer {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
    /// With [`NatsServer::start_secure`]: the CA that signed the server's certificate and
    /// the one user's nkey seed, for this harness's own clients.
    secure: Option<(PathBuf, String)>,
    /// With [`NatsServer::start_with_denied_publish`]: the harness's own user and password.
    admin: Option<(String, String)>,
    /// A config file to start with.
    config: Option<PathBuf>,
}

impl NatsServer {
    pub fn start() -> Result<NatsServer> {
        let mut server = NatsServer {
            dir: scratch_dir("nats")?,
            port: free_port(),
            child: None,
            secure: None,
            admin: None,
            config: None,
        };
        server.spawn()?;
        Ok(server)
    }

    /// A server with two password users: `admin` (everything; this harness's clients) and
    /// `relay`, which may publish anywhere but to `denied` subjects. Returns the server and
    /// a URL that connects as `relay`.
    pub fn start_with_denied_publish(denied: &[&str]) -> Result<(NatsServer, String)> {
        let dir = scratch_dir("nats")?;
        let deny: Vec<String> = denied.iter().map(|s| format!("\"{s}\"")).collect();
        let config = dir.join("server.conf");
        std::fs::write(
            &config,
            format!(
                "authorization {{\n  users = [\n    {{ user: admin, password: admin }}\n    \
                 {{ user: relay, password: relay, permissions: {{ publish: {{ deny: [{}] }} }} }}\n  ]\n}}\n",
                deny.join(", ")
            ),
        )?;
        let mut server = NatsServer {
            dir,
            port: free_port(),
            child: None,
            secure: None,
            admin: Some(("admin".to_owned(), "admin".to_owned())),
            config: Some(config),
        };
        server.spawn()?;
        let url = format!("nats://relay:relay@127.0.0.1:{}", server.port);
        Ok((server, url))
    }

    /// A server that requires TLS (`ca`'s server certificate, IP 127.0.0.1) and admits one
    /// user, by nkey. Returns the server and that user's seed (`SU...`).
    pub fn start_secure(ca: &TestCa) -> Result<(NatsServer, String)> {
        let user = nkeys::KeyPair::new_user();
        let seed = user.seed().map_err(|e| anyhow::anyhow!("nkey seed: {e}"))?;
        let dir = scratch_dir("nats")?;
        std::fs::write(
            dir.join("server.conf"),
            format!(
                "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n}}\n\
                 authorization {{\n  users = [ {{ nkey: \"{}\" }} ]\n}}\n",
                ca.server_cert().display(),
                ca.server_key().display(),
                user.public_key()
            ),
        )?;
        let config = dir.join("server.conf");
        let mut server = NatsServer {
            dir,
            port: free_port(),
            child: None,
            secure: Some((ca.ca_cert(), seed.clone())),
            admin: None,
            config: Some(config),
        };
        server.spawn()?;
        Ok((server, seed))
    }

    /// A client of this server, with its TLS and nkey when it has them.
    pub async fn client(&self) -> Result<async_nats::Client> {
        let mut options = async_nats::ConnectOptions::new();
        if let Some((ca, seed)) = &self.secure {
            options = options
                .add_root_certificates(ca.clone())
                .require_tls(true)
                .nkey(seed.clone());
        }
        if let Some((user, password)) = &self.admin {
            options = options.user_and_password(user.clone(), password.clone());
        }
        Ok(options.connect(self.url()).await?)
    }

    fn spawn(&mut self) -> Result<()> {
        let log = self.dir.join("nats.log");
        let log_file = std::fs::File::create(&log)?;
        let binary = std::env::var_os("NATS_SERVER").unwrap_or_else(|| "nats-server".into());
        let mut cmd = Command::new(&binary);
        cmd.args([
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-sd",
        ])
        .arg(self.dir.join("js"));
        if let Some(config) = &self.config {
            cmd.arg("-c").arg(config);
        }
        cmd.stdout(log_file.try_clone()?).stderr(log_file);
        die_with_parent(&mut cmd);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("start {binary:?} (install the nats-server package)"))?;
        wait_for_port(self.port, &mut child, "nats-server", &log)?;
        self.child = Some(child);
        Ok(())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL); JetStream data on disk survives for [`Self::start_again`].
    pub fn kill(&mut self) {
        crate::process::kill_child(&mut self.child);
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered. The
    /// shape of a broker that stalls.
    pub fn pause(&self) {
        self.signal(crate::Signal::Stop);
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        self.signal(crate::Signal::Cont);
    }

    fn signal(&self, signal: crate::Signal) {
        crate::process::signal_child(&self.child, signal);
    }

    /// Starts it again on the same port and store.
    pub fn start_again(&mut self) -> Result<()> {
        self.kill();
        self.spawn()
    }

    /// Creates a file-backed stream capturing `subjects` with a 2-minute duplicate window.
    pub async fn create_stream(&self, name: &str, subjects: &[&str]) -> Result<()> {
        self.create_stream_with_window(name, subjects, Duration::from_secs(120))
            .await
    }

    /// Creates a file-backed stream with the given duplicate window.
    pub async fn create_stream_with_window(
        &self,
        name: &str,
        subjects: &[&str],
        duplicate_window: Duration,
    ) -> Result<()> {
        let client = self.client().await?;
        let js = async_nats::jetstream::new(client);
        js.create_stream(async_nats::jetstream::stream::Config {
            name: name.to_owned(),
            subjects: subjects.iter().map(|s| s.to_string()).collect(),
            duplicate_window,
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow::anyhow!("create stream {name}: {e}"))?;
        Ok(())
    }

    /// How many messages and bytes `stream` holds.
    pub async fn stream_state(&self, stream: &str) -> Result<(u64, u64)> {
        let js = async_nats::jetstream::new(self.client().await?);
        let info = stream_info(&js, stream).await?;
        Ok((info.state.messages, info.state.bytes))
    }

    /// Every message stored in `stream`, in stream order, read by an ordered consumer.
    pub async fn read_stream(&self, stream: &str) -> Result<Vec<StoredMessage>> {
        read_stream_with(self.client().await?, stream).await
    }
}

/// `stream`'s info as its leader reports it (shared with [`crate::NatsCluster`]).
pub(crate) async fn stream_info(
    js: &async_nats::jetstream::Context,
    stream: &str,
) -> Result<async_nats::jetstream::stream::Info> {
    Ok(get_stream(js, stream).await?.cached_info().clone())
}

/// `stream`, with the info its leader reported when it was looked up.
async fn get_stream(
    js: &async_nats::jetstream::Context,
    stream: &str,
) -> Result<async_nats::jetstream::stream::Stream> {
    js.get_stream(stream)
        .await
        .map_err(|e| anyhow::anyhow!("get stream {stream}: {e}"))
}

/// Every message stored in `stream`, in stream order, read through `client` by an ordered
/// consumer (shared with [`crate::NatsCluster`]).
pub(crate) async fn read_stream_with(
    client: async_nats::Client,
    stream: &str,
) -> Result<Vec<StoredMessage>> {
    use futures_util::StreamExt;
    let js = async_nats::jetstream::new(client);
    let s = get_stream(&js, stream).await?;
    let total = s.cached_info().state.messages;
    let mut out = Vec::with_capacity(total as usize);
    if total == 0 {
        return Ok(out);
    }
    let consumer = s
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig::default())
        .await
        .map_err(|e| anyhow::anyhow!("create consumer: {e}"))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| anyhow::anyhow!("consume: {e}"))?;
    while (out.len() as u64) < total {
        let next = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .context("timed out reading the stream")?;
        let m = match next {
            Some(Ok(m)) => m,
            Some(Err(e)) => bail!("reading the stream: {e}"),
            None => break,
        };
        let headers: Vec<(String, String)> = m
            .headers
            .iter()
            .flat_map(|h| {
                h.iter()
                    .flat_map(|(k, vs)| vs.iter().map(move |v| (k.to_string(), v.to_string())))
            })
            .collect();
        let info = m
            .info()
            .map_err(|e| anyhow::anyhow!("a stream message without its metadata: {e}"))?;
        let stored_at = std::time::UNIX_EPOCH
            + Duration::from_nanos(info.published.unix_timestamp_nanos().max(0) as u64);
        out.push(StoredMessage {
            subject: m.subject.to_string(),
            headers,
            payload: m.payload.to_vec(),
            sequence: info.stream_sequence,
            stored_at,
        });
    }
    Ok(out)
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.resume();
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A message as JetStream stored it.
#[derive(Debug, Clone)]
pub struct StoredMessage {
    pub subject: String,
    pub headers: Vec<(String, String)>,
    pub payload: Vec<u8>,
    /// The stream sequence number.
    pub sequence: u64,
    /// When the server received it from the publisher.
    pub stored_at: std::time::SystemTime,
}

impl StoredMessage {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}
