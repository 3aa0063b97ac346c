//! `[postgres]`: the connection URL, the pool and the session deadlines.
//!
//! `postgres.url` is read as libpq users write it: the TLS parameters (`sslmode`, `sslrootcert`,
//! `sslcert`, `sslkey`) are taken out of the URL or key=value string here, because
//! tokio-postgres knows only three `sslmode`s and none of the file parameters. The
//! certificate files are read at load time, so a missing or malformed one is a config
//! error (exit 2); the OpenSSL connector itself is built in `source::tls`.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use tokio_postgres::config::SslMode;

use super::raw::RawPostgres;
use super::{pem, positive, ConfigError, Secret};

/// `[postgres]`, checked.
#[derive(Clone)]
pub struct PostgresConfig {
    /// Parsed connection settings; may hold a password, so this type's `Debug` is redacted.
    pub(crate) connection: tokio_postgres::Config,
    /// Connections in the pool; at least `relay.workers`. Default 8.
    pub(crate) pool_size: usize,
    /// Client and server-side deadline for one statement. Default 30 s.
    pub(crate) statement_timeout: Duration,
    /// Deadline for opening a connection. Default 10 s.
    pub(crate) connect_timeout: Duration,
    /// Keep the claim's statements prepared per session (see `source::Tx`). Default true.
    pub(crate) prepared_statements: bool,
    /// `sslmode`, `sslrootcert`, `sslcert`, `sslkey` from the URL (see `source::tls`).
    pub(crate) tls: TlsSettings,
    /// `listen_url`: where LISTEN connects instead of `url` (a pooler in transaction mode
    /// cannot keep a LISTEN).
    pub(crate) listen: Option<ListenTarget>,
}

/// A connection target for LISTEN (`postgres.listen_url`).
#[derive(Clone)]
pub(crate) struct ListenTarget {
    pub(crate) connection: tokio_postgres::Config,
    pub(crate) tls: TlsSettings,
}

impl PostgresConfig {
    /// The settings LISTEN connects with: `listen_url`'s when given, else `url`'s.
    pub(crate) fn for_listen(&self) -> PostgresConfig {
        let mut pg = self.clone();
        if let Some(listen) = &self.listen {
            pg.connection = listen.connection.clone();
            pg.tls = listen.tls.clone();
        }
        pg
    }
}

impl PostgresConfig {
    /// `postgres://user@host:port/db` without the password, for logs and `check`.
    pub(crate) fn redacted(&self) -> String {
        let c = &self.connection;
        let user = c.get_user().unwrap_or("");
        let hosts: Vec<String> = c
            .get_hosts()
            .iter()
            .zip(c.get_ports().iter().chain(std::iter::repeat(&5432)))
            .map(|(h, p)| match h {
                tokio_postgres::config::Host::Tcp(h) => format!("{h}:{p}"),
                tokio_postgres::config::Host::Unix(path) => format!("{}:{p}", path.display()),
            })
            .collect();
        format!(
            "postgres://{user}@{}/{}",
            hosts.join(","),
            c.get_dbname().unwrap_or("")
        )
    }
}

impl std::fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &self.redacted())
            .field("pool_size", &self.pool_size)
            .field("statement_timeout", &self.statement_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("prepared_statements", &self.prepared_statements)
            .field("tls", &self.tls)
            .field("listen_url", &self.listen.is_some())
            .finish()
    }
}

/// Validates `postgres.url` and `postgres.password_file`: the connection settings and the
/// TLS settings, certificate files read.
pub(super) fn connection(
    raw: &RawPostgres,
) -> Result<(tokio_postgres::Config, TlsSettings), ConfigError> {
    target("postgres.url", &raw.url, raw.password_file.as_deref(), true)
}

