//! Opening a session host by host.
//!
//! `postgres.url` may name several hosts, for failover with
//! `target_session_attrs=read-write`. tokio-postgres tries them in order within one
//! attempt, but its `connect_timeout` bounds only each TCP connect: a host that accepts TCP
//! and then never answers (a frozen postmaster, a hung VM, a stalled network) holds the
//! attempt until the caller gives up, and the next attempt starts at that host again, so
//! the relay never reaches the standby that was promoted. Here, as libpq does, each host
//! gets the whole handshake - TLS, start-up, authentication, the read-write check - within
//! `connect_timeout`, then the next host is tried. `load_balance_hosts=random` shuffles
//! the order per attempt, as it does in tokio-postgres.
//!
//! One attempt over every host is therefore bounded by `connect_timeout` times the number
//! of hosts ([`attempt_limit`]); callers wrap it in that bound.

use std::time::Duration;

use futures_util::future::BoxFuture;
use rand::seq::SliceRandom;
use tokio_postgres::config::{Host, LoadBalanceHosts};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{Client, Config, Connection, Socket};

/// The longest one attempt over every host of `config` may take.
pub(crate) fn attempt_limit(config: &Config, per_host: Duration) -> Duration {
    per_host * config.get_hosts().len().max(1) as u32
}

/// Connects to the first host of `config` (in its order, or shuffled with
/// `load_balance_hosts=random`) that completes the handshake within `per_host`. `None`
/// when every host timed out; otherwise the last host's error.
pub(crate) async fn connect<T>(
    config: &Config,
    tls: T,
    per_host: Duration,
) -> Option<Result<(Client, Connection<Socket, T::Stream>), tokio_postgres::Error>>
where
    T: MakeTlsConnect<Socket> + Clone,
    T::TlsConnect: Send,
    T::Stream: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    if config.get_hosts().len() <= 1 {
        return tokio::time::timeout(per_host, config.connect(tls))
            .await
            .ok();
    }
    let mut order: Vec<usize> = (0..config.get_hosts().len()).collect();
    if config.get_load_balance_hosts() == LoadBalanceHosts::Random {
        order.shuffle(&mut rand::rng());
    }
    let mut last = None;
    for i in order {
        match tokio::time::timeout(per_host, one_host(config, i).connect(tls.clone())).await {
            Ok(Ok(connected)) => return Some(Ok(connected)),
            Ok(Err(e)) => last = Some(Err(e)),
            Err(_) => tracing::debug!(host = i, "PostgreSQL host did not answer in time"),
        }
    }
    last
}

/// `config` with only its `i`-th host (and that host's `hostaddr` and port); every other
/// setting copied.
pub(crate) fn one_host(config: &Config, i: usize) -> Config {
    let mut one = Config::new();
    if let Some(v) = config.get_user() {
        one.user(v);
    }
    if let Some(v) = config.get_password() {
        one.password(v);
    }
    if let Some(v) = config.get_dbname() {
        one.dbname(v);
    }
    if let Some(v) = config.get_options() {
        one.options(v);
    }
    if let Some(v) = config.get_application_name() {
        one.application_name(v);
    }
    one.ssl_mode(config.get_ssl_mode());
    one.ssl_negotiation(config.get_ssl_negotiation());
    match &config.get_hosts()[i] {
        Host::Tcp(host) => one.host(host),
        Host::Unix(path) => one.host_path(path),
    };
    if let Some(addr) = config.get_hostaddrs().get(i) {
        one.hostaddr(*addr);
    }
    match config.get_ports() {
        [] => {}
        [port] => {
            one.port(*port);
        }
        ports => {
            one.port(ports[i]);
        }
    }
    if let Some(v) = config.get_connect_timeout() {
        one.connect_timeout(*v);
    }
    if let Some(v) = config.get_tcp_user_timeout() {
        one.tcp_user_timeout(*v);
    }
    one.keepalives(config.get_keepalives());
    one.keepalives_idle(config.get_keepalives_idle());
    if let Some(v) = config.get_keepalives_interval() {
        one.keepalives_interval(v);
    }
    if let Some(v) = config.get_keepalives_retries() {
        one.keepalives_retries(v);
    }
    one.target_session_attrs(config.get_target_session_attrs());
    one.channel_binding(config.get_channel_binding());
    one.load_balance_hosts(config.get_load_balance_hosts());
    one
}

