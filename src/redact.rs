//! Printing connection strings without their secrets.

/// What a password is replaced with.
pub const MASK: &str = "***";

/// `url` with any password replaced by `***`: URL form (`scheme://user:pw@host`)
/// and PostgreSQL key-value form (`host=db password=pw`). Anything that is not
/// recognisably one of those is returned with everything after the scheme
/// separator's userinfo masked, so a malformed URL never leaks a secret.
pub fn redact_url(url: &str) -> String {
    if let Some(scheme_end) = url.find("://") {
        let rest = &url[scheme_end + 3..];
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let authority = &rest[..authority_end];
        let redacted_authority = match authority.rfind('@') {
            Some(at) => {
                let userinfo = &authority[..at];
                match userinfo.find(':') {
                    Some(colon) => format!("{}:{MASK}{}", &userinfo[..colon], &authority[at..]),
                    None => authority.to_string(),
                }
            }
            None => authority.to_string(),
        };
        let tail = redact_query(&rest[authority_end..]);
        return format!("{}://{redacted_authority}{tail}", &url[..scheme_end]);
    }
    if url.contains('=') {
        return url
            .split_whitespace()
            .map(|pair| match pair.split_once('=') {
                Some((key, _)) if is_secret(key) => format!("{key}={MASK}"),
                _ => pair.to_string(),
            })
            .collect::<Vec<_>>()
            .join(" ");
    }
    url.to_string()
}

fn is_secret(key: &str) -> bool {
    matches!(
        key.to_ascii_lowercase().as_str(),
        "password" | "sslpassword" | "pass"
    )
}

/// Masks `password=` style parameters in a query string.
fn redact_query(tail: &str) -> String {
    let Some(q) = tail.find('?') else {
        return tail.to_string();
    };
    let (path, query) = tail.split_at(q + 1);
    let query = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((key, _)) if is_secret(key) => format!("{key}={MASK}"),
            _ => pair.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&");
    format!("{path}{query}")
}

/// An HTTP endpoint as shown (the OTLP collector's): its password and every
/// query value masked, as a collector's token may ride in the query. A value
/// with no `scheme://` is not shown at all: which part of it is a password
/// cannot be told (`user:secret@host:4318` reads as the scheme `user`).
pub fn redact_endpoint(url: &str) -> String {
    if !url.contains("://") {
        return "(the value is not shown)".to_string();
    }
    let shown = redact_url(url);
    let Some((base, query)) = shown.split_once('?') else {
        return shown;
    };
    let query = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((key, _)) => format!("{key}={MASK}"),
            None => pair.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&");
    format!("{base}?{query}")
}

/// `text` with every URL in it shown as [`redact_endpoint`] shows one:
/// its password and query values masked (the exporter's errors name the
/// collector's URL).
pub fn redact_urls_in(text: &str) -> String {
    let mut redacted = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(|c: char| !is_url_boundary(c)) {
        redacted.push_str(&rest[..start]);
        rest = &rest[start..];
        let end = rest.find(is_url_boundary).unwrap_or(rest.len());
        let word = &rest[..end];
        if word.contains("://") {
            redacted.push_str(&redact_endpoint(word));
        } else {
            redacted.push_str(word);
        }
        rest = &rest[end..];
    }
    redacted.push_str(rest);
    redacted
}

/// Where a URL in free text ends: white space, brackets, quotes, a comma.
fn is_url_boundary(c: char) -> bool {
    c.is_whitespace() || matches!(c, '(' | ')' | '"' | '\'' | '<' | '>' | ',')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_the_password_of_a_url() {
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_url("postgres://app:p%40ss:w@db.example:5432/app?sslmode=require"),
            "postgres://app:***@db.example:5432/app?sslmode=require"
        );
    }

    #[test]
    fn leaves_urls_without_a_password_alone() {
        assert_eq!(
            redact_url("postgres://postgres@127.0.0.1:5432/postgres"),
            "postgres://postgres@127.0.0.1:5432/postgres"
        );
        assert_eq!(redact_url("amqp://mq/%2f"), "amqp://mq/%2f");
    }

    #[test]
    fn masks_passwords_in_query_and_key_value_forms() {
        assert_eq!(
            redact_url("postgres://db/app?user=a&password=x&sslmode=require"),
            "postgres://db/app?user=a&password=***&sslmode=require"
        );
        assert_eq!(
            redact_url("host=db user=app password=secret dbname=app"),
            "host=db user=app password=*** dbname=app"
        );
    }

    #[test]
    fn an_at_sign_in_the_password_does_not_leak_it() {
        let redacted = redact_url("amqp://u:p@ss@host/%2f");
        assert!(!redacted.contains("p@ss"), "{redacted}");
    }

    #[test]
    fn urls_in_an_error_lose_their_password() {
        let error =
            "error sending request for url (http://otel:s3cret@collector:4318/v1/traces): refused";
        let redacted = redact_urls_in(error);
        assert!(!redacted.contains("s3cret"), "{redacted}");
        assert_eq!(
            redacted,
            "error sending request for url (http://otel:***@collector:4318/v1/traces): refused"
        );
        assert_eq!(redact_urls_in("timed out after 10s"), "timed out after 10s");
        assert_eq!(
            redact_urls_in("for url (http://collector:4318/v1/traces?token=s3cret&x)"),
            "for url (http://collector:4318/v1/traces?token=***&x)"
        );
    }

    #[test]
    fn an_endpoint_shows_no_query_value_and_nothing_without_a_scheme() {
        assert_eq!(
            redact_endpoint("http://u:pw@collector:4318/x?token=t&flag"),
            "http://u:***@collector:4318/x?token=***&flag"
        );
        assert_eq!(
            redact_endpoint("u:pw@collector:4318"),
            "(the value is not shown)"
        );
    }
}
