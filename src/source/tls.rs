//! TLS to PostgreSQL, configured the way libpq users already write it: `sslmode`,
//! `sslrootcert`, `sslcert` and `sslkey` in `postgres.url` (URL query or key=value form).
//!
//! | sslmode       | encrypted            | server certificate checked        |
//! |---------------|----------------------|-----------------------------------|
//! | `disable`     | never                | -                                 |
//! | `prefer`      | if the server offers | no (as libpq)                     |
//! | `require`     | always               | no; chain only if `sslrootcert` is given (as libpq) |
//! | `verify-ca`   | always               | chain to `sslrootcert` (or the system CAs) |
//! | `verify-full` | always               | chain, and the host name (or IP) in the certificate |
//!
//! With `require`, `verify-ca` or `verify-full` a server that does not offer TLS is an
//! error: the relay never falls back to a plain connection when TLS was asked for.
//! `sslrootcert=system` uses the operating system's CA store. The default is `prefer`, as
//! with libpq.

use std::sync::Mutex;

use futures_util::future::BoxFuture;
use openssl::error::ErrorStack;
use openssl::ssl::{SslConnector, SslFiletype, SslMethod, SslVerifyMode};
use postgres_openssl::{MakeTlsConnector, TlsStream};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::Socket;

use crate::config::postgres::{file_error, key_mismatch};
pub(crate) use crate::config::postgres::{TlsMode, TlsSettings};

/// Why the TLS connector for `postgres.url` could not be built. The sentences are the
/// operator's (they name the file and the parameter); OpenSSL's error stack, where there
/// is one, is the source.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// OpenSSL could not make a connector at all.
    #[error("cannot set up TLS: {0}")]
    Setup(#[source] ErrorStack),
    /// `sslrootcert=system` or no `sslrootcert`: the operating system's CAs did not load.
    #[error("cannot load the system CA store: {0}")]
    SystemCas(#[source] ErrorStack),
    /// An `sslrootcert`, `sslcert` or `sslkey` file is gone or unusable since start-up.
    #[error("{message}")]
    File {
        message: String,
        #[source]
        source: ErrorStack,
    },
    /// `sslkey` is not the key of `sslcert`.
    #[error("{0}")]
    KeyMismatch(String),
    /// One of `sslcert` and `sslkey` without the other.
    #[error("sslcert and sslkey go together: give both")]
    HalfPair,
}

impl TlsError {
    /// The file `param` (at `path`) cannot be used: `error` says why.
    fn file(param: &str, path: &std::path::Path, error: ErrorStack) -> TlsError {
        TlsError::File {
            message: file_error(param, path, &error),
            source: error,
        }
    }
}

/// The TLS connector for the settings taken out of `postgres.url`, as every connection
/// of the relay uses it.
///
/// Building any OpenSSL connector loads the system CA store (`SslConnector::builder`
/// reads the whole bundle): most of an idle `drain`'s own CPU, by `perf`, paid even when
/// the server does not offer TLS. So:
///
/// - settings that name no file and check no chain (`prefer`, the default, or `require`)
///   get their connector at the first handshake that needs it, shared by the process from
///   then on; with a server that answers `prefer`'s request with "no TLS" it is never
///   built;
/// - settings that check the chain against the system CAs (`verify-ca`, `verify-full`
///   without `sslrootcert`) get the process's shared one when asked for, so a CA store
///   that cannot be loaded is reported before the connection is tried;
/// - settings that name files get one built afresh when asked for, so a missing file is
///   reported before the connection, and a certificate rotated on disk is read at the
///   next connect.
#[derive(Clone)]
pub(crate) struct PgTls {
    settings: TlsSettings,
    built: Option<MakeTlsConnector>,
}

pub(crate) trait Connector {
    /// The connector for these settings. Certificate files are read here (and were
    /// already checked with the configuration), so a file that changed since is reported
    /// at connect time, naming the file.
    fn connector(&self) -> Result<PgTls, TlsError>;
}

impl Connector for TlsSettings {
    fn connector(&self) -> Result<PgTls, TlsError> {
        let built = if self.names_files() {
            Some(self.build()?)
        } else if self.verifies_chain() {
            Some(self.shared()?)
        } else {
            None
        };
        Ok(PgTls {
            settings: self.clone(),
            built,
        })
    }
}

impl MakeTlsConnect<Socket> for PgTls {
    type Stream = TlsStream<Socket>;
    type TlsConnect = Handshake;
    type Error = std::convert::Infallible;

    fn make_tls_connect(&mut self, domain: &str) -> Result<Handshake, Self::Error> {
        Ok(Handshake {
            tls: self.clone(),
            domain: domain.to_owned(),
        })
    }
}

/// One connection's TLS handshake, started only if the server agreed to TLS.
pub(crate) struct Handshake {
    tls: PgTls,
    domain: String,
}

impl TlsConnect<Socket> for Handshake {
    type Stream = TlsStream<Socket>;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = BoxFuture<'static, Result<TlsStream<Socket>, Self::Error>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            let mut connector = match self.tls.built {
                Some(built) => built,
                None => self.tls.settings.shared()?,
            };
            let handshake =
                MakeTlsConnect::<Socket>::make_tls_connect(&mut connector, &self.domain)?;
            handshake.connect(stream).await
        })
    }
}

