//! The MCP request bodies the server holds at once.
//!
//! A request body is at most [`super::MAX_REQUEST_BYTES`], but the MCP SDK
//! parses it into a JSON value tree before any tool sees it, and a tree
//! takes up to about 16 times its text (12 MiB of `["","",...]` is ~190 MiB
//! of `serde_json::Value`, measured with serde_json 1.0.154). With hundreds
//! of connections that is more memory than the host has, before a single
//! argument is checked. So every `POST /mcp` first takes its declared
//! length (`Content-Length`; the largest allowed without one) from a
//! budget of [`MAX_INFLIGHT_BODY_BYTES`] and keeps it until its response
//! ends (the SSE stream of a tool call ends with its result, while its
//! arguments are alive). A request that cannot get its share within
//! [`BUDGET_WAIT`] is answered `503 Service Unavailable` with
//! `Retry-After` (RFC 9110 §15.6.4, §10.2.3); nothing of it is read.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt as _;
use tokio::sync::Semaphore;

use super::MAX_REQUEST_BYTES;

/// Request bytes held at once by all `POST /mcp` requests together: 64 MiB
/// (five largest requests; about 1 GiB of parsed JSON at worst).
pub const MAX_INFLIGHT_BODY_BYTES: usize = 64 << 20;
/// The budget's unit (bytes): a permit is 1 KiB.
const UNIT: usize = 1 << 10;
/// Longest a request waits for its share of the budget.
pub const BUDGET_WAIT: Duration = Duration::from_secs(30);

/// The budget, shared by every connection.
#[derive(Clone)]
pub struct BodyBudget {
    units: Arc<Semaphore>,
    /// Longest a request waits for its share ([`BUDGET_WAIT`]).
    wait: Duration,
}

impl BodyBudget {
    /// A budget of `bytes` (at least one largest request), for which a
    /// request waits at most `wait`.
    pub fn new(bytes: usize, wait: Duration) -> Self {
        BodyBudget { units: Arc::new(Semaphore::new(bytes.max(MAX_REQUEST_BYTES).div_ceil(UNIT))), wait }
    }

    /// Bytes of the budget free now.
    #[cfg(test)]
    pub fn available(&self) -> usize {
        self.units.available_permits() * UNIT
    }
}

/// The middleware: a `POST` takes its declared length from the budget
/// (its body is not read before) and gives it back when its response body
/// ends or is dropped; other methods pass.
pub async fn hold(State(budget): State<BodyBudget>, req: Request, next: Next) -> Response {
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
    let bytes = declared.unwrap_or(MAX_REQUEST_BYTES as u64).min(MAX_REQUEST_BYTES as u64) as usize;
    let units = bytes.div_ceil(UNIT).max(1) as u32;
    let permit = match tokio::time::timeout(budget.wait, budget.units.clone().acquire_many_owned(units)).await {
        Ok(Ok(p)) => p,
        _ => {
            tracing::warn!(bytes, "a request waited {:?} for the request-body budget; answered 503", budget.wait);
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::RETRY_AFTER, "1")],
                "the server holds too many large requests at once; try again in a moment\n",
            )
                .into_response();
        }
    };
    let (parts, body) = next.run(req).await.into_parts();
    // The permit lives in the body: it goes back when the body ends.
    let body = body.map_frame(move |frame| {
        let _held = &permit;
        frame
    });
    Response::from_parts(parts, Body::new(body))
}

#[cfg(test)]
mod tests {
    use axum::routing::post;
    use axum::Router;
    use tower::ServiceExt as _;

    use super::*;

    fn app(budget: &BodyBudget) -> Router {
        Router::new()
            .route("/mcp", post(|body: String| async move { body.len().to_string() }))
            .layer(axum::middleware::from_fn_with_state(budget.clone(), hold))
    }

    fn post_of(len: usize) -> Request {
        Request::post("/mcp").header(header::CONTENT_LENGTH, len).body(Body::from(vec![b'x'; len])).unwrap()
    }

    #[tokio::test]
    async fn a_request_holds_its_length_until_its_response_body_ends() {
        let budget = BodyBudget::new(MAX_REQUEST_BYTES, BUDGET_WAIT);
        let full = budget.available();
        let resp = app(&budget).oneshot(post_of(100 << 10)).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(budget.available(), full - (100 << 10), "held while the response is unread");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"102400");
        assert_eq!(budget.available(), full, "given back when the body ended");
    }

    #[tokio::test]
    async fn a_request_that_does_not_fit_waits_then_gets_503() {
        let budget = BodyBudget::new(MAX_REQUEST_BYTES, Duration::from_millis(50));
        let held = app(&budget).oneshot(post_of(MAX_REQUEST_BYTES)).await.unwrap();
        // No room for even a small one while the largest is held.
        let resp = app(&budget).oneshot(post_of(10)).await.unwrap();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
        drop(held);
        let resp = app(&budget).oneshot(post_of(10)).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        // A GET takes nothing.
        let _held = app(&budget).oneshot(post_of(MAX_REQUEST_BYTES)).await.unwrap();
        let get = Request::get("/mcp").body(Body::empty()).unwrap();
        assert_eq!(app(&budget).oneshot(get).await.unwrap().status(), StatusCode::METHOD_NOT_ALLOWED);
    }
}
