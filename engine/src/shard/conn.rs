//! The HTTP/1.1 connection loop of a shard: accept (bounded per shard and per client
//! address), the PROXY header from trusted balancers, whole-request deadlines, pipelined
//! requests answered in order into one output buffer flushed once per batch (at most
//! `pipeline_depth_max` answers) under a write deadline, and close on any rejection or
//! `Connection: close`.
//!
//! The bounds, each against one attack seen on the edge (issue 12):
//! - **Slowloris.** A head must be complete `header_read_timeout_ms` after its first byte,
//!   a body `body_read_timeout_ms` after the end of its head, however the bytes trickle in
//!   (each read waits only for what is left of the deadline, never a fresh timeout); then
//!   408 and close. An idle keep-alive connection is closed after `idle_timeout_ms`.
//! - **Peers that do not read.** Every flush must finish within `write_timeout_ms`, else the
//!   connection closes (its answers would otherwise pile up in the kernel forever).
//! - **Idle memory.** A connection holds no buffer while nothing is arriving: reads go into
//!   one per-shard scratch buffer during the poll (glommio's TCP read is readiness-based, so
//!   a pending read holds no buffer) and the input and output buffers are taken from a
//!   per-listener pool when bytes arrive or an answer is written, and returned when the
//!   connection is idle again; the route's state is boxed per request. What an idle
//!   connection costs is its task and socket (~2.5 KB, measured).
//! - **Descriptor exhaustion.** `connections_per_shard_max` per shard and
//!   `connections_per_address_max` per client address (IPv6 by /64) per shard; accept
//!   errors (EMFILE, ENFILE) back off exponentially up to [`ACCEPT_BACKOFF_MAX_MS`], are
//!   counted (`flashsale_accept_errors_total`) and logged at most once per second.
//! - **Spoofed addresses.** A PROXY header is read only from `proxy_protocol_from`; there it
//!   is required (missing or malformed: close), from anyone else it is a 400 and close. The
//!   address it carries becomes [`RequestCtx::peer_ip`] (rate limits, the address cap, logs).
//!
//! Draining: the public listener is shut down (new connections are refused, so a TCP health
//! check fails too), connections already open are still answered (with `Connection:
//! close`), and the shard stops only when `stopping` is set ([`serve_public`]).
//!
//! Routing is `routes.rs`; every answer goes through `http::write_response`.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use futures_lite::{AsyncRead, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};

use super::request::{Plane, RequestCtx};
use super::routes::route;
use super::state::Shard;
use crate::http::proxy::{looks_like_proxy_header, parse_proxy_header, ProxyParse, ProxySource};
use crate::http::{
    parse_request, progress, write_rejection, write_response, Connection, Parsed, Progress,
    ResponseHead, Status,
};
use crate::logic::metrics::ShardMetrics;

/// The listen backlog of the public listener: the one `glommio::net::TcpListener::bind` uses
/// for the admin listener too (the start-up check compares it with `somaxconn`).
pub const LISTEN_BACKLOG: u32 = 1024;
/// Most bytes one read takes (the per-shard scratch buffer's size).
const READ_CHUNK_BYTES: usize = 16 * 1024;
/// Capacity a pooled buffer starts with: a reservation request or answer is ~300-600 bytes.
const POOLED_BUFFER_BYTES: usize = 4 * 1024;
/// A buffer that grew past this (a large pipelined batch) is freed rather than pooled.
const POOLED_BUFFER_BYTES_KEPT_MAX: usize = 64 * 1024;
/// Free buffers a listener keeps for reuse (~1 MiB at the starting capacity); beyond it a
/// returned buffer is freed, so a burst's memory goes back once it is over.
const POOLED_BUFFERS_MAX: usize = 256;
/// First and largest pause after a failed accept. Doubling from 1 ms reaches the cap in 8
/// failures; at the cap a shard retries 4 times a second (no spin while descriptors are
/// exhausted) and resumes within 250 ms once they are free.
const ACCEPT_BACKOFF_BASE_MS: u64 = 1;
pub const ACCEPT_BACKOFF_MAX_MS: u64 = 250;
/// Repeated warnings of one kind (accept errors, refused connections, PROXY refusals) are
/// logged at most this often, with the count of those not logged.
const LOG_INTERVAL_MS: u64 = 1_000;
/// How often a shard looks at the drain flag (set from another thread or shard 0).
const DRAIN_POLL_MS: u64 = 10;
/// Admin-plane connections served beyond `admin_connections_max` (and beyond an address's
/// share), for health probes only: a flood of silent or slow admin connections can hold the
/// budget, but not these, because each is held at most [`PROBE_DEADLINE_MS`] and answers only
/// `/livez` and `/readyz` (issue 23: a liveness probe must not restart a healthy engine
/// because someone filled the admin port). A separate probe listener would need another port
/// in every balancer and orchestrator; a reserved budget on the same port needs none.
pub const ADMIN_PROBE_SLOTS: usize = 8;
/// A probe connection's whole-request deadline from its accept: balancers and kubelets send
/// their request at once.
const PROBE_DEADLINE_MS: u64 = 1_000;
/// `100 Continue` (RFC 9110 section 15.2.1): what a client sending `Expect: 100-continue`
/// waits for before its body.
const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

