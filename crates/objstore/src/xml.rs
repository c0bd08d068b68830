//! Just enough XML for S3's answers: the text of named elements, in order. S3's listing,
//! multipart and error documents are flat and regular; this reads nothing else.

/// The text of every `<tag>…</tag>` in `doc` at any depth, entity-decoded, in order.
pub fn all(doc: &str, tag: &str) -> Vec<String> {
    sections(doc, tag).into_iter().map(decode).collect()
}

/// The text of the first `<tag>…</tag>` in `doc`.
pub fn first(doc: &str, tag: &str) -> Option<String> {
    sections(doc, tag).into_iter().next().map(decode)
}

/// The raw inner text of every `<tag>…</tag>` (also matching `<tag attr="…">`).
pub fn sections<'a>(doc: &'a str, tag: &str) -> Vec<&'a str> {
    let open = format!("<{tag}");
    let close = format!("</{tag}>");
    let mut out = Vec::new();
    let mut rest = doc;
    while let Some(i) = rest.find(&open) {
        let after = &rest[i + open.len()..];
        // `<Key>` must not match `<KeyCount>`.
        let Some(end_of_open) = after.find('>') else {
            break;
        };
        let attrs = &after[..end_of_open];
        if !(attrs.is_empty() || attrs.starts_with(' ') || attrs == "/") {
            rest = after;
            continue;
        }
        if attrs.ends_with('/') {
            out.push("");
            rest = &after[end_of_open + 1..];
            continue;
        }
        let body = &after[end_of_open + 1..];
        let Some(j) = body.find(&close) else {
            break;
        };
        out.push(&body[..j]);
        rest = &body[j + close.len()..];
    }
    out
}

fn decode(s: &str) -> String {
    if !s.contains('&') {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        let Some(semi) = tail.find(';').filter(|&n| n <= 10) else {
            out.push('&');
            rest = &tail[1..];
            continue;
        };
        let ent = &tail[1..semi];
        let ch = match ent {
            "amp" => Some('&'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "quot" => Some('"'),
            "apos" => Some('\''),
            _ => ent
                .strip_prefix("#x")
                .and_then(|h| u32::from_str_radix(h, 16).ok())
                .or_else(|| ent.strip_prefix('#').and_then(|d| d.parse().ok()))
                .and_then(char::from_u32),
        };
        match ch {
            Some(c) => {
                out.push(c);
                rest = &tail[semi + 1..];
            }
            None => {
                out.push('&');
                rest = &tail[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// `s` escaped for element text.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_are_found_by_exact_name_and_decoded() {
        let doc = r#"<?xml version="1.0"?><ListBucketResult xmlns="x"><KeyCount>2</KeyCount>
            <Contents><Key>a&amp;b</Key><Size>3</Size></Contents>
            <Contents><Key>c&#x2F;d</Key><Size>4</Size></Contents><Empty/></ListBucketResult>"#;
        assert_eq!(all(doc, "Key"), vec!["a&b", "c/d"]);
        assert_eq!(first(doc, "KeyCount").as_deref(), Some("2"));
        assert_eq!(sections(doc, "Contents").len(), 2);
        assert_eq!(first(doc, "Empty").as_deref(), Some(""));
        assert_eq!(first(doc, "Missing"), None);
    }

    #[test]
    fn broken_documents_end_the_scan_without_panicking() {
        assert!(all("<Key>unterminated", "Key").is_empty());
        assert!(all("<Key", "Key").is_empty());
        assert_eq!(
            all("<Key>a &bogus; &amp</Key>", "Key"),
            vec!["a &bogus; &amp"]
        );
    }
}
