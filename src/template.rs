//! The routing-key template: literal text with `{tenant}`, `{kind}` and
//! `{subject}` placeholders, parsed once at start so a bad template is a
//! configuration error, never a per-message surprise.

use std::fmt;

/// A placeholder that a routing-key template may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Tenant,
    Kind,
    Subject,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    Field(Field),
}

/// A parsed routing-key template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingKey {
    source: String,
    parts: Vec<Part>,
}

/// Why a template was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("unknown placeholder {{{0}}}; known: {{tenant}}, {{kind}}, {{subject}}")]
    UnknownPlaceholder(String),
    #[error("unclosed '{{' at byte {0}")]
    Unclosed(usize),
    #[error("unmatched '}}' at byte {0}")]
    Unmatched(usize),
}

impl RoutingKey {
    pub fn parse(template: &str) -> Result<RoutingKey, TemplateError> {
        let mut parts = Vec::new();
        let mut text = String::new();
        let mut rest = template.char_indices().peekable();
        while let Some((at, c)) = rest.next() {
            match c {
                '{' => {
                    let mut name = String::new();
                    loop {
                        match rest.next() {
                            Some((_, '}')) => break,
                            Some((_, c)) => name.push(c),
                            None => return Err(TemplateError::Unclosed(at)),
                        }
                    }
                    let field = match name.as_str() {
                        "tenant" => Field::Tenant,
                        "kind" => Field::Kind,
                        "subject" => Field::Subject,
                        _ => return Err(TemplateError::UnknownPlaceholder(name)),
                    };
                    if !text.is_empty() {
                        parts.push(Part::Text(std::mem::take(&mut text)));
                    }
                    parts.push(Part::Field(field));
                }
                '}' => return Err(TemplateError::Unmatched(at)),
                c => text.push(c),
            }
        }
        if !text.is_empty() {
            parts.push(Part::Text(text));
        }
        Ok(RoutingKey {
            source: template.to_string(),
            parts,
        })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// The routing key of one message.
    pub fn render(&self, tenant: &str, kind: &str, subject: &str) -> String {
        let mut key = String::with_capacity(self.source.len() + tenant.len() + kind.len());
        for part in &self.parts {
            key.push_str(match part {
                Part::Text(text) => text,
                Part::Field(Field::Tenant) => tenant,
                Part::Field(Field::Kind) => kind,
                Part::Field(Field::Subject) => subject,
            });
        }
        key
    }
}

impl std::str::FromStr for RoutingKey {
    type Err = TemplateError;

    fn from_str(template: &str) -> Result<RoutingKey, TemplateError> {
        RoutingKey::parse(template)
    }
}

impl fmt::Display for RoutingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_placeholder() {
        let key = RoutingKey::parse("outbox.{tenant}.{kind}.{subject}").unwrap();
        assert_eq!(
            key.render("acme", "order.created", "o-1"),
            "outbox.acme.order.created.o-1"
        );
        assert_eq!(key.as_str(), "outbox.{tenant}.{kind}.{subject}");
    }

    #[test]
    fn literal_and_empty_templates() {
        assert_eq!(
            RoutingKey::parse("fixed").unwrap().render("t", "k", "s"),
            "fixed"
        );
        assert_eq!(RoutingKey::parse("").unwrap().render("t", "k", "s"), "");
        assert_eq!(
            RoutingKey::parse("{kind}{kind}")
                .unwrap()
                .render("t", "k", "s"),
            "kk"
        );
    }

    #[test]
    fn refuses_unknown_and_unbalanced_placeholders() {
        assert_eq!(
            RoutingKey::parse("{tenant}.{type}"),
            Err(TemplateError::UnknownPlaceholder("type".into()))
        );
        assert_eq!(
            RoutingKey::parse("a.{tenant"),
            Err(TemplateError::Unclosed(2))
        );
        assert_eq!(RoutingKey::parse("a}"), Err(TemplateError::Unmatched(1)));
        assert_eq!(
            RoutingKey::parse("{}"),
            Err(TemplateError::UnknownPlaceholder(String::new()))
        );
        let message = TemplateError::UnknownPlaceholder("x".into()).to_string();
        assert_eq!(
            message,
            "unknown placeholder {x}; known: {tenant}, {kind}, {subject}"
        );
    }
}