thread_local! {
    /// One read scratch per shard thread: a read polls into it and copies what arrived into
    /// the connection's own (pooled) buffer, so no connection owns a read buffer while it
    /// waits. Borrowed only inside a poll, never across an await.
    static READ_SCRATCH: RefCell<Box<[u8]>> =
        RefCell::new(vec![0u8; READ_CHUNK_BYTES].into_boxed_slice());
}

// ---- listening ----------------------------------------------------------------------------

/// A bound public listener and a second handle on the same socket, with which a drain shuts
/// it down while its accept loop is blocked in `accept` (an accept is never cancelled: a
/// cancelled io_uring accept may complete in the kernel and lose the connection).
pub struct PublicListener {
    listener: TcpListener,
    closer: socket2::Socket,
    pub local_addr: SocketAddr,
}

/// Binds the public port the way `glommio::net::TcpListener::bind` does (`SO_REUSEPORT`,
/// backlog 1024, one listener per shard), keeping a duplicate descriptor for the drain.
#[allow(unsafe_code)]
pub fn bind_public(addr: SocketAddr) -> std::io::Result<PublicListener> {
    use std::os::fd::IntoRawFd;
    use std::os::unix::io::FromRawFd;
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_port(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG as i32)?;
    let local_addr = socket
        .local_addr()?
        .as_socket()
        .ok_or_else(|| std::io::Error::other("not an IP socket"))?;
    let closer = socket.try_clone()?;
    let fd = std::net::TcpListener::from(socket).into_raw_fd();
    // SAFETY: `fd` is a bound, listening TCP socket whose ownership `into_raw_fd` just
    // released; the glommio listener becomes its only owner (the closer holds a dup).
    let listener = unsafe { TcpListener::from_raw_fd(fd) };
    Ok(PublicListener { listener, closer, local_addr })
}

/// The public side of a shard until it stops: accept until draining (then the listener is
/// shut down: new connections are refused), keep answering the connections already open,
/// return once `stopping` is set (the caller then finishes what is in flight).
pub async fn serve_public(shard: Rc<Shard>, public: PublicListener) {
    let PublicListener { listener, closer, .. } = public;
    let watcher = Rc::clone(&shard);
    glommio::spawn_local(async move {
        while !watcher.is_draining() {
            glommio::timer::sleep(Duration::from_millis(DRAIN_POLL_MS)).await;
        }
        // shutdown(2) on a listening socket stops it listening (new SYNs are refused, its
        // queue is reset) and completes the blocked accept with an error; the accept loop
        // then sees the drain and returns.
        if let Err(e) = closer.shutdown(std::net::Shutdown::Both) {
            tracing::warn!(shard = watcher.id, error = %e, "shutting the public listener down");
        }
    })
    .detach();
    accept_loop(Rc::clone(&shard), listener, Plane::Public).await;
    tracing::info!(shard = shard.id, "public listener closed (draining)");
    while !shard.shared.stopping.load(Ordering::Relaxed) {
        glommio::timer::sleep(Duration::from_millis(DRAIN_POLL_MS)).await;
    }
}

/// What the connections of one listener share on their shard.
struct ListenerState {
    plane: Plane,
    open: Cell<usize>,
    open_max: usize,
    /// Admin plane only: connections beyond `open_max` (or beyond their address's share)
    /// that may still be served health probes ([`ADMIN_PROBE_SLOTS`]), and how many are.
    probes_max: usize,
    probes_open: Cell<usize>,
    /// The probe connections still waiting for bytes, oldest first: when every probe slot is
    /// held, a new connection evicts the oldest ([`ListenerState::take_probe`]).
    probe_waiters: RefCell<VecDeque<Rc<Eviction>>>,
    per_address_max: usize,
    /// Open connections per client address key ([`address_key`]); an entry exists only while
    /// the address has a connection, so it holds at most `open_max` entries.
    per_address: RefCell<HashMap<IpAddr, u32>>,
    pool: BufferPool,
    refused_log: RefCell<LogEvery>,
    proxy_log: RefCell<LogEvery>,
    started: Instant,
}

