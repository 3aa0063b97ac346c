//! [`ConfigError`]: what is wrong with the configuration, and under which key.

use std::fmt;
use std::path::PathBuf;

/// One applied `OUTBOX_RELAY__...` override (see `env`), kept so that an error on its key
/// can name the variable.
#[derive(Debug, Clone)]
pub(crate) struct Override {
    pub(crate) variable: String,
    pub(crate) path: Vec<String>,
}

/// A configuration problem: always the operator's to fix, always exit code 2.
///
/// Shown as `key: problem`, with ` (set by OUTBOX_RELAY__...)` when an environment
/// variable set the key, one line per problem, after the file's path once it is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The key at fault, as written in the file (`relay.workers`, `tables[0].name`);
    /// empty when the problem is no single key's (the file cannot be read, a TOML syntax
    /// error, which names its line and column instead).
    pub key: String,
    /// What is wrong and what to write instead. Never holds a secret.
    pub problem: String,
    /// The `OUTBOX_RELAY__...` variable that set the key, if one did.
    pub(crate) set_by: Option<String>,
    /// Further problems found in the same pass (all Kafka properties are checked at once).
    pub(crate) more: Vec<ConfigError>,
    /// The configuration file, once the problem is reported for it.
    pub(crate) file: Option<PathBuf>,
}

impl ConfigError {
    /// A problem with `key`.
    pub(crate) fn new(key: impl Into<String>, problem: impl Into<String>) -> ConfigError {
        ConfigError {
            key: key.into(),
            problem: problem.into(),
            set_by: None,
            more: Vec::new(),
            file: None,
        }
    }

    /// A problem that is no single key's (the message says where).
    pub(crate) fn general(problem: impl Into<String>) -> ConfigError {
        ConfigError::new("", problem)
    }

    /// All of `problems` at once; `Ok` when there is none.
    pub(crate) fn all(problems: Vec<ConfigError>) -> Result<(), ConfigError> {
        let mut problems = problems.into_iter();
        match problems.next() {
            None => Ok(()),
            Some(mut first) => {
                first.more.extend(problems);
                Err(first)
            }
        }
    }

    /// Every problem, this one first.
    pub(crate) fn problems(&self) -> impl Iterator<Item = &ConfigError> {
        std::iter::once(self).chain(self.more.iter())
    }

    /// Names the variable that set each key at fault, if one did.
    pub(super) fn with_sources(mut self, overrides: &[Override]) -> ConfigError {
        let source = |key: &str| {
            let key = key.replace('[', ".").replace(']', "");
            overrides
                .iter()
                .find(|o| o.path.join(".") == key)
                .map(|o| o.variable.clone())
        };
        self.set_by = source(&self.key);
        for more in &mut self.more {
            more.set_by = source(&more.key);
        }
        self
    }

    /// Reports the problem for the configuration file at `file`.
    pub(super) fn in_file(mut self, file: PathBuf) -> ConfigError {
        self.file = Some(file);
        self
    }

    fn line(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.key.is_empty() {
            write!(f, "{}: ", self.key)?;
        }
        f.write_str(&self.problem)?;
        match &self.set_by {
            Some(variable) => write!(f, " (set by {variable})"),
            None => Ok(()),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{}: ", file.display())?;
        }
        for (i, problem) in self.problems().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            problem.line(f)?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_as_key_problem_with_the_variable_and_the_file() {
        let e = ConfigError::new("relay.workers", "must be between 1 and 256");
        assert_eq!(e.to_string(), "relay.workers: must be between 1 and 256");
        let overrides = [Override {
            variable: "OUTBOX_RELAY__TABLES__0__NAME".into(),
            path: vec!["tables".into(), "0".into(), "name".into()],
        }];
        let e = ConfigError::all(vec![
            ConfigError::new("tables[0].name", "is bad"),
            ConfigError::new("http.listen", "is bad too"),
        ])
        .unwrap_err()
        .with_sources(&overrides)
        .in_file("/etc/relay.toml".into());
        assert_eq!(
            e.to_string(),
            "/etc/relay.toml: tables[0].name: is bad (set by OUTBOX_RELAY__TABLES__0__NAME)\n\
             http.listen: is bad too"
        );
        assert_eq!(
            ConfigError::general("line 1, column 2: x").to_string(),
            "line 1, column 2: x"
        );
        assert_eq!(ConfigError::all(vec![]), Ok(()));
    }
}
