//! The message templates: the routing key (literal text with `{tenant}`,
//! `{kind}` and `{subject}` placeholders) and the `message_id` (`{id}`,
//! `{schema}`, `{table}`), each parsed once at start so a bad template is a
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
enum Part<F> {
    Text(String),
    Field(F),
}

/// A parsed routing-key template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingKey {
    source: String,
    parts: Vec<Part<Field>>,
}

/// Why a template was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("unknown placeholder {{{name}}}; known: {known}")]
    UnknownPlaceholder { name: String, known: &'static str },
    #[error("unclosed '{{' at byte {0}")]
    Unclosed(usize),
    #[error("unmatched '}}' at byte {0}")]
    Unmatched(usize),
    #[error(
        "has no {{id}}: every row's message_id would be the same, and a consumer that deduplicates on it would keep only the first"
    )]
    NoId,
}

/// Splits `template` into text and the placeholders `field` knows; `known`
/// lists them for the error.
fn parse_parts<F>(
    template: &str,
    known: &'static str,
    field: impl Fn(&str) -> Option<F>,
) -> Result<Vec<Part<F>>, TemplateError> {
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
                let Some(field) = field(&name) else {
                    return Err(TemplateError::UnknownPlaceholder { name, known });
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
    Ok(parts)
}

impl RoutingKey {
    pub fn parse(template: &str) -> Result<RoutingKey, TemplateError> {
        let parts = parse_parts(template, "{tenant}, {kind}, {subject}", |name| match name {
            "tenant" => Some(Field::Tenant),
            "kind" => Some(Field::Kind),
            "subject" => Some(Field::Subject),
            _ => None,
        })?;
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

/// A placeholder that a `message_id` template may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdField {
    Id,
    Schema,
    Table,
}

/// The longest decimal `id` (`-9223372036854775808`).
const LONGEST_ID: usize = 20;

/// A parsed `message_id` template: `{id}`, `{schema}` and `{table}`, so that
/// ids stay unique across tables and restored databases for consumers that
/// deduplicate on `message_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageIdTemplate {
    source: String,
    parts: Vec<Part<IdField>>,
}

impl MessageIdTemplate {
    pub fn parse(template: &str) -> Result<MessageIdTemplate, TemplateError> {
        let parts = parse_parts(template, "{id}, {schema}, {table}", |name| match name {
            "id" => Some(IdField::Id),
            "schema" => Some(IdField::Schema),
            "table" => Some(IdField::Table),
            _ => None,
        })?;
        if !parts
            .iter()
            .any(|part| matches!(part, Part::Field(IdField::Id)))
        {
            return Err(TemplateError::NoId);
        }
        Ok(MessageIdTemplate {
            source: template.to_string(),
            parts,
        })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// The template for one table: `{schema}` and `{table}` filled in, only
    /// `{id}` left. Refused when some id would make a `message_id` over
    /// AMQP's 255 bytes.
    pub fn bind(&self, schema: &str, table: &str) -> Result<MessageId, String> {
        let mut parts = Vec::new();
        let mut text = String::new();
        for part in &self.parts {
            match part {
                Part::Text(literal) => text.push_str(literal),
                Part::Field(IdField::Schema) => text.push_str(schema),
                Part::Field(IdField::Table) => text.push_str(table),
                Part::Field(IdField::Id) => {
                    if !text.is_empty() {
                        parts.push(Part::Text(std::mem::take(&mut text)));
                    }
                    parts.push(Part::Field(()));
                }
            }
        }
        if !text.is_empty() {
            parts.push(Part::Text(text));
        }
        let id = MessageId { parts };
        let longest = id.longest();
        if longest > 255 {
            return Err(format!(
                "makes message_ids of up to {longest} bytes for schema {:?} and table {:?}; AMQP allows 255",
                truncate(schema),
                truncate(table)
            ));
        }
        Ok(id)
    }
}

fn truncate(name: &str) -> String {
    name.chars().take(64).collect()
}

impl std::str::FromStr for MessageIdTemplate {
    type Err = TemplateError;

    fn from_str(template: &str) -> Result<MessageIdTemplate, TemplateError> {
        MessageIdTemplate::parse(template)
    }
}

impl fmt::Display for MessageIdTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

/// The `message_id` of one table's rows: text and `{id}` (see
/// [`MessageIdTemplate::bind`]); at most 255 bytes for any id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageId {
    parts: Vec<Part<()>>,
}

impl MessageId {
    /// The id alone (`{id}`, the default).
    pub fn plain() -> MessageId {
        MessageId {
            parts: vec![Part::Field(())],
        }
    }

    /// The `message_id` of row `id`.
    pub fn render(&self, id: i64) -> String {
        use std::fmt::Write as _;
        let mut rendered = String::with_capacity(self.longest());
        for part in &self.parts {
            match part {
                Part::Text(text) => rendered.push_str(text),
                Part::Field(()) => {
                    let _ = write!(rendered, "{id}");
                }
            }
        }
        rendered
    }

    /// The length of the longest `message_id` this makes.
    fn longest(&self) -> usize {
        self.parts
            .iter()
            .map(|part| match part {
                Part::Text(text) => text.len(),
                Part::Field(()) => LONGEST_ID,
            })
            .sum()
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
            Err(TemplateError::UnknownPlaceholder {
                name: "type".into(),
                known: "{tenant}, {kind}, {subject}"
            })
        );
        assert_eq!(
            RoutingKey::parse("a.{tenant"),
            Err(TemplateError::Unclosed(2))
        );
        assert_eq!(RoutingKey::parse("a}"), Err(TemplateError::Unmatched(1)));
        assert!(matches!(
            RoutingKey::parse("{}"),
            Err(TemplateError::UnknownPlaceholder { name, .. }) if name.is_empty()
        ));
        let message = RoutingKey::parse("{x}").unwrap_err().to_string();
        assert_eq!(
            message,
            "unknown placeholder {x}; known: {tenant}, {kind}, {subject}"
        );
    }

    #[test]
    fn message_ids_render_schema_table_and_id() {
        let template = MessageIdTemplate::parse("{schema}.{table}:{id}").unwrap();
        let id = template.bind("sales", "outbox_message").unwrap();
        assert_eq!(id.render(42), "sales.outbox_message:42");
        assert_eq!(
            id.render(i64::MIN),
            "sales.outbox_message:-9223372036854775808"
        );
        let plain = MessageIdTemplate::parse("{id}").unwrap();
        assert_eq!(plain.bind("s", "t").unwrap(), MessageId::plain());
        assert_eq!(MessageId::plain().render(-7), "-7");
        assert_eq!(
            MessageIdTemplate::parse("x-{id}-{id}")
                .unwrap()
                .bind("s", "t")
                .unwrap()
                .render(1),
            "x-1-1"
        );
    }

    #[test]
    fn message_id_templates_refuse_other_placeholders_and_overlong_ids() {
        let message = MessageIdTemplate::parse("{tenant}:{id}")
            .unwrap_err()
            .to_string();
        assert_eq!(
            message,
            "unknown placeholder {tenant}; known: {id}, {schema}, {table}"
        );
        assert_eq!(
            MessageIdTemplate::parse("{id"),
            Err(TemplateError::Unclosed(0))
        );
        assert_eq!(
            MessageIdTemplate::parse("id}"),
            Err(TemplateError::Unmatched(2))
        );
        for no_id in ["", "constant", "{schema}.{table}"] {
            assert_eq!(
                MessageIdTemplate::parse(no_id),
                Err(TemplateError::NoId),
                "{no_id:?}"
            );
        }
        // 235 bytes of table name and 20 of the longest id fit; one more does not.
        let template = MessageIdTemplate::parse("{table}{id}").unwrap();
        assert!(template.bind("s", &"t".repeat(235)).is_ok());
        let error = template.bind("s", &"t".repeat(236)).unwrap_err();
        assert!(error.contains("up to 256 bytes"), "{error}");
    }
}