/// One connection target: `url` (under config key `key`) with its TLS parameters taken out
/// and checked, and the password from `password_file` when given (`strict`: the URL must
/// not hold one too; otherwise the URL's wins).
fn target(
    key: &str,
    url: &str,
    password_file: Option<&std::path::Path>,
    strict: bool,
) -> Result<(tokio_postgres::Config, TlsSettings), ConfigError> {
    let at_url = |e: String| ConfigError::new(key, e);
    let (url, tls) = split_tls_params(url).map_err(at_url)?;
    // Certificate files are read now: a missing one is a config error, not a runtime one.
    tls.check_files().map_err(at_url)?;
    let mut connection = tokio_postgres::Config::from_str(&url).map_err(|e| {
        // tokio-postgres names the option at fault without echoing values.
        at_url(format!("not a valid PostgreSQL connection URL ({e})"))
    })?;
    connection.ssl_mode(tls.ssl_mode());
    if let Some(path) = password_file {
        let file_key = "postgres.password_file";
        if connection.get_password().is_some() && strict {
            return Err(ConfigError::new(
                file_key,
                "is set and postgres.url has a password too: keep one",
            ));
        }
        if connection.get_password().is_none() {
            let password = Secret::from_file(file_key, path)?;
            connection.password(password.expose());
        }
    }
    if connection.get_hosts().is_empty() {
        return Err(at_url(
            "names no host: write postgres://user@host:5432/db".into(),
        ));
    }
    Ok((connection, tls))
}

/// Validates the rest of `[postgres]` around a checked [`connection`]: the pool must
/// give each of `workers` a connection.
pub(super) fn validate(
    raw: RawPostgres,
    (connection, tls): (tokio_postgres::Config, TlsSettings),
    workers: usize,
) -> Result<PostgresConfig, ConfigError> {
    if raw.pool_size < workers {
        return Err(ConfigError::new(
            "postgres.pool_size",
            format!(
                "is {} but must be at least relay.workers ({workers}): each worker holds a \
                 connection",
                raw.pool_size
            ),
        ));
    }
    let listen = match &raw.listen_url {
        None => None,
        Some(url) => {
            let (connection, tls) = target(
                "postgres.listen_url",
                url,
                raw.password_file.as_deref(),
                false,
            )?;
            Some(ListenTarget { connection, tls })
        }
    };
    Ok(PostgresConfig {
        connection,
        listen,
        pool_size: raw.pool_size,
        statement_timeout: positive("postgres.statement_timeout", raw.statement_timeout)?,
        connect_timeout: positive("postgres.connect_timeout", raw.connect_timeout)?,
        prepared_statements: raw.prepared_statements,
        tls,
    })
}

/// How the relay's sessions use TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TlsMode {
    /// Never encrypted.
    Disable,
    /// Encrypted if the server offers it; the certificate is not checked (as libpq).
    Prefer,
    /// Always encrypted; the chain is checked only if `sslrootcert` is given (as libpq).
    Require,
    /// Always encrypted, the chain checked.
    VerifyCa,
    /// Always encrypted, the chain and the host name checked.
    VerifyFull,
}

/// TLS settings taken out of `postgres.url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TlsSettings {
    /// `sslmode`; default `prefer`, as with libpq.
    pub(crate) mode: TlsMode,
    /// CA certificates (PEM) the server's chain must lead to; `None` with `system`.
    pub(crate) root_cert: Option<PathBuf>,
    /// `sslrootcert=system`: the operating system's CA store.
    pub(crate) system_roots: bool,
    /// Client certificate (PEM), for `clientcert=verify-*` in pg_hba.conf.
    pub(crate) client_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    pub(crate) client_key: Option<PathBuf>,
}

impl TlsSettings {
    /// What tokio-postgres itself should do with the connector: only `disable` and
    /// `prefer` may end up without TLS.
    pub(crate) fn ssl_mode(&self) -> SslMode {
        match self.mode {
            TlsMode::Disable => SslMode::Disable,
            TlsMode::Prefer => SslMode::Prefer,
            TlsMode::Require | TlsMode::VerifyCa | TlsMode::VerifyFull => SslMode::Require,
        }
    }

