//! Self-keepalive: a process in the guest asks for its sandbox to live on
//! (`POST /keepalive`, `{"timeout": seconds}`, with the sandbox's envd access token when it has
//! one), and the node reads the latest ask (`GET /keepalive`) when the sandbox's timeout ends.
//! The api then extends the sandbox to the ask's end, within the team's maximum lifetime
//! (`docs/architecture.md`, "Self-keepalive"). Nothing leaves the guest: the node asks.

use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde::Deserialize;

use crate::agent::Agent;
use crate::auth;
use crate::connect::{self, json_response, Body};

/// Largest ask body read.
const MAX_BODY: usize = 1024;
/// Longest timeout one ask may name (the api caps it at the team's lifetime anyway).
pub const MAX_TIMEOUT_SECS: u64 = 30 * 24 * 3600;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Ask {
    timeout: u64,
}

fn error(code: StatusCode, message: &str) -> Response<Body> {
    json_response(
        code,
        &serde_json::json!({ "code": code.as_u16(), "message": message }),
    )
}

/// `POST /keepalive`: records an ask.
pub async fn ask(agent: &Agent, req: Request<Incoming>) -> Response<Body> {
    if !auth::token_ok(agent, req.headers()) {
        return auth::unauthorized("invalid or missing access token");
    }
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return error(StatusCode::BAD_REQUEST, "body unreadable or over 1 KiB"),
    };
    let ask: Ask = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("expected {{\"timeout\": seconds}}: {e}"),
            )
        }
    };
    if ask.timeout == 0 || ask.timeout > MAX_TIMEOUT_SECS {
        return error(
            StatusCode::BAD_REQUEST,
            &format!("timeout must be 1 to {MAX_TIMEOUT_SECS} seconds"),
        );
    }
    agent.keepalive.set(ask.timeout);
    json_response(
        StatusCode::ACCEPTED,
        &serde_json::json!({ "timeout": ask.timeout }),
    )
}

/// `GET /keepalive`: the latest ask (`{"ageMs", "timeout"}`), or 204 when there is none.
pub fn latest(agent: &Agent, req: &Request<Incoming>) -> Response<Body> {
    if !auth::token_ok(agent, req.headers()) {
        return auth::unauthorized("invalid or missing access token");
    }
    match agent.keepalive.latest() {
        Some((age_ms, timeout)) => json_response(
            StatusCode::OK,
            &serde_json::json!({ "ageMs": age_ms as u64, "timeout": timeout }),
        ),
        None => {
            let mut r = Response::new(connect::empty());
            *r.status_mut() = StatusCode::NO_CONTENT;
            r
        }
    }
}
