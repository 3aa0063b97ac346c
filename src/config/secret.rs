//! Secrets read from files (`*_file` keys): kept out of `Debug`, logs and errors, and
//! wiped from memory when dropped ([`secrecy`]).

use std::path::{Path, PathBuf};

use secrecy::{ExposeSecret, SecretString};

use super::ConfigError;

/// A secret value. It has no `Display`, and its `Debug` shows only that it is set: the
/// one way to the value is [`Secret::expose`], at the point of use.
#[derive(Clone)]
pub(crate) struct Secret(SecretString);

impl Secret {
    /// Takes `value` in as a secret.
    pub(crate) fn new(value: String) -> Secret {
        Secret(SecretString::from(value))
    }

    /// Reads a secret file as Kubernetes and systemd credentials write them: the whole
    /// file, one trailing newline dropped. `key` names the config key for errors, which
    /// show the path, never the contents.
    pub(crate) fn from_file(key: &str, path: &Path) -> Result<Secret, ConfigError> {
        let whole = std::fs::read_to_string(path)
            .map(Secret::new)
            .map_err(|e| {
                ConfigError::new(
                    key,
                    format!("cannot read {}: {e}: give a readable file", path.display()),
                )
            })?;
        let text = whole.expose();
        let value = text
            .strip_suffix("\r\n")
            .or_else(|| text.strip_suffix('\n'))
            .unwrap_or(text);
        if value.is_empty() {
            return Err(ConfigError::new(
                key,
                format!("{} is empty", path.display()),
            ));
        }
        Ok(Secret::new(value.to_owned()))
    }

    /// The value, at the point of use only.
    pub(crate) fn expose(&self) -> &str {
        self.0.expose_secret()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// A file the relay reads later (a NATS `.creds` file, a CA): it must exist now.
pub(crate) fn existing_file(key: &str, path: PathBuf) -> Result<PathBuf, ConfigError> {
    match std::fs::metadata(&path) {
        Ok(m) if m.is_file() => Ok(path),
        Ok(_) => Err(ConfigError::new(
            key,
            format!("{} is not a file", path.display()),
        )),
        Err(e) => Err(ConfigError::new(
            key,
            format!("cannot read {}: {e}: give a readable file", path.display()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_value_and_one_newline_is_dropped() {
        let dir = std::env::temp_dir().join(format!("secret-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pw");
        std::fs::write(&path, "hunter2\n").unwrap();
        let s = Secret::from_file("postgres.password_file", &path).unwrap();
        assert_eq!(s.expose(), "hunter2");
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        std::fs::write(&path, "\n").unwrap();
        let e = Secret::from_file("postgres.password_file", &path)
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("is empty"), "{e}");
        let e = Secret::from_file("k", &dir.join("missing"))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("k: cannot read"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