    /// The mode in effect: libpq checks the chain under `require` when a root certificate
    /// was given.
    pub(crate) fn effective_mode(&self) -> TlsMode {
        match self.mode {
            TlsMode::Require if self.root_cert.is_some() => TlsMode::VerifyCa,
            mode => mode,
        }
    }

    /// Whether the server's certificate chain is checked.
    pub(crate) fn verifies_chain(&self) -> bool {
        matches!(
            self.effective_mode(),
            TlsMode::VerifyCa | TlsMode::VerifyFull
        )
    }

    /// Reads the certificate files the connector will use, as it will use them: the root
    /// certificate only when the chain is checked, the client certificate and key
    /// together, and the key must belong to the certificate. Errors name the parameter
    /// and the file, never a file's contents.
    pub(crate) fn check_files(&self) -> Result<(), String> {
        if let (true, Some(path)) = (self.verifies_chain(), &self.root_cert) {
            pem::certificates(path).map_err(|why| at("sslrootcert", path, why))?;
        }
        match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(key)) => {
                let chain = pem::certificates(cert).map_err(|why| at("sslcert", cert, why))?;
                let private = pem::private_key(key, None).map_err(|why| at("sslkey", key, why))?;
                if !pem::belongs_to(&private, &chain[0]) {
                    return Err(key_mismatch(cert, key));
                }
                Ok(())
            }
            (None, None) => Ok(()),
            _ => Err("sslcert and sslkey go together: give both".to_owned()),
        }
    }
}

/// `sslkey ... does not belong to sslcert ...`.
pub(crate) fn key_mismatch(cert: &Path, key: &Path) -> String {
    format!(
        "sslkey {} does not belong to sslcert {}",
        key.display(),
        cert.display()
    )
}

/// `sslcert /c.pem cannot be used (...): give a readable PEM file`.
fn at(param: &str, path: &Path, why: String) -> String {
    format!("{param} {} {why}: give a readable PEM file", path.display())
}

/// `sslrootcert /ca.pem does not exist: give a readable PEM file`, or `cannot be used`
/// with the reason: for the connector, which reads the files again.
pub(crate) fn file_error(param: &str, path: &Path, error: &dyn std::fmt::Display) -> String {
    at(param, path, pem::why(path, error))
}

const TLS_PARAMS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// Takes the TLS parameters out of a connection string (URL or key=value), returning the
/// rest for tokio-postgres and the settings. tokio-postgres knows only three `sslmode`s
/// and none of the file parameters, so they are read here.
pub(crate) fn split_tls_params(conn: &str) -> Result<(String, TlsSettings), String> {
    let (rest, found) = if conn.starts_with("postgres://") || conn.starts_with("postgresql://") {
        split_url(conn)?
    } else {
        split_key_values(conn)?
    };
    Ok((rest, tls_settings(found)?))
}

/// The URL without its TLS query parameters, and those parameters (decoded).
fn split_url(conn: &str) -> Result<(String, Vec<(String, String)>), String> {
    let Some((base, query)) = conn.split_once('?') else {
        return Ok((conn.to_owned(), Vec::new()));
    };
    let mut found = Vec::new();
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if TLS_PARAMS.contains(&k) {
            found.push((k.to_owned(), percent_decode(v).map_err(|e| e.to_string())?));
        } else {
            kept.push(pair);
        }
    }
    let rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((rest, found))
}

/// A key=value string without its TLS parameters (re-quoted), and those parameters.
fn split_key_values(conn: &str) -> Result<(String, Vec<(String, String)>), String> {
    let mut found = Vec::new();
    let mut kept = Vec::new();
    for (k, v) in key_values(conn)? {
        if TLS_PARAMS.contains(&k.as_str()) {
            found.push((k, v));
        } else {
            kept.push(format!(
                "{k}='{}'",
                v.replace('\\', "\\\\").replace('\'', "\\'")
            ));
        }
    }
    Ok((kept.join(" "), found))
}

