//! S3's error documents (`<Error><Code>…</Code><Message>…</Message></Error>`), parsed with
//! instant-xml, the parser rusty-s3 reads listings and multipart answers with.

use instant_xml::FromXml;

#[derive(Debug, Default, FromXml)]
#[xml(rename = "Error")]
struct ErrorDoc {
    #[xml(rename = "Code")]
    code: Option<String>,
    #[xml(rename = "Message")]
    message: Option<String>,
}

/// The code and message of an error document; `None` when `doc` is not one.
pub fn error(doc: &str) -> Option<(String, String)> {
    let d: ErrorDoc = instant_xml::from_str(doc.trim_start_matches('\u{feff}')).ok()?;
    Some((d.code.unwrap_or_default(), d.message.unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_documents_give_their_code_and_decoded_message() {
        let doc = r#"<?xml version="1.0" encoding="UTF-8"?>
            <Error><Code>NoSuchBucket</Code><Message>a &amp; b</Message>
            <Resource>/x</Resource><RequestId>1</RequestId></Error>"#;
        assert_eq!(error(doc), Some(("NoSuchBucket".into(), "a & b".into())));
    }

    #[test]
    fn other_and_broken_documents_are_not_errors() {
        assert_eq!(error("<CompleteMultipartUploadResult/>"), None);
        assert_eq!(error("<Error><Code>x</Error>"), None);
        assert_eq!(error(""), None);
        assert_eq!(error("not xml"), None);
    }
}