impl ListenerState {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// A probe slot: a free one, or the slot of the oldest probe connection still waiting
    /// for bytes, which is evicted (closed). Silent or slow connections can therefore never
    /// hold the probe budget against a real probe, which sends its request at once. Until
    /// the evicted tasks have run, at most `probes_max` more probe connections exist (each
    /// eviction takes a distinct waiter), so the bound is 2 × `probes_max`.
    fn take_probe(self: &Rc<Self>) -> Option<ClassSlot> {
        if self.probes_open.get() >= self.probes_max {
            let mut waiters = self.probe_waiters.borrow_mut();
            loop {
                let oldest = waiters.pop_front()?;
                if oldest.evict() {
                    break;
                }
            }
        }
        Some(ClassSlot::take(self, Class::Probe))
    }

    /// Registers a probe connection as waiting for bytes (evictable).
    fn probe_waiting(&self) -> Rc<Eviction> {
        let eviction = Rc::new(Eviction::default());
        let mut waiters = self.probe_waiters.borrow_mut();
        if waiters.len() >= 2 * self.probes_max.max(1) {
            waiters.retain(|w| !w.done.get());
        }
        waiters.push_back(Rc::clone(&eviction));
        eviction
    }
}

/// A probe connection's eviction flag and the waker of its pending read.
#[derive(Default)]
struct Eviction {
    evicted: Cell<bool>,
    /// The connection ended (or got its bytes): nothing left to evict.
    done: Cell<bool>,
    waker: RefCell<Option<std::task::Waker>>,
}

impl Eviction {
    /// Evicts it if it is still waiting; false when it already ended.
    fn evict(&self) -> bool {
        if self.done.get() || self.evicted.get() {
            return false;
        }
        self.evicted.set(true);
        if let Some(waker) = self.waker.borrow_mut().take() {
            waker.wake();
        }
        true
    }
}

