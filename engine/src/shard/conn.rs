//! The HTTP/1.1 connection loop of a shard: accept (bounded per shard), read with the
//! header-read deadline and the idle timeout, parse with `http::parse_request`, answer
//! pipelined requests in order into one reused output buffer, flush once per batch (at most
//! `pipeline_depth_max` answers), and close on any rejection or `Connection: close`.
//!
//! Routing is a small match on (plane, method, path); the handlers live in `submit` and
//! `admin`. Every answer goes through `http::write_response`.

use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};

use super::{admin, orders, submit, Shard};
use crate::http::{
    parse_request, write_rejection, write_response, Connection, Method, Parsed, Request,
    ResponseHead, Status,
};

/// Which listener a connection came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plane {
    Public,
    Admin,
}

/// Read size per syscall.
const READ_CHUNK_BYTES: usize = 16 * 1024;

pub async fn accept_loop(shard: Rc<Shard>, listener: TcpListener, plane: Plane) {
    let open = Rc::new(std::cell::Cell::new(0usize));
    loop {
        // Never cancel an accept (a timed-out accept can complete in the kernel and lose the
        // connection): the stop flag is checked after each accept, and `ServeHandle::stop`
        // wakes every listener with a connection of its own.
        let stream = match listener.accept().await {
            Ok(stream) => stream,
            Err(e) => {
                if shard.shared.stopping.load(Ordering::Relaxed) {
                    return;
                }
                tracing::warn!(shard = shard.id, error = %e, "accept failed");
                glommio::timer::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if shard.shared.stopping.load(Ordering::Relaxed) {
            return;
        }
        if shard.is_draining() && plane == Plane::Public {
            // Draining: stop taking traffic; the load balancer's health check sees /readyz.
            drop(stream);
            continue;
        }
        if open.get() >= shard.config().connections_per_shard_max {
            shard.metrics().connections_refused.fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        }
        let _ = stream.set_nodelay(true);
        open.set(open.get() + 1);
        shard.metrics().connections_open.fetch_add(1, Ordering::Relaxed);
        let shard = Rc::clone(&shard);
        let open = Rc::clone(&open);
        glommio::spawn_local(async move {
            serve_connection(&shard, stream, plane).await;
            open.set(open.get() - 1);
            shard.metrics().connections_open.fetch_sub(1, Ordering::Relaxed);
        })
        .detach();
    }
}

async fn serve_connection(shard: &Rc<Shard>, mut stream: TcpStream, plane: Plane) {
    let limits = shard.config().http;
    let peer_ip = stream.peer_addr().ok().map(|a| a.ip());
    let peer_is_loopback = peer_ip.is_some_and(|ip| ip.is_loopback());
    let mut inbuf = BytesMut::with_capacity(limits.request_bytes_max() + READ_CHUNK_BYTES);
    let mut out = BytesMut::with_capacity(16 * 1024);
    let mut scratch: Vec<u8> = Vec::with_capacity(limits.body_bytes_max);
    let mut chunk = vec![0u8; READ_CHUNK_BYTES];
    loop {
        // Answer every complete request already buffered, in order, up to the depth bound.
        let mut answered = 0;
        let mut close = false;
        while answered < limits.pipeline_depth_max {
            let started = Instant::now();
            match parse_request(&inbuf, &limits) {
                Parsed::Incomplete => break,
                Parsed::Reject(rejection) => {
                    shard.metrics().http_rejections.fetch_add(1, Ordering::Relaxed);
                    write_rejection(&mut out, rejection, &shard.next_request_id());
                    close = true;
                    break;
                }
                Parsed::Complete { request, consumed } => {
                    let ctx = RequestCtx { peer_ip, peer_is_loopback, plane };
                    let in_flight = &shard.metrics().requests_in_flight;
                    in_flight.fetch_add(1, Ordering::Relaxed);
                    let keep = route(shard, &request, &ctx, &mut out, &mut scratch).await;
                    in_flight.fetch_sub(1, Ordering::Relaxed);
                    shard.metrics().request_latency.observe_ns(started.elapsed().as_nanos() as u64);
                    inbuf.advance(consumed);
                    answered += 1;
                    if !keep {
                        close = true;
                        break;
                    }
                }
            }
        }
        if !out.is_empty() {
            if stream.write_all(&out).await.is_err() {
                return;
            }
            out.clear();
        }
        if close {
            let _ = stream.close().await;
            return;
        }
        if answered == limits.pipeline_depth_max {
            continue; // more may be buffered: answer them before reading
        }
        // A partial request must complete within the header deadline; an idle connection
        // waits for the idle timeout.
        let wait_ms = if inbuf.is_empty() {
            shard.config().idle_timeout_ms
        } else {
            shard.config().header_read_timeout_ms
        };
        let read = glommio::timer::timeout(Duration::from_millis(wait_ms), async {
            Ok(stream.read(&mut chunk).await)
        })
        .await;
        match read {
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Ok(Ok(n)) => inbuf.extend_from_slice(&chunk[..n]),
            Err(_) => {
                if !inbuf.is_empty() {
                    let request_id = shard.next_request_id();
                    let head = ResponseHead {
                        connection: Connection::Close,
                        ..ResponseHead::new(Status::RequestTimeout, &request_id)
                    };
                    write_response(
                        &mut out,
                        &head,
                        br#"{"state":"INVALID","reason_code":"HEADER_TIMEOUT"}"#,
                    );
                    let _ = stream.write_all(&out).await;
                }
                return;
            }
        }
        if shard.shared.stopping.load(Ordering::Relaxed) {
            return;
        }
    }
}

/// Facts about the connection a handler may need.
pub struct RequestCtx {
    pub peer_ip: Option<std::net::IpAddr>,
    pub peer_is_loopback: bool,
    pub plane: Plane,
}

/// Writes the answer into `out`; returns whether the connection stays open.
async fn route(
    shard: &Rc<Shard>,
    request: &Request<'_>,
    ctx: &RequestCtx,
    out: &mut BytesMut,
    scratch: &mut Vec<u8>,
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
    let body = request.body.bytes(scratch);
    if request.method == Method::Head {
        // No route answers HEAD, and a HEAD response must not carry a body.
        head.status = Status::MethodNotAllowed;
        write_response(out, &head, b"");
        return keep && head.connection != Connection::Close;
    }
    match ctx.plane {
        Plane::Public => match (request.method, request.path) {
            (Method::Post, "/v1/reservations") => {
                submit::handle_submit(shard, request, body, ctx, &mut head, out).await
            }
            (Method::Get, path) if path.starts_with("/v1/reservations/") => {
                let id = &path["/v1/reservations/".len()..];
                submit::handle_query(shard, request, id, &mut head, out).await
            }
            (_, path) if path.starts_with(orders::ORDERS_PREFIX) => {
                let rest = &path[orders::ORDERS_PREFIX.len()..];
                orders::handle_order(shard, request, rest, &mut head, out).await
            }
            (Method::Post, orders::CALLBACK_PATH) => {
                orders::handle_callback(shard, body, &mut head, out).await
            }
            (_, "/v1/reservations") => {
                head.status = Status::MethodNotAllowed;
                write_response(out, &head, br#"{"state":"INVALID","reason_code":"METHOD"}"#);
            }
            _ => {
                head.status = Status::NotFound;
                write_response(out, &head, br#"{"state":"INVALID","reason_code":"NO_SUCH_ROUTE"}"#);
            }
        },
        Plane::Admin => admin::handle(shard, request, body, ctx, &mut head, out).await,
    }
    keep && head.connection != Connection::Close
}