impl TlsSettings {
    /// Whether the settings name certificate files (read afresh at each connect).
    fn names_files(&self) -> bool {
        self.root_cert.is_some() || self.client_cert.is_some() || self.client_key.is_some()
    }

    /// The one connector of the process for these settings (they name no file), built on
    /// first use.
    fn shared(&self) -> Result<MakeTlsConnector, TlsError> {
        static SHARED: Mutex<Vec<(TlsSettings, MakeTlsConnector)>> = Mutex::new(Vec::new());
        let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, connector)) = shared.iter().find(|(s, _)| s == self) {
            return Ok(connector.clone());
        }
        let connector = self.build()?;
        shared.push((self.clone(), connector.clone()));
        Ok(connector)
    }

    fn build(&self) -> Result<MakeTlsConnector, TlsError> {
        let mut builder = SslConnector::builder(SslMethod::tls()).map_err(TlsError::Setup)?;
        if self.verifies_chain() {
            builder.set_verify(SslVerifyMode::PEER);
            match &self.root_cert {
                Some(path) => builder
                    .set_ca_file(path)
                    .map_err(|e| TlsError::file("sslrootcert", path, e))?,
                None => builder
                    .set_default_verify_paths()
                    .map_err(TlsError::SystemCas)?,
            }
        } else {
            builder.set_verify(SslVerifyMode::NONE);
        }
        match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(key)) => {
                builder
                    .set_certificate_chain_file(cert)
                    .map_err(|e| TlsError::file("sslcert", cert, e))?;
                builder
                    .set_private_key_file(key, SslFiletype::PEM)
                    .map_err(|e| match e.to_string().contains("key values mismatch") {
                        true => TlsError::KeyMismatch(key_mismatch(cert, key)),
                        false => TlsError::file("sslkey", key, e),
                    })?;
                builder
                    .check_private_key()
                    .map_err(|_| TlsError::KeyMismatch(key_mismatch(cert, key)))?;
            }
            (None, None) => {}
            _ => return Err(TlsError::HalfPair),
        }
        let mut connector = MakeTlsConnector::new(builder.build());
        let check_host = self.effective_mode() == TlsMode::VerifyFull;
        connector.set_callback(move |config, _host| {
            config.set_verify_hostname(check_host);
            Ok(())
        });
        Ok(connector)
    }
}

/// A clearer sentence for TLS failures than OpenSSL's error stack alone.
pub(crate) fn explain(message: &str) -> Option<&'static str> {
    if message.contains("hostname mismatch") || message.contains("IP address mismatch") {
        Some(
            "the server's certificate does not name the host in postgres.url \
             (sslmode=verify-full): connect by a name the certificate lists, or fix the \
             certificate",
        )
    } else if message.contains("certificate verify failed") {
        Some(
            "the server's certificate is not signed by a CA in sslrootcert: give the CA that \
             signed it, or check that this is the right server",
        )
    } else if message.contains("server does not support TLS") {
        Some("the server does not offer TLS and postgres.url asks for it (sslmode)")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::postgres::split_tls_params;

    #[test]
    fn only_a_connector_that_checks_nothing_of_its_own_waits_for_a_handshake() {
        let built = |url: &str| {
            let (_, s) = split_tls_params(url).unwrap();
            s.connector().unwrap().built.is_some()
        };
        assert!(!built("postgres://db/app"));
        assert!(!built("postgres://db/app?sslmode=require"));
        assert!(!built("postgres://db/app?sslmode=disable"));
        assert!(built("postgres://db/app?sslmode=verify-full"));
        assert!(built("postgres://db/app?sslmode=verify-ca"));
    }

    #[test]
    fn connector_names_the_file_at_fault() {
        let (_, s) =
            split_tls_params("postgres://db/app?sslmode=verify-ca&sslrootcert=/nope.pem").unwrap();
        let e = s.connector().err().unwrap().to_string();
        assert_eq!(
            e,
            "sslrootcert /nope.pem does not exist: give a readable PEM file"
        );
        let (_, s) = split_tls_params("postgres://db/app?sslmode=require&sslcert=/c.pem").unwrap();
        assert!(s
            .connector()
            .err()
            .unwrap()
            .to_string()
            .contains("go together"));
    }
}