pub async fn accept_loop(shard: Rc<Shard>, listener: TcpListener, plane: Plane) {
    let config = shard.config();
    let (open_max, probes_max, per_address_max) = match plane {
        Plane::Public => (config.connections_per_shard_max, 0, config.connections_per_address_max),
        Plane::Admin => (
            config.admin_connections_max,
            ADMIN_PROBE_SLOTS,
            config.admin_connections_per_address_max,
        ),
    };
    let state = Rc::new(ListenerState {
        plane,
        open: Cell::new(0),
        open_max,
        probes_max,
        probes_open: Cell::new(0),
        probe_waiters: RefCell::new(VecDeque::new()),
        per_address_max,
        per_address: RefCell::new(HashMap::new()),
        pool: BufferPool::default(),
        refused_log: RefCell::new(LogEvery::new(LOG_INTERVAL_MS)),
        proxy_log: RefCell::new(LogEvery::new(LOG_INTERVAL_MS)),
        started: Instant::now(),
    });
    let mut backoff = AcceptBackoff::default();
    let mut accept_log = LogEvery::new(LOG_INTERVAL_MS);
    loop {
        // Never cancel an accept (see `PublicListener`): the stop and drain flags are checked
        // after each; a drain shuts the listener down, `ServeHandle::stop` also wakes it.
        let accepted = listener.accept().await;
        if shard.shared.stopping.load(Ordering::Relaxed)
            || (plane == Plane::Public && shard.is_draining())
        {
            return;
        }
        let stream = match accepted {
            Ok(stream) => {
                backoff.reset();
                stream
            }
            Err(e) => {
                shard.metrics().accept_errors.fetch_add(1, Ordering::Relaxed);
                if let Some(suppressed) = accept_log.should_log(state.now_ms()) {
                    tracing::warn!(shard = shard.id, error = %e, suppressed, "accept failed; backing off");
                }
                glommio::timer::sleep(Duration::from_millis(backoff.after_error())).await;
                continue;
            }
        };
        let slot = if state.open.get() < state.open_max {
            ClassSlot::take(&state, Class::Full)
        } else if let Some(probe) = state.take_probe() {
            probe
        } else {
            shard.metrics().connections_refused.fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        shard.metrics().connections_open.fetch_add(1, Ordering::Relaxed);
        let shard = Rc::clone(&shard);
        let state = Rc::clone(&state);
        glommio::spawn_local(async move {
            serve_connection(&shard, &state, stream, Instant::now(), slot).await;
            shard.metrics().connections_open.fetch_sub(1, Ordering::Relaxed);
        })
        .detach();
    }
}

// ---- one connection -----------------------------------------------------------------------

async fn serve_connection(
    shard: &Rc<Shard>,
    state: &Rc<ListenerState>,
    stream: TcpStream,
    accepted_at: Instant,
    mut class: ClassSlot,
) {
    let tcp_peer = stream.peer_addr().ok().map(|a| a.ip().to_canonical());
    let trusted = state.plane == Plane::Public
        && tcp_peer.is_some_and(|ip| shard.config().proxy_protocol_from.contains(ip));
    let mut conn = Conn {
        shard,
        state,
        stream,
        inbuf: None,
        out: None,
        clock: RequestClock::default(),
        accepted_at,
        answered_any: false,
        head_timeout_ms: shard.config().header_read_timeout_ms,
        eviction: None,
    };
    let client = if trusted {
        match conn.read_proxy_header(accepted_at, tcp_peer).await {
            Some(ProxySource::Relayed { source, .. }) => Some(source.ip().to_canonical()),
            Some(ProxySource::Local | ProxySource::Unknown) => tcp_peer,
            None => return,
        }
    } else {
        tcp_peer
    };
    let address = client.and_then(|ip| AddressSlot::take(state, ip, state.per_address_max));
    let _address = match (address, client) {
        (Some(slot), _) => Some(slot),
        (None, None) => None,
        // Over its address's share: on the admin plane it may still be a probe.
        (None, Some(ip)) => match class.downgrade_to_probe(state) {
            Some(probe) => {
                class = probe;
                None
            }
            None => {
                shard.metrics().connections_refused_per_address.fetch_add(1, Ordering::Relaxed);
                if let Some(suppressed) = state.refused_log.borrow_mut().should_log(state.now_ms())
                {
                    tracing::warn!(shard = shard.id, client = %ip, plane = ?state.plane, suppressed, "connection refused: per-address cap");
                }
                return;
            }
        },
    };
    if class.class == Class::Probe {
        conn.head_timeout_ms = PROBE_DEADLINE_MS.min(shard.config().header_read_timeout_ms);
        conn.eviction = Some(state.probe_waiting());
    }
    let ctx = RequestCtx {
        peer_ip: client,
        peer_is_loopback: client.is_some_and(|ip| ip.is_loopback()),
        plane: state.plane,
        probe_only: class.class == Class::Probe,
    };
    let first_bytes = if state.plane == Plane::Public && !trusted {
        FirstBytes::RefuseProxyHeader
    } else {
        FirstBytes::Http
    };
    conn.serve_http(&ctx, first_bytes).await;
}

/// What the start of a connection may be, besides HTTP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FirstBytes {
    /// A PROXY header from an untrusted peer is answered 400 (it would spoof its address).
    RefuseProxyHeader,
    Http,
}

/// When the request being received started, for its deadlines.
#[derive(Debug, Default, Clone, Copy)]
struct RequestClock {
    head_started: Option<Instant>,
    body_started: Option<Instant>,
    continue_sent: bool,
}

/// Whether a batch ended because the connection must close, the depth bound was reached, or
/// more bytes are needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BatchEnd {
    ReadMore,
    DepthReached,
    Close,
}

enum ReadOutcome {
    Data,
    Closed,
    TimedOut,
}

/// What the loop waits for next, and until when.
struct Wait {
    deadline: Instant,
    /// The 408 reason if the deadline passes (`None`: idle, close silently).
    timeout_reason: Option<&'static [u8]>,
}

struct Conn<'s> {
    shard: &'s Rc<Shard>,
    state: &'s Rc<ListenerState>,
    stream: TcpStream,
    /// Taken from the pool when bytes arrive; returned when everything in it is answered.
    inbuf: Option<BytesMut>,
    /// Taken from the pool when an answer is written; returned once flushed and idle.
    out: Option<BytesMut>,
    clock: RequestClock,
    /// When the connection was accepted; until its first request is answered, the head
    /// deadline counts from here (a connection that never sends a byte is a slot held).
    accepted_at: Instant,
    answered_any: bool,
    /// The head deadline (and the first byte's): the configured one, or a probe's.
    head_timeout_ms: u64,
    /// A probe connection's eviction (admin plane beyond its budget).
    eviction: Option<Rc<Eviction>>,
}

impl Drop for Conn<'_> {
    fn drop(&mut self) {
        self.release_buffers();
        if let Some(eviction) = &self.eviction {
            eviction.done.set(true);
        }
    }
}

