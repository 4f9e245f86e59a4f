//! A fault-injecting TCP proxy of ours (issue 27: this kernel has no netem): `flashsale chaos`
//! puts one in front of each Redis, NATS and PostgreSQL node (the engines are given the
//! proxies' addresses, and the Redis and NATS nodes announce them), so the nemesis can
//! partition a node from the engines while the node itself runs on in its cluster (Redis'
//! bus, NATS' routes and PostgreSQL's standbys connect to the nodes directly).
//!
//! While [`Proxy::partition`] holds, new connections are accepted and then left silent (a
//! peer behind a partition neither answers nor resets), and open ones stop relaying in both
//! directions; [`Proxy::heal`] lets the open ones go on (what TCP does when a partition heals
//! within its retransmission time) and closes the silent ones. Blocking threads, two per
//! connection, each read bounded by [`POLL_MS`] so that a state change is seen promptly.
//!
//! What it is not: a latency or bandwidth shaper, or a general-purpose proxy (no bound on
//! connections beyond what the engines' pools open: two engines × a few pools).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often a relaying thread looks at the proxy's state while it waits for bytes.
const POLL_MS: u64 = 50;

/// Shared between the proxy's threads.
struct State {
    /// Bumped at every partition: a connection accepted in partition `n` stays silent until
    /// the epoch moves on, then closes.
    partition_epoch: AtomicU64,
    partitioned: AtomicBool,
    stopped: AtomicBool,
}

/// One proxy: `addr` relays to `target`.
pub struct Proxy {
    pub addr: SocketAddr,
    pub target: SocketAddr,
    state: Arc<State>,
}

impl Proxy {
    /// Listens on a free loopback port and relays every connection to `target`.
    pub fn start(target: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            partition_epoch: AtomicU64::new(0),
            partitioned: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        });
        let accepting = Arc::clone(&state);
        std::thread::Builder::new()
            .name(format!("proxy-{}", addr.port()))
            .spawn(move || accept_loop(&listener, target, &accepting))?;
        Ok(Proxy { addr, target, state })
    }

    /// Cuts the node off from every client of this proxy until [`Proxy::heal`].
    pub fn partition(&self) {
        self.state.partition_epoch.fetch_add(1, Ordering::SeqCst);
        self.state.partitioned.store(true, Ordering::SeqCst);
    }

    pub fn heal(&self) {
        self.state.partitioned.store(false, Ordering::SeqCst);
    }

    pub fn is_partitioned(&self) -> bool {
        self.state.partitioned.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state.stopped.store(true, Ordering::SeqCst);
        // Wakes the accept loop so that it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

fn accept_loop(listener: &TcpListener, target: SocketAddr, state: &Arc<State>) {
    for client in listener.incoming() {
        if state.stopped.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = client else { continue };
        let state = Arc::clone(state);
        let _ = std::thread::Builder::new()
            .name("proxy-conn".into())
            .spawn(move || serve_connection(client, target, &state));
    }
}

fn serve_connection(client: TcpStream, target: SocketAddr, state: &Arc<State>) {
    if state.partitioned.load(Ordering::SeqCst) {
        // Silent until the partition heals, then closed (the client's own timeout decides).
        let epoch = state.partition_epoch.load(Ordering::SeqCst);
        while state.partitioned.load(Ordering::SeqCst)
            && state.partition_epoch.load(Ordering::SeqCst) == epoch
            && !state.stopped.load(Ordering::SeqCst)
        {
            std::thread::sleep(Duration::from_millis(POLL_MS));
        }
        let _ = client.shutdown(Shutdown::Both);
        return;
    }
    let Ok(upstream) = TcpStream::connect_timeout(&target, Duration::from_secs(2)) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (Ok(client_r), Ok(upstream_w)) = (client.try_clone(), upstream.try_clone()) else {
        return;
    };
    let back = Arc::clone(state);
    let _ = std::thread::Builder::new()
        .name("proxy-down".into())
        .spawn(move || relay(upstream, client, &back));
    relay(client_r, upstream_w, state);
}

/// Copies `from` → `to` until either side closes, holding bytes back while partitioned.
fn relay(mut from: TcpStream, mut to: TcpStream, state: &State) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(POLL_MS)));
    let mut buf = vec![0u8; 16 << 10];
    loop {
        if state.stopped.load(Ordering::SeqCst) {
            break;
        }
        if state.partitioned.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(POLL_MS));
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                while state.partitioned.load(Ordering::SeqCst)
                    && !state.stopped.load(Ordering::SeqCst)
                {
                    std::thread::sleep(Duration::from_millis(POLL_MS));
                }
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on a free port.
    fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = conn.read(&mut buf) {
                        if n == 0 || conn.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    fn round_trip(conn: &mut TcpStream, text: &[u8]) -> std::io::Result<Vec<u8>> {
        conn.write_all(text)?;
        let mut got = vec![0u8; text.len()];
        conn.read_exact(&mut got)?;
        Ok(got)
    }

    #[test]
    fn relays_then_stalls_while_partitioned_then_resumes() {
        let proxy = Proxy::start(echo()).unwrap();
        let mut conn = TcpStream::connect(proxy.addr).unwrap();
        conn.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        assert_eq!(round_trip(&mut conn, b"hello").unwrap(), b"hello");

        proxy.partition();
        assert!(round_trip(&mut conn, b"lost?").is_err(), "no answer through a partition");
        let mut fresh = TcpStream::connect(proxy.addr).unwrap();
        fresh.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        assert!(round_trip(&mut fresh, b"new").is_err(), "a new connection stays silent");

        proxy.heal();
        // The held bytes arrive now, then the connection works as before.
        let mut late = [0u8; 5];
        conn.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        conn.read_exact(&mut late).unwrap();
        assert_eq!(&late, b"lost?");
        assert_eq!(round_trip(&mut conn, b"again").unwrap(), b"again");
        let mut after = TcpStream::connect(proxy.addr).unwrap();
        after.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        assert_eq!(round_trip(&mut after, b"ok").unwrap(), b"ok");
    }
}
