//! Throwaway servers for tests, the demo and benchmarks: a PostgreSQL cluster made with
//! `initdb` and a `nats-server -js`, each on a free 127.0.0.1 port in its own temp dir.
//!
//! Every server is a child process that dies with its owner: dropping the handle kills it
//! and removes its directory, and `PR_SET_PDEATHSIG` kills it even if the owning thread
//! dies without unwinding (a test killed by a timeout, `kill -9` of the demo).

use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// A free TCP port on 127.0.0.1 (bound, read, released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral port on 127.0.0.1")
}

/// A fresh empty directory under the system temp dir, removed by the server's Drop.
fn scratch_dir(kind: &str) -> Result<PathBuf> {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "outbox-relay-{kind}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    Ok(dir)
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

fn wait_for_port(port: u16, child: &mut Child, what: &str, log: &Path) -> Result<()> {
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

/// Where the PostgreSQL server binaries are: `$PG_BIN`, else the newest
/// `/usr/lib/postgresql/*/bin`, else `$PATH`.
pub fn pg_bin(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("PG_BIN") {
        return Path::new(&dir).join(name);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((v, e.path().join("bin")))
        })
        .collect();
    versions.sort();
    match versions.pop() {
        Some((_, dir)) => dir.join(name),
        None => PathBuf::from(name),
    }
}

/// The uid/gid to run PostgreSQL as: ourselves, or the `postgres` user when we are root
/// (initdb and postgres refuse to run as root).
fn pg_identity() -> Result<Option<(u32, u32)>> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    for line in passwd.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.first() == Some(&"postgres") && fields.len() > 3 {
            return Ok(Some((fields[2].parse()?, fields[3].parse()?)));
        }
    }
    bail!("running as root, but there is no `postgres` user to run PostgreSQL as: install the postgresql package")
}

/// A throwaway certificate authority made with the `openssl` command: a CA, a server
/// certificate for IP 127.0.0.1 (no host name), and a client certificate for
/// `outbox_relay`. A second `TestCa` is a different, untrusted CA.
pub struct TestCa {
    dir: PathBuf,
}

impl TestCa {
    pub fn new() -> Result<TestCa> {
        let dir = scratch_dir("ca")?;
        let run = |args: &[&str]| -> Result<()> {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .output()
                .context("run openssl (apt-get install openssl)")?;
            if !out.status.success() {
                bail!(
                    "openssl {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Ok(())
        };
        std::fs::write(dir.join("server.ext"), "subjectAltName = IP:127.0.0.1\n")?;
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=outbox-relay test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        ])?;
        for (name, subject, ext) in [
            ("server", "/CN=127.0.0.1", Some("server.ext")),
            ("client", "/CN=outbox_relay", None),
        ] {
            let key = format!("{name}.key");
            let csr = format!("{name}.csr");
            let crt = format!("{name}.crt");
            run(&[
                "req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", &key, "-out",
                &csr,
            ])?;
            let mut sign = vec![
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                &crt,
            ];
            if let Some(ext) = ext {
                sign.extend(["-extfile", ext]);
            }
            run(&sign)?;
        }
        Ok(TestCa { dir })
    }

    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    pub fn server_cert(&self) -> PathBuf {
        self.dir.join("server.crt")
    }

    pub fn server_key(&self) -> PathBuf {
        self.dir.join("server.key")
    }

    pub fn client_cert(&self) -> PathBuf {
        self.dir.join("client.crt")
    }