impl Conn<'_> {
    fn release_buffers(&mut self) {
        if let Some(buf) = self.inbuf.take() {
            self.state.pool.give(buf);
        }
        if let Some(buf) = self.out.take() {
            self.state.pool.give(buf);
        }
    }

    fn buffered(&self) -> &[u8] {
        self.inbuf.as_deref().unwrap_or(&[])
    }

    fn out(&mut self) -> &mut BytesMut {
        let pool = &self.state.pool;
        self.out.get_or_insert_with(|| pool.take())
    }

    /// A trusted balancer's connection starts with its PROXY header, within the header
    /// deadline of the accept. `None`: refused (logged, counted), close without an answer.
    async fn read_proxy_header(
        &mut self,
        accepted_at: Instant,
        tcp_peer: Option<IpAddr>,
    ) -> Option<ProxySource> {
        let deadline =
            accepted_at + Duration::from_millis(self.shard.config().header_read_timeout_ms);
        loop {
            let rejection = match parse_proxy_header(self.buffered()) {
                ProxyParse::Complete { source, consumed } => {
                    if let Some(inbuf) = self.inbuf.as_mut() {
                        inbuf.advance(consumed);
                    }
                    return Some(source);
                }
                ProxyParse::Reject(rejection) => rejection.name(),
                ProxyParse::Incomplete => match self.read(deadline).await {
                    ReadOutcome::Data => continue,
                    // A TCP check that connects and closes: nothing to report.
                    ReadOutcome::Closed if self.buffered().is_empty() => return None,
                    ReadOutcome::Closed => "closed_mid_header",
                    ReadOutcome::TimedOut => "timed_out",
                },
            };
            self.shard.metrics().proxy_refused_malformed.fetch_add(1, Ordering::Relaxed);
            if let Some(suppressed) =
                self.state.proxy_log.borrow_mut().should_log(self.state.now_ms())
            {
                let peer = tcp_peer.map(|ip| ip.to_string()).unwrap_or_default();
                tracing::warn!(
                    shard = self.shard.id,
                    peer,
                    reason = rejection,
                    suppressed,
                    "PROXY header refused from a trusted source; closed"
                );
            }
            return None;
        }
    }

    async fn serve_http(&mut self, ctx: &RequestCtx, mut first_bytes: FirstBytes) {
        loop {
            let shard: &Rc<Shard> = self.shard;
            let mut in_flight = InFlight { metrics: shard.metrics(), count: 0 };
            let end = match self.refuse_proxy_header(&mut first_bytes) {
                Some(end) => end,
                None => self.answer_buffered(ctx, &mut in_flight).await,
            };
            if !self.flush().await {
                return;
            }
            drop(in_flight);
            match end {
                BatchEnd::Close => {
                    let _ = self.stream.close().await;
                    return;
                }
                BatchEnd::DepthReached => continue, // more may be buffered: answer before reading
                BatchEnd::ReadMore => {}
            }
            let wait = self.next_wait();
            if wait.timeout_reason.is_none() {
                // Idle: hold no buffer while nothing arrives.
                self.release_buffers();
            } else if !self.flush().await {
                return; // the `100 Continue` could not be written
            }
            match self.read(wait.deadline).await {
                ReadOutcome::Data => {}
                ReadOutcome::Closed => return,
                ReadOutcome::TimedOut => {
                    if let Some(reason) = wait.timeout_reason {
                        self.answer_timeout(reason).await;
                    } else if !self.answered_any && self.buffered().is_empty() {
                        let metrics = self.shard.metrics();
                        metrics.timeouts_first_byte.fetch_add(1, Ordering::Relaxed);
                    }
                    return;
                }
            }
            if self.shard.shared.stopping.load(Ordering::Relaxed) {
                return;
            }
        }
    }

    /// On an untrusted public connection's first bytes: a PROXY header gets a 400 and a
    /// close (`Some`); too few bytes to tell wait for more (`Some(ReadMore)`); anything else
    /// is HTTP from then on (`None`).
    fn refuse_proxy_header(&mut self, first_bytes: &mut FirstBytes) -> Option<BatchEnd> {
        if *first_bytes != FirstBytes::RefuseProxyHeader || self.buffered().is_empty() {
            return None;
        }
        match looks_like_proxy_header(self.buffered()) {
            Some(false) => {
                *first_bytes = FirstBytes::Http;
                None
            }
            None => Some(BatchEnd::ReadMore),
            Some(true) => {
                self.shard.metrics().proxy_refused_untrusted.fetch_add(1, Ordering::Relaxed);
                let request_id = self.shard.next_request_id();
                let head = ResponseHead {
                    connection: Connection::Close,
                    ..ResponseHead::new(Status::BadRequest, &request_id)
                };
                let body = br#"{"state":"INVALID","reason_code":"proxy_protocol_not_trusted"}"#;
                write_response(self.out(), &head, body);
                Some(BatchEnd::Close)
            }
        }
    }

    /// Answers every complete request already buffered, in order, up to the depth bound.
    async fn answer_buffered(
        &mut self,
        ctx: &RequestCtx,
        in_flight: &mut InFlight<'_>,
    ) -> BatchEnd {
        let shard: &Rc<Shard> = self.shard;
        let limits = shard.config().http;
        let Conn { state, inbuf, out, clock, answered_any, .. } = self;
        let pool = &state.pool;
        let Some(inbuf) = inbuf.as_mut() else { return BatchEnd::ReadMore };
        for _ in 0..limits.pipeline_depth_max {
            let started = Instant::now();
            match parse_request(inbuf, &limits) {
                Parsed::Incomplete => return BatchEnd::ReadMore,
                Parsed::Reject(rejection) => {
                    shard.metrics().http_rejections.fetch_add(1, Ordering::Relaxed);
                    let out = out.get_or_insert_with(|| pool.take());
                    write_rejection(out, rejection, &shard.next_request_id());
                    return BatchEnd::Close;
                }
                Parsed::Complete { request, consumed } => {
                    in_flight.add();
                    let out = out.get_or_insert_with(|| pool.take());
                    // Boxed: the route's state (~3 KiB: the submit flow's awaits) would
                    // otherwise live in every connection's task, idle or not. One allocation
                    // per request buys 6.9 -> 2.5 KB per idle connection (measured, 10,000
                    // connections, mimalloc).
                    let keep = Box::pin(route(shard, &request, ctx, out)).await;
                    shard.metrics().request_latency.observe_ns(started.elapsed().as_nanos() as u64);
                    inbuf.advance(consumed);
                    // The next request's deadlines start with its own first byte.
                    *clock = RequestClock::default();
                    *answered_any = true;
                    if !keep {
                        return BatchEnd::Close;
                    }
                }
            }
        }
        BatchEnd::DepthReached
    }

    /// The deadline of what comes next: before the first request, its head deadline from the
    /// accept (issue 23: a connection that never sends a byte is held no longer than a slow
    /// head); after it, the idle timeout when nothing is buffered; else the head or body
    /// deadline of the partial request (queueing `100 Continue` when its client waits for one).
    fn next_wait(&mut self) -> Wait {
        let now = Instant::now();
        let config = self.shard.config();
        if self.buffered().is_empty() {
            if !self.answered_any {
                let first_byte = Duration::from_millis(self.head_timeout_ms);
                return Wait { deadline: self.accepted_at + first_byte, timeout_reason: None };
            }
            let deadline = now + Duration::from_millis(config.idle_timeout_ms);
            return Wait { deadline, timeout_reason: None };
        }
        let head_started = *self.clock.head_started.get_or_insert(now);
        match progress(self.buffered(), &config.http) {
            Progress::Head => Wait {
                deadline: head_started + Duration::from_millis(self.head_timeout_ms),
                timeout_reason: Some(br#"{"state":"INVALID","reason_code":"HEADER_TIMEOUT"}"#),
            },
            Progress::Body { expect_continue } => {
                let body_started = *self.clock.body_started.get_or_insert(now);
                if expect_continue && !self.clock.continue_sent {
                    self.clock.continue_sent = true;
                    self.out().extend_from_slice(CONTINUE);
                }
                Wait {
                    deadline: body_started + Duration::from_millis(config.body_read_timeout_ms),
                    timeout_reason: Some(br#"{"state":"INVALID","reason_code":"BODY_TIMEOUT"}"#),
                }
            }
        }
    }

    async fn answer_timeout(&mut self, body: &[u8]) {
        let metrics = self.shard.metrics();
        let counter = if self.clock.body_started.is_some() {
            &metrics.timeouts_body
        } else {
            &metrics.timeouts_head
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let request_id = self.shard.next_request_id();
        let head = ResponseHead {
            connection: Connection::Close,
            ..ResponseHead::new(Status::RequestTimeout, &request_id)
        };
        write_response(self.out(), &head, body);
        let _ = self.flush().await;
    }

    /// Writes what `out` holds within the write deadline; `false`: the connection must close
    /// (the peer does not read, or the write failed).
    async fn flush(&mut self) -> bool {
        let shard: &Rc<Shard> = self.shard;
        let write_timeout = Duration::from_millis(shard.config().write_timeout_ms);
        let Conn { stream, out, .. } = self;
        let Some(out) = out.as_mut().filter(|out| !out.is_empty()) else { return true };
        let written =
            glommio::timer::timeout(write_timeout, async { Ok(stream.write_all(out).await) }).await;
        match written {
            Ok(Ok(())) => {
                out.clear();
                true
            }
            Ok(Err(_)) => false,
            Err(_) => {
                shard.metrics().timeouts_write.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Waits until bytes arrive (appended to `inbuf`, taken from the pool if needed), the
    /// peer closes, or `deadline` passes.
    async fn read(&mut self, deadline: Instant) -> ReadOutcome {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return ReadOutcome::TimedOut;
        }
        let Conn { stream, inbuf, state, eviction, .. } = self;
        let pool = &state.pool;
        let read = futures_lite::future::poll_fn(|cx| {
            if let Some(eviction) = eviction.as_deref() {
                if eviction.evicted.get() {
                    return Poll::Ready(ReadOutcome::Closed);
                }
                *eviction.waker.borrow_mut() = Some(cx.waker().clone());
            }
            READ_SCRATCH.with(|scratch| {
                let mut scratch = scratch.borrow_mut();
                match Pin::new(&mut *stream).poll_read(cx, &mut scratch[..]) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(Ok(0) | Err(_)) => Poll::Ready(ReadOutcome::Closed),
                    Poll::Ready(Ok(n)) => {
                        inbuf.get_or_insert_with(|| pool.take()).extend_from_slice(&scratch[..n]);
                        Poll::Ready(ReadOutcome::Data)
                    }
                }
            })
        });
        glommio::timer::timeout(remaining, async { Ok(read.await) })
            .await
            .unwrap_or(ReadOutcome::TimedOut)
    }
}

/// Requests of one batch counted in `requests_in_flight` until their answers are flushed
/// (a stopping shard waits for that count to reach zero, so an answer is written before
/// the executor ends).
struct InFlight<'m> {
    metrics: &'m ShardMetrics,
    count: u64,
}

impl InFlight<'_> {
    fn add(&mut self) {
        self.count += 1;
        self.metrics.requests_in_flight.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.metrics.requests_in_flight.fetch_sub(self.count, Ordering::Relaxed);
    }
}

// ---- per-address cap ----------------------------------------------------------------------

/// The key a client address is counted under: IPv4 as is, IPv6 by its /64 (one subscriber's
/// usual allocation: counting single IPv6 addresses would let one host take 2^64 slots).
fn address_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            IpAddr::V6(std::net::Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1)))
        }
        v4 => v4,
    }
}

