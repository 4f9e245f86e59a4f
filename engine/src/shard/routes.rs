//! THE route table of a shard's two listeners: (plane, method, path) to the handler, each
//! handed only the services it uses (its `...Deps`). Also what every answer shares: the
//! `x-request-id`, the `traceparent`, keep-alive or close, no body for HEAD, and on a health
//! probe's connection (admin plane beyond its budget) only the probes.
//!
//! Not here: the connection loop (`conn.rs`), the handlers.

use bytes::BytesMut;

use super::admin::{self, deps::AdminDeps};
use super::orders::{self, OrderDeps};
use super::query::{self, QueryDeps};
use super::request::{Plane, RequestCtx};
use super::state::Shard;
use super::submit::{self, SubmitDeps};
use crate::http::{write_response, Connection, Method, Request, ResponseHead, Status};

/// Writes the answer into `out`; returns whether the connection stays open.
pub async fn route(
    shard: &Shard,
    request: &Request<'_>,
    ctx: &RequestCtx,
    out: &mut BytesMut,
) -> bool {
    let keep = request.keep_alive && !(shard.is_draining() && ctx.plane == Plane::Public);
    let request_id_owned;
    let request_id = match request.x_request_id {
        Some(id) if !id.is_empty() && id.len() <= 128 => id,
        _ => {
            request_id_owned = shard.next_request_id();
            request_id_owned.as_str()
        }
    };
    let mut head = ResponseHead::new(Status::Ok, request_id);
    head.traceparent = request.traceparent;
    head.connection = if keep { Connection::for_request(request) } else { Connection::Close };
    // Chunked bodies (rare in this API) are decoded into a buffer of their own; a
    // Content-Length body is a slice of the input buffer and `chunked` stays unallocated.
    let mut chunked = Vec::new();
    let body = request.body.bytes(&mut chunked);
    if request.method == Method::Head {
        // No route answers HEAD, and a HEAD response must not carry a body.
        head.status = Status::MethodNotAllowed;
        write_response(out, &head, b"");
        return keep && head.connection != Connection::Close;
    }
    if ctx.probe_only {
        // One answer, then close: the probe slot is back for the next probe at once.
        head.connection = Connection::Close;
        if !admin::is_public_health(request) {
            head.status = Status::ServiceUnavailable;
            write_response(out, &head, br#"{"state":"SYSTEM_BUSY","reason_code":"ADMIN_BUSY"}"#);
            return false;
        }
    }
    match ctx.plane {
        Plane::Public => route_public(shard, request, body, ctx, &mut head, out).await,
        Plane::Admin => {
            admin::handle(&AdminDeps::of(shard), request, body, ctx, &mut head, out).await
        }
    }
    keep && head.connection != Connection::Close
}

async fn route_public(
    shard: &Shard,
    request: &Request<'_>,
    body: &[u8],
    ctx: &RequestCtx,
    head: &mut ResponseHead<'_>,
    out: &mut BytesMut,
) {
    let health_path = shard.config().health_path.as_deref();
    match (request.method, request.path) {
        (Method::Get, path) if Some(path) == health_path => {
            let ready = shard.shared.is_ready();
            head.status = if ready { Status::Ok } else { Status::ServiceUnavailable };
            let body: &[u8] = if ready { br#"{"ready":true}"# } else { br#"{"ready":false}"# };
            write_response(out, head, body);
        }
        (Method::Post, "/v1/reservations") => {
            submit::handle_submit(&SubmitDeps::of(shard), request, body, ctx, head, out).await
        }
        (Method::Get, path) if path.starts_with("/v1/reservations/") => {
            let id = &path["/v1/reservations/".len()..];
            query::handle_query(&QueryDeps::of(shard), request, ctx, id, head, out).await
        }
        (_, path) if path.starts_with(orders::ORDERS_PREFIX) => {
            let rest = &path[orders::ORDERS_PREFIX.len()..];
            orders::handle_order(&OrderDeps::of(shard), request, ctx, rest, head, out).await
        }
        (Method::Post, orders::CALLBACK_PATH) => {
            orders::handle_callback(&OrderDeps::of(shard), body, ctx, head, out).await
        }
        (_, "/v1/reservations") => {
            head.status = Status::MethodNotAllowed;
            write_response(out, head, br#"{"state":"INVALID","reason_code":"METHOD"}"#);
        }
        _ => {
            head.status = Status::NotFound;
            write_response(out, head, br#"{"state":"INVALID","reason_code":"NO_SUCH_ROUTE"}"#);
        }
    }
}