    pub fn client_key(&self) -> PathBuf {
        self.dir.join("client.key")
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A throwaway PostgreSQL cluster. Superuser `postgres`, trust authentication, on
/// 127.0.0.1 only.
pub struct Postgres {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
    identity: Option<(u32, u32)>,
}

impl Postgres {
    /// initdb + start. Durability is relaxed (`fsync=off`) unless `durable` is set.
    pub fn start() -> Result<Postgres> {
        Self::start_with(false, "")
    }

    /// initdb + start, durable (`fsync`, `synchronous_commit`, `full_page_writes` on, as
    /// PostgreSQL ships) or not, with `settings` (postgresql.conf lines) added last.
    pub fn start_with(durable: bool, settings: &str) -> Result<Postgres> {
        Self::start_inner(durable, None, settings)
    }

    /// A cluster with `ssl = on`, serving `ca`'s server certificate (SAN: IP 127.0.0.1
    /// only). pg_hba: role `outbox_relay` must come over TLS with a SCRAM password (a plain
    /// connection is rejected); everyone else is trusted, with or without TLS.
    pub fn start_tls(ca: &TestCa) -> Result<Postgres> {
        Self::start_inner(false, Some(ca), "")
    }

    fn start_inner(durable: bool, tls: Option<&TestCa>, settings: &str) -> Result<Postgres> {
        let dir = scratch_dir("pg")?;
        let identity = pg_identity()?;
        if let Some((uid, gid)) = identity {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
        }
        let data = dir.join("data");
        let mut initdb = Command::new(pg_bin("initdb"));
        initdb
            .args(["-D"])
            .arg(&data)
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--locale=C",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some((uid, gid)) = identity {
            initdb.uid(uid).gid(gid);
        }
        let out = initdb
            .output()
            .with_context(|| format!("run {}", pg_bin("initdb").display()))?;
        if !out.status.success() {
            bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let mut pg = Postgres {
            dir,
            port: free_port(),
            child: None,
            identity,
        };
        let mut conf = String::from(
            "listen_addresses = '127.0.0.1'\nmax_connections = 200\nshared_buffers = 128MB\n\
             max_prepared_transactions = 10\n",
        );
        if !durable {
            conf.push_str("fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n");
        }
        if let Some(ca) = tls {
            for (from, to) in [
                (ca.server_cert(), "server.crt"),
                (ca.server_key(), "server.key"),
            ] {
                let target = data.join(to);
                std::fs::copy(&from, &target)?;
                std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600))?;
                if let Some((uid, gid)) = identity {
                    std::os::unix::fs::chown(&target, Some(uid), Some(gid))?;
                }
            }
            conf.push_str("ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
            conf.push_str("password_encryption = 'scram-sha-256'\n");
            std::fs::write(
                data.join("pg_hba.conf"),
                "local all all trust\n\
                 hostnossl all outbox_relay 127.0.0.1/32 reject\n\
                 hostssl all outbox_relay 127.0.0.1/32 scram-sha-256\n\
                 host all all 127.0.0.1/32 trust\n",
            )?;
        }
        conf.push_str(settings);
        std::fs::write(data.join("postgresql.auto.conf"), conf)?;
        pg.spawn()?;
        Ok(pg)
    }

    fn spawn(&mut self) -> Result<()> {
        let log = self.dir.join("postgres.log");
        let log_file = std::fs::File::create(&log)?;
        if let Some((uid, gid)) = self.identity {
            std::os::unix::fs::chown(&log, Some(uid), Some(gid))?;
        }
        let mut cmd = Command::new(pg_bin("postgres"));
        cmd.arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&self.dir)
            .stdout(log_file.try_clone()?)
            .stderr(log_file);
        if let Some((uid, gid)) = self.identity {
            cmd.uid(uid).gid(gid);
        }
        die_with_parent(&mut cmd);
        let mut child = cmd.spawn().context("start postgres")?;
        wait_for_port(self.port, &mut child, "postgres", &log)?;
        self.child = Some(child);
        // Accepting TCP is not yet accepting queries: wait until a query succeeds.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = Command::new(pg_bin("pg_isready"))
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    "postgres",
                ])
                .stdout(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("postgres did not become ready within 30s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// URL of `database` as the superuser.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Connects to `database` as the superuser.
    pub async fn connect(&self, database: &str) -> Result<tokio_postgres::Client> {
        let (client, connection) =
            tokio_postgres::connect(&self.url(database), tokio_postgres::NoTls)
                .await
                .context("connect to the throwaway postgres")?;
        tokio::spawn(connection);
        Ok(client)
    }

    /// Creates an empty database and returns its URL.
    pub async fn create_database(&self, name: &str) -> Result<String> {
        let admin = self.connect("postgres").await?;
        admin
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await?;
        Ok(self.url(name))
    }

    /// Stops the server the hard way (SIGQUIT: immediate shutdown, crash recovery on start).
    pub fn stop_immediate(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: sending a signal to our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGQUIT) };
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and data.
    pub fn restart(&mut self) -> Result<()> {
        self.stop_immediate();
        self.spawn()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop_immediate();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

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
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered. The
    /// shape of a broker that stalls.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: i32) {
        if let Some(child) = &self.child {
            // SAFETY: sending a signal to our own child.
            unsafe { libc::kill(child.id() as i32, signal) };
        }
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

    /// Every message stored in `stream`, in stream order, read by an ordered consumer.
    /// How many messages and bytes `stream` holds.
    pub async fn stream_state(&self, stream: &str) -> Result<(u64, u64)> {
        let js = async_nats::jetstream::new(self.client().await?);
        let mut s = js
            .get_stream(stream)
            .await
            .map_err(|e| anyhow::anyhow!("get stream {stream}: {e}"))?;
        let info = s
            .info()
            .await
            .map_err(|e| anyhow::anyhow!("stream info: {e}"))?;
        Ok((info.state.messages, info.state.bytes))
    }

    pub async fn read_stream(&self, stream: &str) -> Result<Vec<StoredMessage>> {
        use futures_util::StreamExt;
        let client = self.client().await?;
        let js = async_nats::jetstream::new(client);
        let (total, _) = self.stream_state(stream).await?;
        let s = js
            .get_stream(stream)
            .await
            .map_err(|e| anyhow::anyhow!("get stream {stream}: {e}"))?;
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
            out.push(StoredMessage {
                subject: m.subject.to_string(),
                headers,
                payload: m.payload.to_vec(),
            });
        }
        Ok(out)
    }
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
}