/// One connection's place in its address's count; released on drop.
struct AddressSlot {
    state: Rc<ListenerState>,
    key: IpAddr,
}

impl AddressSlot {
    fn take(state: &Rc<ListenerState>, ip: IpAddr, per_address_max: usize) -> Option<AddressSlot> {
        let key = address_key(ip);
        let mut counts = state.per_address.borrow_mut();
        let count = counts.entry(key).or_insert(0);
        if *count as usize >= per_address_max {
            if *count == 0 {
                counts.remove(&key);
            }
            return None;
        }
        *count += 1;
        Some(AddressSlot { state: Rc::clone(state), key })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut counts = self.state.per_address.borrow_mut();
        if let Some(count) = counts.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

/// Which budget of its listener a connection holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Full,
    Probe,
}

/// One connection's place in its listener's count (full or probe); released on drop.
struct ClassSlot {
    state: Rc<ListenerState>,
    class: Class,
}

impl ClassSlot {
    fn take(state: &Rc<ListenerState>, class: Class) -> ClassSlot {
        let count = match class {
            Class::Full => &state.open,
            Class::Probe => &state.probes_open,
        };
        count.set(count.get() + 1);
        ClassSlot { state: Rc::clone(state), class }
    }

    /// A full slot given back for a probe slot (the admin plane's connections over their
    /// address's share); `None`: refuse the connection.
    fn downgrade_to_probe(&self, state: &Rc<ListenerState>) -> Option<ClassSlot> {
        if self.class == Class::Probe || state.probes_max == 0 {
            return None;
        }
        state.take_probe()
    }
}

impl Drop for ClassSlot {
    fn drop(&mut self) {
        let count = match self.class {
            Class::Full => &self.state.open,
            Class::Probe => &self.state.probes_open,
        };
        count.set(count.get() - 1);
    }
}

// ---- small sans-I/O helpers ---------------------------------------------------------------

/// Reused connection buffers: taken when bytes arrive or an answer is written, given back
/// when the connection is idle again. Bounded (see the constants).
#[derive(Default)]
struct BufferPool {
    free: RefCell<Vec<BytesMut>>,
}

impl BufferPool {
    fn take(&self) -> BytesMut {
        self.free.borrow_mut().pop().unwrap_or_else(|| BytesMut::with_capacity(POOLED_BUFFER_BYTES))
    }

