//! `envelope = "cloudevents"` and `[tables.cloudevents]`: how a row becomes a CloudEvents
//! 1.0 event. Checked here once; `relay::envelope` fills the attributes per row.

use std::sync::Arc;

use super::raw::RawCloudEvents;
use super::{ConfigError, Ident, SinkTarget, Template};

/// How the event travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CeMode {
    /// Attributes as headers (Kafka `ce_*`, NATS `ce-*`), the body the payload untouched.
    Binary,
    /// The body is the JSON event format (`application/cloudevents+json`).
    Structured,
}

/// A table's CloudEvents envelope, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CloudEvents {
    pub(crate) mode: CeMode,
    /// The binding's header prefix for attributes in binary mode: `ce_` on Kafka (and
    /// stdout), `ce-` on NATS.
    pub(crate) prefix: &'static str,
    pub(crate) type_: Template,
    pub(crate) source: Template,
    pub(crate) subject: Option<Template>,
    pub(crate) datacontenttype: Option<Template>,
    /// `type`, `source`, `subject`, `datacontenttype` header names with `prefix`, made once.
    pub(crate) header_names: Arc<HeaderNames>,
}

/// Binary mode's header names, shared by every message of the table.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct HeaderNames {
    pub(crate) specversion: Arc<str>,
    pub(crate) id: Arc<str>,
    pub(crate) source: Arc<str>,
    pub(crate) type_: Arc<str>,
    pub(crate) time: Arc<str>,
    pub(crate) subject: Arc<str>,
    pub(crate) traceparent: Arc<str>,
    /// `content-type`, the binding's own header (no prefix): `datacontenttype` in binary
    /// mode, the event format's media type in structured mode.
    pub(crate) content_type: Arc<str>,
}

impl CloudEvents {
    /// The templates in the order their columns are read: type, source, subject,
    /// datacontenttype (absent ones left out).
    pub(crate) fn templates(&self) -> impl Iterator<Item = &Template> {
        [Some(&self.type_), Some(&self.source)]
            .into_iter()
            .chain([self.subject.as_ref(), self.datacontenttype.as_ref()])
            .flatten()
    }

    /// Every column the templates read, in [`CloudEvents::templates`] order.
    pub(crate) fn columns(&self) -> impl Iterator<Item = &Ident> {
        self.templates().flat_map(|t| t.columns())
    }
}

/// The binding's header prefix on `sink`.
fn prefix(sink: &SinkTarget) -> &'static str {
    match sink {
        SinkTarget::Nats(_) => "ce-",
        SinkTarget::Kafka(_) | SinkTarget::Stdout => "ce_",
    }
}

/// Validates `envelope` and `[tables.cloudevents]` of `tables[i]`; `at` makes the key for
/// errors. `None`: no envelope.
pub(super) fn validate(
    envelope: Option<String>,
    raw: Option<RawCloudEvents>,
    sink: &SinkTarget,
    at: &dyn Fn(&str) -> String,
) -> Result<Option<CloudEvents>, ConfigError> {
    match envelope.as_deref().unwrap_or("none") {
        "none" => match raw {
            None => Ok(None),
            Some(_) => Err(ConfigError::new(
                at("cloudevents"),
                "is set but the table's envelope is \"none\": add envelope = \"cloudevents\" \
                 to the table, or remove [tables.cloudevents]",
            )),
        },
        "cloudevents" => checked(raw.unwrap_or_default(), prefix(sink), at).map(Some),
        other => Err(ConfigError::new(
            at("envelope"),
            format!("is {other:?}; it is \"none\" (the default) or \"cloudevents\""),
        )),
    }
}

