//! `flashsale-bare`: the bare-server baseline of issue 5 — what the engine's sold-out path is
//! measured against. One glommio executor per shard (pinned one per core unless `--no-pin`,
//! as `flashsale serve` does), one `SO_REUSEPORT` listener per shard on the same port, the
//! engine's own HTTP layer (`flashsale_engine::http::parse_request` with `Limits::DEFAULT`,
//! `write_response`), and the engine connection loop's shape: read into a reused buffer,
//! answer up to `pipeline_depth_max` pipelined requests into one output buffer, one write per
//! batch, the header-read deadline and idle timeout around each read.
//!
//! Every `POST /v1/reservations` gets `200 OK` with a fixed SOLD_OUT body, sized like the
//! engine's answer (`{"request_id":"<id>","state":"SOLD_OUT"}` with an id of
//! `--request-id-bytes`; the load generator's ids are ~17 bytes) and a generated-looking
//! `x-request-id` of the engine's length. Anything else gets the engine's 404 body.
//!
//! What it deliberately does not do: authentication, body parsing, rate limits, Redis,
//! metrics, replica lookups — everything the engine adds on top is what the ratio measures.
//!
//! Prints `flashsale-bare: N shards, http://ADDR` on stdout once every shard listens, then
//! serves until killed. Run by `benches/baseline.sh`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use clap::Parser;
use flashsale_engine::http::{
    parse_request, write_rejection, write_response, Connection, Limits, Method, Parsed,
    ResponseHead, Status,
};
use futures::io::{AsyncReadExt, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};
use glommio::{LocalExecutorBuilder, Placement};

/// Read size per syscall (the engine's `READ_CHUNK_BYTES`).
const READ_CHUNK_BYTES: usize = 16 * 1024;
/// The engine's defaults (`serve::default_edge_config`).
const CONNECTIONS_PER_SHARD_MAX: usize = 16_384;
const HEADER_READ_TIMEOUT_MS: u64 = 5_000;
const IDLE_TIMEOUT_MS: u64 = 60_000;
/// Longest wait for every shard to listen.
const START_TIMEOUT_MS: u64 = 10_000;
/// The engine generates `fs-{shard}-{n}`; after a million requests that is 12 bytes.
const REQUEST_ID_HEADER: &str = "fs-0-1000000";

#[derive(Debug, Parser)]
#[command(name = "flashsale-bare", version)]
struct Args {
    /// Listener address (port 0: any free port, printed on stdout).
    #[arg(long, default_value = "127.0.0.1:0")]
    addr: SocketAddr,
    /// Executors (one listener each on the same port). Default: available cores.
    #[arg(long)]
    shards: Option<usize>,
    /// Do not pin executors to cores (as `flashsale serve --no-pin`).
    #[arg(long)]
    no_pin: bool,
    /// Length of the request id in the fixed body (the engine echoes the client's).
    #[arg(long, default_value_t = 17)]
    request_id_bytes: usize,
}