    fn give(&self, mut buf: BytesMut) {
        buf.clear();
        let mut free = self.free.borrow_mut();
        if free.len() < POOLED_BUFFERS_MAX && buf.capacity() <= POOLED_BUFFER_BYTES_KEPT_MAX {
            free.push(buf);
        }
    }
}

/// Bounded exponential backoff after failed accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AcceptBackoff {
    next_ms: u64,
}

impl Default for AcceptBackoff {
    fn default() -> Self {
        AcceptBackoff { next_ms: ACCEPT_BACKOFF_BASE_MS }
    }
}

impl AcceptBackoff {
    /// The pause before the next attempt; doubles up to [`ACCEPT_BACKOFF_MAX_MS`].
    fn after_error(&mut self) -> u64 {
        let pause = self.next_ms;
        self.next_ms = (self.next_ms * 2).min(ACCEPT_BACKOFF_MAX_MS);
        pause
    }

    fn reset(&mut self) {
        *self = AcceptBackoff::default();
    }
}

/// "At most once per interval" for a repeated warning; time (ms) is an argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LogEvery {
    interval_ms: u64,
    last_ms: Option<u64>,
    suppressed: u64,
}

impl LogEvery {
    fn new(interval_ms: u64) -> LogEvery {
        LogEvery { interval_ms, last_ms: None, suppressed: 0 }
    }

