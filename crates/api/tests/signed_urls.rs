//! A signed `/files` URL that names no sandbox finds its signer through the api's in-memory
//! index, kept by the same commits as the routes: a create adds the sandbox, a pause keeps
//! it, a kill removes it (`control/signers.rs`).

// The shared harness unwraps its own setup.
#![allow(clippy::unwrap_used)]

mod common;

use base64::Engine;
use common::harness;
use sha2::{Digest, Sha256};
use vmon_api::ProxyRoutes;
use vmon_proxy::signed::SignedFiles;
use vmon_proxy::Routes;

fn signed_by(token: &str) -> SignedFiles {
    let raw = format!("/home/user/a.txt:read:user:{token}");
    let sig =
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(raw.as_bytes()));
    let q = format!("v1_{sig}").replace('+', "%2B").replace('/', "%2F");
    let uri: axum::http::Uri =
        format!("/files?path=%2Fhome%2Fuser%2Fa.txt&username=user&signature={q}")
            .parse()
            .unwrap();
    SignedFiles::parse(&axum::http::Method::GET, &uri).unwrap()
}

#[tokio::test]
async fn the_index_follows_creates_pauses_and_kills() {
    let h = harness(Default::default()).await;
    let routes = ProxyRoutes(h.control.clone());
    let one = h.create(r#"{"templateID":"base"}"#).await;
    let two = h.create(r#"{"templateID":"base"}"#).await;
    let token = |id: &str| {
        let id = id.to_string();
        let h = &h;
        async move {
            let r = h.req("GET", &format!("/sandboxes/{id}"), None).await;
            r.json["envdAccessToken"].as_str().unwrap().to_string()
        }
    };
    let (t1, t2) = (token(&one).await, token(&two).await);
    assert_eq!(routes.find_signer(&signed_by(&t1)).await, Some(one.clone()));
    assert_eq!(routes.find_signer(&signed_by(&t2)).await, Some(two.clone()));
    assert_eq!(routes.find_signer(&signed_by("made-up")).await, None);

    let r = h
        .req("POST", &format!("/sandboxes/{two}/pause"), None)
        .await;
    assert!(r.status.is_success(), "{:?}", r.json);
    assert_eq!(routes.find_signer(&signed_by(&t2)).await, Some(two.clone()));

    let r = h.req("DELETE", &format!("/sandboxes/{one}"), None).await;
    assert!(r.status.is_success(), "{:?}", r.json);
    assert_eq!(
        routes.find_signer(&signed_by(&t1)).await,
        None,
        "a killed sandbox signs nothing"
    );
    assert_eq!(routes.find_signer(&signed_by(&t2)).await, Some(two));
}