struct Shared {
    body: Vec<u8>,
    port: AtomicU16,
    bound: Vec<AtomicBool>,
    failed: AtomicBool,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flashsale-bare: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let shards = args
        .shards
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    if args.request_id_bytes == 0 || args.request_id_bytes > 64 {
        return Err("--request-id-bytes must be 1..=64 (the contract's request id)".into());
    }
    let body =
        format!(r#"{{"request_id":"{}","state":"SOLD_OUT"}}"#, "r".repeat(args.request_id_bytes))
            .into_bytes();
    let shared = Arc::new(Shared {
        body,
        port: AtomicU16::new(0),
        bound: (0..shards).map(|_| AtomicBool::new(false)).collect(),
        failed: AtomicBool::new(false),
    });
    let mut executors = Vec::with_capacity(shards);
    for id in 0..shards {
        let placement = if args.no_pin { Placement::Unbound } else { Placement::Fixed(id) };
        let shared = Arc::clone(&shared);
        let addr = args.addr;
        let handle = LocalExecutorBuilder::new(placement)
            .name(&format!("bare-{id}"))
            .io_memory(1 << 20)
            .ring_depth(256)
            .spawn(move || serve_shard(id, addr, shared))
            .map_err(|e| format!("start executor {id}: {e}"))?;
        executors.push(handle);
    }
    let deadline = Instant::now() + Duration::from_millis(START_TIMEOUT_MS);
    while !shared.bound.iter().all(|b| b.load(Ordering::Acquire)) {
        if shared.failed.load(Ordering::Acquire) || Instant::now() > deadline {
            return Err("a shard could not bind its listener (see stderr)".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let bound = SocketAddr::new(args.addr.ip(), shared.port.load(Ordering::Acquire));
    println!(
        "flashsale-bare: {shards} shards ({}), http://{bound}, body {} bytes",
        if args.no_pin { "unpinned" } else { "pinned" },
        shared.body.len()
    );
    for handle in executors {
        handle.join().map_err(|e| format!("executor: {e}"))?;
    }
    Ok(())
}

/// Shard 0 binds first (port 0 resolves to one port); the others bind that port.
async fn serve_shard(id: usize, addr: SocketAddr, shared: Arc<Shared>) {
    let addr = if id == 0 {
        addr
    } else {
        loop {
            let port = shared.port.load(Ordering::Acquire);
            if port != 0 {
                break SocketAddr::new(addr.ip(), port);
            }
            if shared.failed.load(Ordering::Acquire) {
                return;
            }
            glommio::timer::sleep(Duration::from_millis(1)).await;
        }
    };
    let listener = match TcpListener::bind(addr) {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("flashsale-bare: shard {id}: bind {addr}: {e}");
            shared.failed.store(true, Ordering::Release);
            return;
        }
    };
    if id == 0 {
        let port = listener.local_addr().map_or(0, |a| a.port());
        shared.port.store(port, Ordering::Release);
    }
    shared.bound[id].store(true, Ordering::Release);
    let open = std::rc::Rc::new(std::cell::Cell::new(0usize));
    loop {
        let stream = match listener.accept().await {
            Ok(stream) => stream,
            Err(_) => {
                glommio::timer::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if open.get() >= CONNECTIONS_PER_SHARD_MAX {
            drop(stream);
            continue;
        }
        let _ = stream.set_nodelay(true);
        open.set(open.get() + 1);
        let open = std::rc::Rc::clone(&open);
        let shared = Arc::clone(&shared);
        glommio::spawn_local(async move {
            serve_connection(stream, &shared.body).await;
            open.set(open.get() - 1);
        })
        .detach();
    }
}

/// The engine's connection loop (`engine::shard::conn::serve_connection`) with the route
/// replaced by a fixed answer.
async fn serve_connection(mut stream: TcpStream, body: &[u8]) {
    let limits = Limits::DEFAULT;
    let mut inbuf = BytesMut::with_capacity(limits.request_bytes_max() + READ_CHUNK_BYTES);
    let mut out = BytesMut::with_capacity(16 * 1024);
    let mut chunk = vec![0u8; READ_CHUNK_BYTES];
    loop {
        let mut answered = 0;
        let mut close = false;
        while answered < limits.pipeline_depth_max {
            match parse_request(&inbuf, &limits) {
                Parsed::Incomplete => break,
                Parsed::Reject(rejection) => {
                    write_rejection(&mut out, rejection, REQUEST_ID_HEADER);
                    close = true;
                    break;
                }
                Parsed::Complete { request, consumed } => {
                    let mut head = ResponseHead::new(Status::Ok, REQUEST_ID_HEADER);
                    head.connection = Connection::for_request(&request);
                    if request.method == Method::Post && request.path == "/v1/reservations" {
                        write_response(&mut out, &head, body);
                    } else {
                        head.status = Status::NotFound;
                        write_response(
                            &mut out,
                            &head,
                            br#"{"state":"INVALID","reason_code":"NO_SUCH_ROUTE"}"#,
                        );
                    }
                    let keep = head.connection != Connection::Close;
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
            continue;
        }
        let wait_ms = if inbuf.is_empty() { IDLE_TIMEOUT_MS } else { HEADER_READ_TIMEOUT_MS };
        let read = glommio::timer::timeout(Duration::from_millis(wait_ms), async {
            Ok(stream.read(&mut chunk).await)
        })
        .await;
        match read {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return,
            Ok(Ok(n)) => inbuf.extend_from_slice(&chunk[..n]),
        }
    }
}
