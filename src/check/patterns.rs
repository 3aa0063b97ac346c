//! `check` and the `[[tables]]` entries that name a pattern: which tables each matches now
//! (each then checked as a table of its own), a warning for a pattern that matches none
//! yet, and a failure for a table matched by two entries.

use tokio_postgres::GenericClient;

use super::{Level, Report};
use crate::config::Config;
use crate::source::discover;

/// `config` with the tables its patterns match now, and a line per pattern saying which.
pub(super) async fn resolve(
    client: &impl GenericClient,
    config: &Config,
    out: &mut Report,
) -> Config {
    if config.patterns.is_empty() {
        return config.clone();
    }
    let found = match discover::matching(client, &config.patterns).await {
        Ok(found) => found,
        Err(e) => {
            out.push(Level::Fail, "tables by pattern", e.to_string());
            return config.clone();
        }
    };
    let (resolved, ambiguous) = discover::expand(config, found);
    for entry in &config.patterns {
        let pattern = entry.pattern.as_ref().expect("pattern entries only");
        let subject = format!("tables[{}] {pattern}", entry.entry);
        let names: Vec<String> = (resolved.tables.iter())
            .filter(|t| t.pattern.is_some() && t.entry == entry.entry)
            .map(|t| t.name.to_string())
            .collect();
        match names.len() {
            0 => out.push(
                Level::Warn,
                subject,
                "matches no table yet: a running relay picks up a matching table within \
                 seconds of its creation",
            ),
            n => out.push(
                Level::Ok,
                subject,
                format!("matches {n}: {}", names.join(", ")),
            ),
        }
    }
    for (_, problem) in ambiguous {
        out.push(Level::Fail, "tables by pattern", problem);
    }
    resolved
}
