//! `[sink.nats]`: server URLs, credentials and TLS files, checked at load so that a
//! mistake in them exits 2 before any server is asked.

use std::path::PathBuf;

use super::raw::RawNats;
use super::{redact_userinfo, secret, ConfigError, Secret};

/// `[sink.nats]`, checked.
#[derive(Clone)]
pub struct NatsConfig {
    /// Server URLs (`url`, comma separated); may carry `user:password@`, so `Debug` is
    /// redacted.
    pub urls: Vec<String>,
    /// `credentials_file` or `nkey_file`, if either is set.
    pub auth: NatsAuth,
    /// `tls_ca_file`: verify the server against these CAs (and require TLS).
    pub tls_ca: Option<PathBuf>,
    /// `tls_cert_file` and `tls_key_file`.
    pub tls_client: Option<(PathBuf, PathBuf)>,
}

/// How the relay authenticates to NATS beyond what the URL carries.
#[derive(Debug, Clone)]
pub enum NatsAuth {
    /// The URL's credentials, if any.
    None,
    /// A `.creds` file, read by the client at connect time.
    CredentialsFile(PathBuf),
    /// A user nkey seed, read from `nkey_file`.
    NKey(Secret),
}

impl NatsConfig {
    /// The server URLs with any credentials removed.
    pub fn redacted(&self) -> String {
        self.urls
            .iter()
            .map(|u| redact_userinfo(u))
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("urls", &self.redacted())
            .finish()
    }
}

/// Validates `[sink.nats]` (all defaults when the section is absent).
pub(super) fn validate(raw: Option<RawNats>) -> Result<NatsConfig, ConfigError> {
    let raw = raw.unwrap_or_default();
    let urls: Vec<String> = raw.url.split(',').map(|u| u.trim().to_owned()).collect();
    if urls.iter().any(String::is_empty) {
        return Err(ConfigError::new(
            "sink.nats.url",
            "contains an empty server URL",
        ));
    }
    let auth = auth(raw.credentials_file, raw.nkey_file)?;
    let tls_ca = raw
        .tls_ca_file
        .map(|p| file("tls_ca_file", p))
        .transpose()?;
    let tls_client = match (raw.tls_cert_file, raw.tls_key_file) {
        (Some(c), Some(k)) => Some((file("tls_cert_file", c)?, file("tls_key_file", k)?)),
        (None, None) => None,
        _ => {
            return Err(ConfigError::new(
                "sink.nats.tls_cert_file",
                "and sink.nats.tls_key_file go together: give both",
            ))
        }
    };
    Ok(NatsConfig {
        urls,
        auth,
        tls_ca,
        tls_client,
    })
}

/// A file under `[sink.nats]` that the client reads later: it must exist now.
fn file(key: &str, path: PathBuf) -> Result<PathBuf, ConfigError> {
    secret::existing_file(&format!("sink.nats.{key}"), path)
}

/// `credentials_file` or `nkey_file` (not both).
fn auth(
    credentials_file: Option<PathBuf>,
    nkey_file: Option<PathBuf>,
) -> Result<NatsAuth, ConfigError> {
    match (credentials_file, nkey_file) {
        (Some(_), Some(_)) => Err(ConfigError::new(
            "sink.nats.nkey_file",
            "is set and sink.nats.credentials_file too: a .creds file carries its own nkey; \
             keep one",
        )),
        (Some(path), None) => Ok(NatsAuth::CredentialsFile(file("credentials_file", path)?)),
        (None, Some(path)) => {
            let key = "sink.nats.nkey_file";
            let seed = Secret::from_file(key, &path)?;
            if !seed.expose().trim().starts_with("SU") {
                return Err(ConfigError::new(
                    key,
                    format!(
                        "{} does not hold a user nkey seed (one line starting with SU)",
                        path.display()
                    ),
                ));
            }
            Ok(NatsAuth::NKey(Secret::new(seed.expose().trim().to_owned())))
        }
        (None, None) => Ok(NatsAuth::None),
    }
}
