//! `[sink.nats]`: server URLs, credentials and TLS files, checked at load so that a
//! mistake in them exits 2 before any server is asked: every URL parses as the client
//! parses it, a `.creds` file holds a user JWT and a valid seed, an nkey file a valid user
//! seed, and the TLS files are PEM (the client key belonging to the client certificate).

use std::path::PathBuf;

use serde::Deserialize;

use super::{pem, redact_userinfo, secret, ConfigError, Secret};

/// `[sink.nats]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawNats {
    /// Server URL(s), comma separated. Default `nats://127.0.0.1:4222`.
    #[serde(default = "default_url")]
    pub(crate) url: String,
    /// A `.creds` file (user JWT and nkey seed).
    #[serde(default)]
    pub(crate) credentials_file: Option<std::path::PathBuf>,
    /// A file holding a user nkey seed (`SU...`).
    #[serde(default)]
    pub(crate) nkey_file: Option<std::path::PathBuf>,
    /// CA certificates (PEM) to verify the server with; implies TLS.
    #[serde(default)]
    pub(crate) tls_ca_file: Option<std::path::PathBuf>,
    /// Client certificate and key (PEM) for servers that verify clients.
    #[serde(default)]
    pub(crate) tls_cert_file: Option<std::path::PathBuf>,
    #[serde(default)]
    pub(crate) tls_key_file: Option<std::path::PathBuf>,
}

impl Default for RawNats {
    fn default() -> Self {
        RawNats {
            url: default_url(),
            credentials_file: None,
            nkey_file: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
        }
    }
}

/// `sink.nats.url`'s default.
fn default_url() -> String {
    "nats://127.0.0.1:4222".to_owned()
}

/// `[sink.nats]`, checked.
#[derive(Clone)]
pub struct NatsConfig {
    /// Server URLs (`url`, comma separated); may carry `user:password@`, so `Debug` is
    /// redacted.
    pub(crate) urls: Vec<String>,
    /// `credentials_file` or `nkey_file`, if either is set.
    pub(crate) auth: NatsAuth,
    /// `tls_ca_file`: verify the server against these CAs (and require TLS).
    pub(crate) tls_ca: Option<PathBuf>,
    /// `tls_cert_file` and `tls_key_file`.
    pub(crate) tls_client: Option<(PathBuf, PathBuf)>,
}

/// How the relay authenticates to NATS beyond what the URL carries.
#[derive(Debug, Clone)]
pub(crate) enum NatsAuth {
    /// The URL's credentials, if any.
    None,
    /// A `.creds` file, read by the client at connect time.
    CredentialsFile(PathBuf),
    /// A user nkey seed, read from `nkey_file`.
    NKey(Secret),
}