/// The settings the TLS parameters ask for; `prefer` when none is given, as with libpq.
fn tls_settings(found: Vec<(String, String)>) -> Result<TlsSettings, String> {
    let mut settings = TlsSettings {
        mode: TlsMode::Prefer,
        root_cert: None,
        system_roots: false,
        client_cert: None,
        client_key: None,
    };
    for (k, v) in found {
        match k.as_str() {
            "sslmode" => settings.mode = tls_mode(&v)?,
            "sslrootcert" if v == "system" => settings.system_roots = true,
            "sslrootcert" => settings.root_cert = Some(PathBuf::from(v)),
            "sslcert" => settings.client_cert = Some(PathBuf::from(v)),
            "sslkey" => settings.client_key = Some(PathBuf::from(v)),
            _ => unreachable!("only TLS parameters are collected"),
        }
    }
    if settings.system_roots && settings.mode != TlsMode::VerifyFull {
        // libpq: sslrootcert=system requires verify-full (a public CA signs for anyone).
        return Err(
            "sslrootcert=system needs sslmode=verify-full: any certificate a \
             public CA signed would pass verify-ca"
                .to_owned(),
        );
    }
    Ok(settings)
}

/// `sslmode`, as libpq reads it (`allow` is taken as `prefer`).
fn tls_mode(value: &str) -> Result<TlsMode, String> {
    match value {
        "disable" => Ok(TlsMode::Disable),
        "allow" | "prefer" => Ok(TlsMode::Prefer),
        "require" => Ok(TlsMode::Require),
        "verify-ca" => Ok(TlsMode::VerifyCa),
        "verify-full" => Ok(TlsMode::VerifyFull),
        other => Err(format!(
            "sslmode {other:?} is not one of disable, prefer, require, verify-ca, verify-full"
        )),
    }
}

/// `key=value` pairs of a libpq key=value string; values may be single-quoted with `\`
/// escapes.
fn key_values(conn: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut chars = conn.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            return Ok(out);
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') {
            return Err(format!("{key:?} has no value (write key=value)"));
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            loop {
                match chars.next() {
                    Some('\\') => value.extend(chars.next()),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => return Err(format!("value of {key} is not closed")),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                if c == '\\' {
                    chars.next();
                    value.extend(chars.next());
                    continue;
                }
                value.push(c);
                chars.next();
            }
        }
        out.push((key, value));
    }
}

/// A URL query value that does not decode.
#[derive(Debug, thiserror::Error)]
enum DecodeError {
    /// A `%` not followed by two hex digits.
    #[error("bad %-escape in {value:?}")]
    Escape { value: String },
    /// The decoded bytes are not UTF-8; `source` says where they stop being.
    #[error("{value:?} is not UTF-8")]
    Utf8 {
        value: String,
        source: std::str::Utf8Error,
    },
}