/// A session already open: its client and the connection that drives it.
type Opened<T> = (
    Client,
    Connection<Socket, <T as MakeTlsConnect<Socket>>::Stream>,
);

/// The pool's way to open a session: [`connect`], each host within `per_host`.
///
/// Its first session may be one opened before the pool: the one that found out the
/// [`super::SessionMode`] (`Source::open`), with the pool's own settings. Closing it and
/// opening another cost the pool's first session a handshake, three or four round trips
/// to a database in another zone.
pub(crate) struct EachHost<T: MakeTlsConnect<Socket>> {
    pub(crate) tls: T,
    pub(crate) per_host: Duration,
    pub(crate) ready: std::sync::Mutex<Option<Opened<T>>>,
}

impl<T> deadpool_postgres::Connect for EachHost<T>
where
    T: MakeTlsConnect<Socket> + Clone + Sync + Send + 'static,
    T::Stream: Sync + Send,
    T::TlsConnect: Sync + Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    fn connect(
        &self,
        config: &Config,
    ) -> BoxFuture<'_, Result<(Client, tokio::task::JoinHandle<()>), tokio_postgres::Error>> {
        let config = config.clone();
        let ready = self.ready.lock().unwrap_or_else(|e| e.into_inner()).take();
        Box::pin(async move {
            let opened = match ready {
                Some(opened) => Some(Ok(opened)),
                None => connect(&config, self.tls.clone(), self.per_host).await,
            };
            match opened {
                Some(Ok((client, connection))) => {
                    let task = tokio::spawn(async move {
                        if let Err(e) = connection.await {
                            tracing::debug!(error = %e, "PostgreSQL connection ended");
                        }
                    });
                    Ok((client, task))
                }
                Some(Err(e)) => Err(e),
                // Every host timed out. tokio-postgres has no public timeout error: the
                // pool's create timeout ([`attempt_limit`] plus a margin) ends the wait.
                None => std::future::pending().await,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_host_keeps_every_other_setting() {
        // One host: the copy must be the same config, field for field.
        let url = "postgres://relay:secret@db1:6432/app?application_name=x&options=-c%20a%3Db\
                   &sslmode=require&connect_timeout=7&keepalives=1&keepalives_idle=11\
                   &keepalives_interval=3&keepalives_retries=4&target_session_attrs=read-write\
                   &channel_binding=require&load_balance_hosts=random&hostaddr=10.0.0.1\
                   &tcp_user_timeout=9";
        let config: Config = url.parse().unwrap();
        assert_eq!(format!("{:?}", one_host(&config, 0)), format!("{config:?}"));
    }

    #[test]
    fn one_host_takes_that_hosts_port_and_address() {
        let config: Config = "host=db1,db2 port=5432,5433 hostaddr=10.0.0.1,10.0.0.2 dbname=app"
            .parse()
            .unwrap();
        let second = one_host(&config, 1);
        assert_eq!(second.get_hosts(), &[Host::Tcp("db2".into())]);
        assert_eq!(second.get_ports(), &[5433]);
        assert_eq!(
            second.get_hostaddrs(),
            &["10.0.0.2".parse::<std::net::IpAddr>().unwrap()]
        );
        let shared: Config = "host=db1,db2 port=6432 dbname=app".parse().unwrap();
        assert_eq!(one_host(&shared, 1).get_ports(), &[6432]);
    }

    #[test]
    fn one_attempt_is_bounded_per_host() {
        let config: Config = "host=a,b,c dbname=app".parse().unwrap();
        assert_eq!(
            attempt_limit(&config, Duration::from_secs(2)),
            Duration::from_secs(6)
        );
    }
}