impl NatsConfig {
    /// The server URLs with any credentials removed.
    pub(crate) fn redacted(&self) -> String {
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
    for url in &urls {
        check_url(url)?;
    }
    let auth = auth(raw.credentials_file, raw.nkey_file)?;
    let tls_ca = raw.tls_ca_file.map(tls_ca).transpose()?;
    let tls_client = tls_client(raw.tls_cert_file, raw.tls_key_file)?;
    Ok(NatsConfig {
        urls,
        auth,
        tls_ca,
        tls_client,
    })
}

/// A server URL the client accepts: `nats://`, `tls://`, `ws://` or `wss://`, or a bare
/// `host:port`.
fn check_url(url: &str) -> Result<(), ConfigError> {
    match url.parse::<async_nats::ServerAddr>() {
        Ok(_) => Ok(()),
        Err(_) => Err(ConfigError::new(
            "sink.nats.url",
            format!(
                "{} is not a NATS URL (write nats://host:4222)",
                redact_userinfo(url)
            ),
        )),
    }
}

/// `tls_ca_file`: PEM certificates.
fn tls_ca(path: PathBuf) -> Result<PathBuf, ConfigError> {
    let path = file("tls_ca_file", path)?;
    pem::certificates(&path).map_err(|why| not_pem("tls_ca_file", &path, why))?;
    Ok(path)
}

/// `tls_cert_file` and `tls_key_file`: both or neither; PEM, the key the certificate's.
fn tls_client(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> Result<Option<(PathBuf, PathBuf)>, ConfigError> {
    let (cert, key) = match (cert, key) {
        (Some(c), Some(k)) => (file("tls_cert_file", c)?, file("tls_key_file", k)?),
        (None, None) => return Ok(None),
        _ => {
            return Err(ConfigError::new(
                "sink.nats.tls_cert_file",
                "and sink.nats.tls_key_file go together: give both",
            ))
        }
    };
    let chain = pem::certificates(&cert).map_err(|why| not_pem("tls_cert_file", &cert, why))?;
    let private = pem::private_key(&key, None).map_err(|why| not_pem("tls_key_file", &key, why))?;
    if !pem::belongs_to(&private, &chain[0]) {
        return Err(ConfigError::new(
            "sink.nats.tls_key_file",
            format!(
                "{} does not belong to sink.nats.tls_cert_file {}",
                key.display(),
                cert.display()
            ),
        ));
    }
    Ok(Some((cert, key)))
}

fn not_pem(key: &str, path: &std::path::Path, why: String) -> ConfigError {
    ConfigError::new(
        format!("sink.nats.{key}"),
        format!("{} {why}: give a readable PEM file", path.display()),
    )
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
        (Some(path), None) => credentials(path).map(NatsAuth::CredentialsFile),
        (None, Some(path)) => nkey(&path).map(NatsAuth::NKey),
        (None, None) => Ok(NatsAuth::None),
    }
}

/// `credentials_file`: a `.creds` file with a user JWT and nkey seed, parsed as the client
/// will parse it. The error never quotes the file.
fn credentials(path: PathBuf) -> Result<PathBuf, ConfigError> {
    let key = "sink.nats.credentials_file";
    let path = file("credentials_file", path)?;
    // Read as the client reads it: the whole file (the seed block ends with a newline).
    let text = std::fs::read_to_string(&path).map_err(|e| {
        ConfigError::new(
            key,
            format!("cannot read {}: {e}: give a readable file", path.display()),
        )
    })?;
    let text = Secret::new(text);
    match async_nats::ConnectOptions::with_credentials(text.expose()) {
        Ok(_) => Ok(path),
        Err(e) => Err(ConfigError::new(
            key,
            format!(
                "{} is not a usable .creds file ({e}): give the file `nsc generate creds` \
                 wrote",
                path.display()
            ),
        )),
    }
}

/// `nkey_file`: one user nkey seed (`SU...`), checked as the client will check it.
fn nkey(path: &std::path::Path) -> Result<Secret, ConfigError> {
    let key = "sink.nats.nkey_file";
    let seed = Secret::from_file(key, path)?;
    let seed = seed.expose().trim();
    let not_a_seed = |why: String| {
        ConfigError::new(
            key,
            format!(
                "{} does not hold a user nkey seed (one line starting with SU){why}",
                path.display()
            ),
        )
    };
    if !seed.starts_with("SU") {
        return Err(not_a_seed(String::new()));
    }
    // The nkeys error names what is wrong (checksum, length), never the seed.
    nkeys::KeyPair::from_seed(seed).map_err(|e| not_a_seed(format!(": {e}")))?;
    Ok(Secret::new(seed.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cfg-nats-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn with(change: impl FnOnce(&mut RawNats)) -> Result<NatsConfig, String> {
        let mut raw = RawNats::default();
        change(&mut raw);
        validate(Some(raw)).map_err(|e| e.to_string())
    }

    #[test]
    fn a_url_the_client_refuses_is_a_config_error_without_its_password() {
        assert!(with(|r| r.url = "nats://a:4222, tls://b:4222,c:4222".into()).is_ok());
        let e = with(|r| r.url = "http://u:s3cret@host:4222".into()).unwrap_err();
        assert_eq!(
            e,
            "sink.nats.url: http://<redacted>@host:4222 is not a NATS URL (write \
             nats://host:4222)"
        );
        let e = with(|r| r.url = "nats://host:notaport".into()).unwrap_err();
        assert!(e.starts_with("sink.nats.url: "), "{e}");
    }

    #[test]
    fn a_creds_file_or_nkey_seed_the_client_cannot_use_is_a_config_error() {
        let creds = temp_file(
            "bad.creds",
            "-----BEGIN NATS USER JWT-----\nnot a creds file\n",
        );
        let e = with(|r| r.credentials_file = Some(creds.clone())).unwrap_err();
        assert!(
            e.starts_with("sink.nats.credentials_file: ") && e.contains("not a usable .creds"),
            "{e}"
        );
        let seed = nkeys::KeyPair::new_user().seed().unwrap();
        let good = temp_file(
            "good.creds",
            &format!(
                "-----BEGIN NATS USER JWT-----\neyJhbGciOiJlZDI1NTE5In0.e30.c2ln\n\
                 ------END NATS USER JWT------\n\n-----BEGIN USER NKEY SEED-----\n{seed}\n\
                 ------END USER NKEY SEED------\n"
            ),
        );
        let c = with(|r| r.credentials_file = Some(good.clone())).unwrap();
        assert!(matches!(c.auth, NatsAuth::CredentialsFile(p) if p == good));
        let nkey = temp_file("good.nk", &format!("{seed}\n"));
        let c = with(|r| r.nkey_file = Some(nkey.clone())).unwrap();
        assert!(matches!(c.auth, NatsAuth::NKey(s) if s.expose() == seed));
        // A seed with a bad checksum: right prefix, wrong body; never echoed.
        let seed = "SUAIO3FHUX5PNV2LQIIP7TZ3N4L7TX3W53MQGEIVYFIGA635OZCKEYHFLA";
        let nkey = temp_file("bad.nk", seed);
        let e = with(|r| r.nkey_file = Some(nkey.clone())).unwrap_err();
        assert!(e.starts_with("sink.nats.nkey_file: "), "{e}");
        assert!(e.contains("does not hold a user nkey seed"), "{e}");
        assert!(!e.contains(seed), "{e}");
        let nkey = temp_file("not-user.nk", "SAAIO3FHUX5PNV2LQIIP7TZ3N4L7TX3W53MQ");
        let e = with(|r| r.nkey_file = Some(nkey.clone())).unwrap_err();
        assert!(e.contains("(one line starting with SU)"), "{e}");
    }

    #[test]
    fn tls_files_must_be_pem_now() {
        let junk = temp_file("junk.pem", "not a certificate");
        let e = with(|r| r.tls_ca_file = Some(junk.clone())).unwrap_err();
        assert!(
            e.starts_with(&format!(
                "sink.nats.tls_ca_file: {} cannot be used (",
                junk.display()
            )),
            "{e}"
        );
        let e = with(|r| {
            r.tls_cert_file = Some(junk.clone());
            r.tls_key_file = Some(junk.clone());
        })
        .unwrap_err();
        assert!(e.starts_with("sink.nats.tls_cert_file: "), "{e}");
        let e = with(|r| r.tls_cert_file = Some(junk.clone())).unwrap_err();
        assert!(e.contains("go together"), "{e}");
    }
}