/// Decodes a `%XX`-escaped URL query value. A `%` not followed by two hex digits is an
/// error rather than kept as written: it is a typo in a file path.
fn percent_decode(v: &str) -> Result<String, DecodeError> {
    let malformed = v.match_indices('%').any(|(at, _)| {
        !v.get(at + 1..at + 3)
            .is_some_and(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()))
    });
    if malformed {
        return Err(DecodeError::Escape {
            value: v.to_owned(),
        });
    }
    percent_encoding::percent_decode_str(v)
        .decode_utf8()
        .map(|text| text.into_owned())
        .map_err(|source| DecodeError::Utf8 {
            value: v.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parameters_are_taken_out_and_the_rest_kept() {
        let (rest, s) = split_tls_params(
            "postgres://u:p@db:5432/app?sslmode=verify-full&application_name=x&sslrootcert=%2Fca%20dir%2Froot.pem",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u:p@db:5432/app?application_name=x");
        assert_eq!(s.mode, TlsMode::VerifyFull);
        assert_eq!(s.root_cert, Some(PathBuf::from("/ca dir/root.pem")));
        assert_eq!(s.ssl_mode(), SslMode::Require);
    }

    #[test]
    fn key_value_strings_work_too() {
        let (rest, s) = split_tls_params(
            "host=db user=relay password='a b\\'c' sslmode=verify-ca sslcert=/c.pem sslkey=/k.pem",
        )
        .unwrap();
        assert_eq!(rest, "host='db' user='relay' password='a b\\'c'");
        assert_eq!(s.mode, TlsMode::VerifyCa);
        assert_eq!(s.client_cert, Some(PathBuf::from("/c.pem")));
        let parsed: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(parsed.get_password(), Some(&b"a b'c"[..]));
    }

    #[test]
    fn the_default_is_prefer_and_require_with_a_root_cert_checks_the_chain() {
        let (rest, s) = split_tls_params("postgres://db/app").unwrap();
        assert_eq!(rest, "postgres://db/app");
        assert_eq!(s.mode, TlsMode::Prefer);
        let (_, s) =
            split_tls_params("postgres://db/app?sslmode=require&sslrootcert=/ca.pem").unwrap();
        assert_eq!(s.effective_mode(), TlsMode::VerifyCa);
    }

    #[test]
    fn bad_parameters_name_the_problem() {
        let e = split_tls_params("postgres://db/app?sslmode=verify").unwrap_err();
        assert!(e.contains("sslmode \"verify\" is not one of"), "{e}");
        let e =
            split_tls_params("postgres://db/app?sslmode=verify-ca&sslrootcert=system").unwrap_err();
        assert!(e.contains("needs sslmode=verify-full"), "{e}");
        let (_, s) =
            split_tls_params("postgres://db/app?sslmode=verify-ca&sslrootcert=/nope.pem").unwrap();
        assert_eq!(
            s.check_files().unwrap_err(),
            "sslrootcert /nope.pem does not exist: give a readable PEM file"
        );
        let (_, s) = split_tls_params("postgres://db/app?sslmode=require&sslcert=/c.pem").unwrap();
        assert!(s.check_files().unwrap_err().contains("go together"));
        // Unread unless the chain is checked, as the connector does.
        let (_, s) =
            split_tls_params("postgres://db/app?sslmode=prefer&sslrootcert=/nope.pem").unwrap();
        assert_eq!(s.check_files(), Ok(()));
    }

    #[test]
    fn percent_escapes_are_decoded_and_bad_ones_refused() {
        assert_eq!(percent_decode("%2Fa%20b").unwrap(), "/a b");
        assert_eq!(percent_decode("plain").unwrap(), "plain");
        for bad in ["%", "%2", "%zz", "a%2"] {
            let e = percent_decode(bad).unwrap_err();
            assert!(matches!(e, DecodeError::Escape { .. }), "{bad}: {e:?}");
            assert_eq!(e.to_string(), format!("bad %-escape in {bad:?}"));
        }
        let e = percent_decode("a%ff").unwrap_err();
        assert_eq!(e.to_string(), "\"a%ff\" is not UTF-8");
        let DecodeError::Utf8 { source, .. } = e else {
            panic!("{e:?}");
        };
        assert_eq!(
            source.valid_up_to(),
            1,
            "the decoded `a` is valid, `%ff` is not"
        );
    }

    #[test]
    fn certificate_files_are_read_at_load() {
        let dir = std::env::temp_dir().join(format!("pg-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let url = format!(
            "postgres://db/app?sslmode=verify-ca&sslrootcert={}",
            junk.display()
        );
        let (_, s) = split_tls_params(&url).unwrap();
        let e = s.check_files().unwrap_err();
        assert!(
            e.starts_with(&format!("sslrootcert {} cannot be used", junk.display())),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