impl StoredMessage {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A record as a Kafka consumer read it.
#[derive(Debug, Clone)]
pub struct KafkaRecord {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    pub headers: Vec<(String, String)>,
    pub payload: Vec<u8>,
}

impl KafkaRecord {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads every record of `topics` from the beginning by assigning all their partitions
/// (no consumer group: some Kafka-protocol brokers' groups are unreliable). Stops when
/// nothing new arrived for `idle`. Blocking.
pub fn kafka_read_all(
    bootstrap: &str,
    topics: &[&str],
    idle: Duration,
) -> Result<Vec<KafkaRecord>> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "outbox-relay-test-reader")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .context("create the Kafka reader")?;
    let mut assignment = TopicPartitionList::new();
    for topic in topics {
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .with_context(|| format!("metadata for {topic}"))?;
        for t in metadata.topics() {
            for p in t.partitions() {
                assignment.add_partition_offset(t.name(), p.id(), Offset::Beginning)?;
            }
        }
    }
    consumer.assign(&assignment)?;
    let mut out = Vec::new();
    let mut last = Instant::now();
    while last.elapsed() < idle {
        match consumer.poll(Duration::from_millis(100)) {
            None => {}
            Some(Err(e)) => bail!("reading Kafka: {e}"),
            Some(Ok(m)) => {
                last = Instant::now();
                let headers = m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| {
                                (
                                    h.key.to_owned(),
                                    String::from_utf8_lossy(h.value.unwrap_or_default())
                                        .into_owned(),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                out.push(KafkaRecord {
                    topic: m.topic().to_owned(),
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                    headers,
                    payload: m.payload().unwrap_or_default().to_vec(),
                });
            }
        }
    }
    Ok(out)
}

/// A throwaway Kafka-protocol broker: `tansu broker` with in-memory storage.
pub struct KafkaBroker {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

/// The tansu binary: `$TANSU`, else `tansu` on `$PATH`, else `~/.cargo/bin/tansu`.
fn tansu_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("TANSU") {
        return PathBuf::from(path);
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("tansu").exists()))
        .unwrap_or(false);
    if on_path {
        return PathBuf::from("tansu");
    }
    std::env::var_os("HOME")
        .map(|h| Path::new(&h).join(".cargo/bin/tansu"))
        .unwrap_or_else(|| PathBuf::from("tansu"))
}

impl KafkaBroker {
    pub fn start() -> Result<KafkaBroker> {
        let dir = scratch_dir("tansu")?;
        let port = free_port();
        let log = dir.join("tansu.log");
        let log_file = std::fs::File::create(&log)?;
        let url = format!("tcp://127.0.0.1:{port}");
        let mut cmd = Command::new(tansu_bin());
        cmd.args([
            "broker",
            "--storage-engine",
            "memory://tansu/",
            "--listener-url",
        ])
        .arg(&url)
        .arg("--advertised-listener-url")
        .arg(&url)
        .env_remove("CLUSTER_ID")
        .env_remove("STORAGE_ENGINE")
        .stdout(log_file.try_clone()?)
        .stderr(log_file);
        die_with_parent(&mut cmd);
        let mut child = cmd.spawn().with_context(|| {
            format!(
                "start {} (install it: cargo install tansu --locked --features dynostore)",
                tansu_bin().display()
            )
        })?;
        wait_for_port(port, &mut child, "tansu", &log)?;
        Ok(KafkaBroker {
            dir,
            port,
            child: Some(child),
        })
    }

    /// `host:port` for `bootstrap.servers`.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Creates a topic (tansu does not auto-create them).
    pub fn create_topic(&self, name: &str, partitions: u32) -> Result<()> {
        let out = Command::new(tansu_bin())
            .args([
                "topic",
                "create",
                name,
                "--partitions",
                &partitions.to_string(),
                "--broker",
            ])
            .arg(format!("tcp://127.0.0.1:{}", self.port))
            .output()
            .context("run tansu topic create")?;
        if !out.status.success() {
            bail!(
                "tansu topic create {name} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}

impl Drop for KafkaBroker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits for the child `pid` to exit; returns its exit code (-1 when a signal ended it)
/// and its resource usage (peak RSS in `ru_maxrss`, KiB).
pub fn wait_with_usage(pid: i32) -> std::io::Result<(i32, libc::rusage)> {
    let mut status = 0;
    // SAFETY: rusage is plain old data; wait4 fills it for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    };
    Ok((code, usage))
}
