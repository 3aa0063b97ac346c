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

use std::path::{Path, PathBuf};

use openssl::ssl::{SslConnector, SslFiletype, SslMethod, SslVerifyMode};
use postgres_openssl::MakeTlsConnector;
use tokio_postgres::config::SslMode;

/// How the relay's sessions use TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// TLS settings taken out of `postgres.url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: TlsMode,
    /// CA certificates (PEM) the server's chain must lead to; `None` with `system`.
    pub root_cert: Option<PathBuf>,
    /// `sslrootcert=system`: the operating system's CA store.
    pub system_roots: bool,
    /// Client certificate and key (PEM), for `clientcert=verify-*` in pg_hba.conf.
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

impl TlsSettings {
    /// What tokio-postgres itself should do with the connector: only `disable` and
    /// `prefer` may end up without TLS.
    pub fn ssl_mode(&self) -> SslMode {
        match self.mode {
            TlsMode::Disable => SslMode::Disable,
            TlsMode::Prefer => SslMode::Prefer,
            TlsMode::Require | TlsMode::VerifyCa | TlsMode::VerifyFull => SslMode::Require,
        }
    }

    /// The mode in effect: libpq checks the chain under `require` when a root certificate
    /// was given.
    fn effective_mode(&self) -> TlsMode {
        match self.mode {
            TlsMode::Require if self.root_cert.is_some() => TlsMode::VerifyCa,
            mode => mode,
        }
    }

    /// Builds the connector for these settings. Certificate files are read here, so a
    /// missing or malformed file is reported at start-up, naming the file.
    pub fn connector(&self) -> Result<MakeTlsConnector, String> {
        let mut builder = SslConnector::builder(SslMethod::tls())
            .map_err(|e| format!("cannot set up TLS: {e}"))?;
        let mode = self.effective_mode();
        let verify = matches!(mode, TlsMode::VerifyCa | TlsMode::VerifyFull);
        if verify {
            builder.set_verify(SslVerifyMode::PEER);
            match &self.root_cert {
                Some(path) => builder
                    .set_ca_file(path)
                    .map_err(|e| file_error("sslrootcert", path, &e))?,
                None => builder
                    .set_default_verify_paths()
                    .map_err(|e| format!("cannot load the system CA store: {e}"))?,
            }
        } else {
            builder.set_verify(SslVerifyMode::NONE);
        }
        match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(key)) => {
                builder
                    .set_certificate_chain_file(cert)
                    .map_err(|e| file_error("sslcert", cert, &e))?;
                let mismatch = || {
                    format!(
                        "sslkey {} does not belong to sslcert {}",
                        key.display(),
                        cert.display()
                    )
                };
                builder
                    .set_private_key_file(key, SslFiletype::PEM)
                    .map_err(|e| match e.to_string().contains("key values mismatch") {
                        true => mismatch(),
                        false => file_error("sslkey", key, &e),
                    })?;
                builder.check_private_key().map_err(|_| mismatch())?;
            }
            (None, None) => {}
            _ => return Err("sslcert and sslkey go together: give both".to_owned()),
        }
        let mut connector = MakeTlsConnector::new(builder.build());
        let check_host = mode == TlsMode::VerifyFull;
        connector.set_callback(move |config, _host| {
            config.set_verify_hostname(check_host);
            Ok(())
        });
        Ok(connector)
    }
}

fn file_error(param: &str, path: &Path, error: &openssl::error::ErrorStack) -> String {
    let why = if path.exists() {
        format!("cannot be used ({error})")
    } else {
        "does not exist".to_owned()
    };
    format!("{param} {} {why}: give a readable PEM file", path.display())
}

const TLS_PARAMS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// Takes the TLS parameters out of a connection string (URL or key=value), returning the
/// rest for tokio-postgres and the settings. tokio-postgres knows only three `sslmode`s
/// and none of the file parameters, so they are read here.
pub fn split_tls_params(conn: &str) -> Result<(String, TlsSettings), String> {
    let mut found: Vec<(String, String)> = Vec::new();
    let rest = if conn.starts_with("postgres://") || conn.starts_with("postgresql://") {
        match conn.split_once('?') {
            None => conn.to_owned(),
            Some((base, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                    if TLS_PARAMS.contains(&k) {
                        found.push((k.to_owned(), percent_decode(v)?));
                    } else {
                        kept.push(pair);
                    }
                }
                if kept.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
        }
    } else {
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
        kept.join(" ")
    };
    let mut settings = TlsSettings {
        mode: TlsMode::Prefer,
        root_cert: None,
        system_roots: false,
        client_cert: None,
        client_key: None,
    };
    for (k, v) in found {
        match k.as_str() {
            "sslmode" => {
                settings.mode = match v.as_str() {
                    "disable" => TlsMode::Disable,
                    "allow" | "prefer" => TlsMode::Prefer,
                    "require" => TlsMode::Require,
                    "verify-ca" => TlsMode::VerifyCa,
                    "verify-full" => TlsMode::VerifyFull,
                    other => {
                        return Err(format!(
                            "sslmode {other:?} is not one of disable, prefer, \
                             require, verify-ca, verify-full"
                        ))
                    }
                }
            }
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
    Ok((rest, settings))
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

fn percent_decode(v: &str) -> Result<String, String> {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = v
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad %-escape in {v:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{v:?} is not UTF-8"))
}

/// A clearer sentence for TLS failures than OpenSSL's error stack alone.
pub fn explain(message: &str) -> Option<&'static str> {
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
        let e = s.connector().err().unwrap();
        assert_eq!(
            e,
            "sslrootcert /nope.pem does not exist: give a readable PEM file"
        );
        let (_, s) = split_tls_params("postgres://db/app?sslmode=require&sslcert=/c.pem").unwrap();
        assert!(s.connector().err().unwrap().contains("go together"));
    }
}