    /// `Some(suppressed since the last log)` when this occurrence should be logged.
    fn should_log(&mut self, now_ms: u64) -> Option<u64> {
        match self.last_ms {
            Some(last) if now_ms.saturating_sub(last) < self.interval_ms => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last_ms = Some(now_ms);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

// ---- routing ------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_backoff_doubles_to_its_cap_and_resets() {
        let mut backoff = AcceptBackoff::default();
        let pauses: Vec<u64> = (0..12).map(|_| backoff.after_error()).collect();
        assert_eq!(pauses, [1, 2, 4, 8, 16, 32, 64, 128, 250, 250, 250, 250]);
        backoff.reset();
        assert_eq!(backoff.after_error(), 1);
    }

    #[test]
    fn a_repeated_warning_is_logged_once_per_interval_with_the_suppressed_count() {
        let mut log = LogEvery::new(1_000);
        assert_eq!(log.should_log(0), Some(0));
        let logged: Vec<Option<u64>> = (1..=1_570).map(|i| log.should_log(i * 10)).collect();
        // 15,700 ms of one failure every 10 ms: one line per second, not 1,570.
        assert_eq!(logged.iter().filter(|l| l.is_some()).count(), 15);
        assert_eq!(logged[99], Some(99), "the second line reports the 99 not logged");
        assert_eq!(log.should_log(u64::MAX), Some(70));
    }

    #[test]
    fn ipv6_clients_are_counted_by_their_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().expect("ip");
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().expect("ip");
        let c: IpAddr = "2001:db8:1:3::1".parse().expect("ip");
        assert_eq!(address_key(a), address_key(b));
        assert_ne!(address_key(a), address_key(c));
        let mapped: IpAddr = "::ffff:203.0.113.9".parse().expect("ip");
        assert_eq!(address_key(mapped), "203.0.113.9".parse::<IpAddr>().expect("ip"));
    }

    #[test]
    fn the_buffer_pool_is_bounded_and_drops_grown_buffers() {
        let pool = BufferPool::default();
        let taken: Vec<BytesMut> = (0..POOLED_BUFFERS_MAX + 10).map(|_| pool.take()).collect();
        for buf in taken {
            pool.give(buf);
        }
        assert_eq!(pool.free.borrow().len(), POOLED_BUFFERS_MAX);
        let mut grown = pool.take();
        grown.reserve(POOLED_BUFFER_BYTES_KEPT_MAX + 1);
        pool.give(grown);
        assert_eq!(pool.free.borrow().len(), POOLED_BUFFERS_MAX - 1);
        let mut used = pool.take();
        used.extend_from_slice(b"GET / HTTP/1.1\r\n");
        pool.give(used);
        assert!(pool.take().is_empty(), "a pooled buffer comes back empty");
    }
}