fn checked(
    raw: RawCloudEvents,
    prefix: &'static str,
    at: &dyn Fn(&str) -> String,
) -> Result<CloudEvents, ConfigError> {
    let mode = match raw.mode.as_deref().unwrap_or("binary") {
        "binary" => CeMode::Binary,
        "structured" => CeMode::Structured,
        other => {
            return Err(ConfigError::new(
                at("cloudevents.mode"),
                format!("is {other:?}; it is \"binary\" (the default) or \"structured\""),
            ))
        }
    };
    let required = |value: Option<String>, key: &str, example: &str| match value {
        None => Err(ConfigError::new(
            at(&format!("cloudevents.{key}")),
            format!(
                "is required with envelope = \"cloudevents\": a template over the row's \
                 columns or a constant, e.g. {key} = {example:?}"
            ),
        )),
        Some(text) => template(&text, key, at),
    };
    let optional =
        |value: Option<String>, key: &str| value.map(|text| template(&text, key, at)).transpose();
    let name = |attribute: &str| Arc::from(format!("{prefix}{attribute}"));
    Ok(CloudEvents {
        mode,
        prefix,
        type_: required(raw.type_, "type", "com.example.{aggregatetype}.{type}")?,
        source: required(raw.source, "source", "/orders")?,
        subject: optional(raw.subject, "subject")?,
        datacontenttype: optional(raw.datacontenttype, "datacontenttype")?,
        header_names: Arc::new(HeaderNames {
            specversion: name("specversion"),
            id: name("id"),
            source: name("source"),
            type_: name("type"),
            time: name("time"),
            subject: name("subject"),
            traceparent: name("traceparent"),
            content_type: Arc::from("content-type"),
        }),
    })
}

/// One attribute's template; blank is an error (the attribute would be empty).
fn template(text: &str, key: &str, at: &dyn Fn(&str) -> String) -> Result<Template, ConfigError> {
    let at = at(&format!("cloudevents.{key}"));
    if text.trim().is_empty() {
        return Err(ConfigError::new(
            at,
            "is empty; a CloudEvents attribute cannot be empty (leave an optional one out)",
        ));
    }
    Template::parse(text).map_err(|e| ConfigError::new(at, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(
        envelope: Option<&str>,
        raw: Option<RawCloudEvents>,
    ) -> Result<Option<CloudEvents>, String> {
        let at = |key: &str| format!("tables[0].{key}");
        validate(envelope.map(str::to_owned), raw, &SinkTarget::Stdout, &at)
            .map_err(|e| e.to_string())
    }

    fn raw(type_: Option<&str>, source: Option<&str>) -> RawCloudEvents {
        RawCloudEvents {
            type_: type_.map(str::to_owned),
            source: source.map(str::to_owned),
            ..RawCloudEvents::default()
        }
    }

    #[test]
    fn no_envelope_unless_asked_and_a_section_without_it_is_an_error() {
        assert_eq!(check(None, None), Ok(None));
        assert_eq!(check(Some("none"), None), Ok(None));
        let e = check(None, Some(raw(Some("t"), Some("s")))).unwrap_err();
        assert!(
            e.contains("tables[0].cloudevents") && e.contains("envelope = \"cloudevents\""),
            "{e}"
        );
        let e = check(Some("cloud"), None).unwrap_err();
        assert!(
            e.contains("tables[0].envelope") && e.contains("\"cloud\""),
            "{e}"
        );
    }

    #[test]
    fn type_and_source_are_required_and_never_blank() {
        let e = check(Some("cloudevents"), None).unwrap_err();
        assert!(
            e.contains("tables[0].cloudevents.type") && e.contains("required"),
            "{e}"
        );
        let e = check(Some("cloudevents"), Some(raw(Some("t"), None))).unwrap_err();
        assert!(e.contains("tables[0].cloudevents.source"), "{e}");
        let e = check(Some("cloudevents"), Some(raw(Some(" "), Some("s")))).unwrap_err();
        assert!(e.contains("cloudevents.type") && e.contains("empty"), "{e}");
        let mut bad_mode = raw(Some("t"), Some("s"));
        bad_mode.mode = Some("json".to_owned());
        let e = check(Some("cloudevents"), Some(bad_mode)).unwrap_err();
        assert!(
            e.contains("cloudevents.mode") && e.contains("structured"),
            "{e}"
        );
    }

    #[test]
    fn binary_is_the_default_mode_and_columns_come_in_template_order() {
        let mut r = raw(Some("com.x.{kind}"), Some("/{tenant}"));
        r.subject = Some("{key}".to_owned());
        let ce = check(Some("cloudevents"), Some(r)).unwrap().unwrap();
        assert_eq!(ce.mode, CeMode::Binary);
        assert_eq!(ce.prefix, "ce_");
        let columns: Vec<&str> = ce.columns().map(Ident::as_str).collect();
        assert_eq!(columns, ["kind", "tenant", "key"]);
        assert_eq!(&*ce.header_names.type_, "ce_type");
    }
}
