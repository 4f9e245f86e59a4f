//! How a shard starts and what runs on it: the executor's body ([`run`]) joins the mesh,
//! connects Redis (shard 0 checks its settings), builds the [`Shard`], spawns every task the shard runs (mesh receivers,
//! `redis-sync`'s receiver, stock notices, the heartbeat, the activity refresh, the Redis
//! failover watch, the republish scanner, the periodic reconcile), binds its listeners (shard
//! 0 first, publishing the ports; the admin listener on shard 0) and serves until stopped,
//! then finishes what is in flight.
//!
//! Not here: what a shard owns (`state.rs`), the tasks themselves (their own files).

use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use glommio::channels::channel_mesh::{Full, MeshBuilder, Receivers};
use glommio::net::TcpListener;

use super::conn::{self, PublicListener};
use super::mesh::MeshMsg;
use super::request::Plane;
use super::shared::EdgeShared;
use super::state::Shard;
use super::store::Store;
use super::submit::{self, SubmitDeps};
use super::{dependency_poll, failover, reconcile, refresh, scanner, sync};
use crate::logic::placement::SkuKey;

/// Longest a stopping shard waits for requests in flight (each is bounded by its own Redis
/// and publish deadlines, well under this).
const STOP_WAIT_MS: u64 = 5_000;

/// Everything a shard needs to start, moved into its executor.
pub struct ShardStart {
    pub id: usize,
    pub shared: Arc<EdgeShared>,
    pub mesh: MeshBuilder<MeshMsg, Full>,
    pub http_addr: std::net::SocketAddr,
    pub admin_addr: std::net::SocketAddr,
    pub id_seed: [u8; 32],
    /// Events from `redis-sync` for the SKUs this shard owns.
    pub sync_rx: Option<tokio::sync::mpsc::Receiver<crate::durable::sync::SyncRequest>>,
    /// SKUs this shard owns whose stock another instance returned (`durable/notice.rs`).
    pub notice_rx: Option<tokio::sync::mpsc::Receiver<SkuKey>>,
}

/// The body of each shard's executor: connect, bind, serve until stopped.
pub async fn run(start: ShardStart) {
    let ShardStart { id, shared, mesh, http_addr, admin_addr, id_seed, sync_rx, notice_rx } = start;
    let Ok((senders, receivers)) = mesh.join().await else {
        tracing::error!(shard = id, "mesh join failed");
        return;
    };
    let Some(store) = Store::connect(id, &shared.config).await else {
        shared.stopping.store(true, Ordering::Relaxed);
        return;
    };
    if id == 0 && !store.check_settings(&shared).await {
        shared.stopping.store(true, Ordering::Relaxed);
        return;
    }
    let shard = Rc::new(Shard::new(id, &shared, store, senders, id_seed));
    spawn_mesh_receivers(&shard, receivers);
    if let Some(rx) = sync_rx {
        sync::spawn_receiver(&shard, rx);
    }
    if let Some(rx) = notice_rx {
        refresh::spawn_notices(&shard, rx);
    }
    spawn_heartbeat(&shard);
    refresh::spawn(&shard);
    failover::spawn(&shard);
    scanner::spawn(&shard, shared.config.scanner);
    reconcile::spawn(&shard);
    dependency_poll::spawn(&shard);
    let Some(public) = bind(&shard, http_addr, admin_addr).await else {
        shared.stopping.store(true, Ordering::Relaxed);
        return;
    };
    shared.started[id].store(true, Ordering::Relaxed);
    // Until stopping: a drain only shuts the listener (connections still answered).
    conn::serve_public(Rc::clone(&shard), public).await;
    finish_in_flight(&shard).await;
}

/// The shard's public listener (and on shard 0 the admin listener, with its accept loop).
/// Shard 0 binds first and publishes the ports (port 0 in tests resolves to one port that
/// every shard then shares through SO_REUSEPORT). `None`: binding failed, or the engine
/// stopped before shard 0 published its ports.
async fn bind(
    shard: &Rc<Shard>,
    http_addr: std::net::SocketAddr,
    admin_addr: std::net::SocketAddr,
) -> Option<PublicListener> {
    let (id, shared) = (shard.id, &shard.shared);
    let addr = if id == 0 {
        http_addr
    } else {
        let (http_port, _) = wait_for_ports(shared).await?;
        std::net::SocketAddr::new(http_addr.ip(), http_port)
    };
    let public = conn::bind_public(addr)
        .map_err(|e| tracing::error!(shard = id, error = %e, %addr, "bind failed"))
        .ok()?;
    if id == 0 {
        let admin = TcpListener::bind(admin_addr)
            .map_err(|e| tracing::error!(shard = id, error = %e, addr = %admin_addr, "admin bind failed"))
            .ok()?;
        let ports = (public.local_addr.port(), admin.local_addr().map_or(0, |a| a.port()));
        let _ = shared.ports.set(ports);
        glommio::spawn_local(conn::accept_loop(Rc::clone(shard), admin, Plane::Admin)).detach();
    }
    Some(public)
}

/// The ports shard 0 bound; `None` when the engine stops first.
async fn wait_for_ports(shared: &EdgeShared) -> Option<(u16, u16)> {
    loop {
        if let Some(ports) = shared.ports.get() {
            return Some(*ports);
        }
        if shared.is_stopping() {
            return None;
        }
        glommio::timer::sleep(Duration::from_millis(1)).await;
    }
}

/// Graceful stop: the listeners are closed; answer every request already being worked on (a
/// connection counts its requests until their answers are written) and the marks of acks
/// already answered — on every shard, since this shard may own SKUs whose submits others
/// still forward — before the executor (and every task on it) ends. Idle keep-alive
/// connections are simply closed.
async fn finish_in_flight(shard: &Shard) {
    let deadline = std::time::Instant::now() + Duration::from_millis(STOP_WAIT_MS);
    while shard.shared.metrics.requests_in_flight() > 0 || !shard.publish.is_idle() {
        if std::time::Instant::now() > deadline {
            tracing::warn!(
                shard = shard.id,
                in_flight = shard.shared.metrics.requests_in_flight(),
                "stopping with requests still in flight"
            );
            return;
        }
        glommio::timer::sleep(Duration::from_millis(2)).await;
    }
}

/// One receiver per peer: replica updates applied, forwarded submits answered as owner.
fn spawn_mesh_receivers(shard: &Rc<Shard>, receivers: Receivers<MeshMsg>) {
    let receivers = Rc::new(receivers);
    for peer in 0..shard.shared.table.shard_count() {
        if peer == shard.id {
            continue;
        }
        let shard = Rc::clone(shard);
        let receivers = Rc::clone(&receivers);
        glommio::spawn_local(async move {
            while let Ok(Some(message)) = receivers.recv_from(peer).await {
                match message {
                    MeshMsg::Replica(update) => shard.mesh.apply_replica(&update),
                    MeshMsg::Submit(forwarded) => {
                        let shard = Rc::clone(&shard);
                        let in_flight = &shard.metrics().requests_in_flight;
                        in_flight.fetch_add(1, Ordering::Relaxed);
                        glommio::spawn_local(async move {
                            submit::owner_forwarded(&SubmitDeps::of(&shard), *forwarded).await;
                            shard.metrics().requests_in_flight.fetch_sub(1, Ordering::Relaxed);
                        })
                        .detach();
                    }
                }
            }
        })
        .detach();
    }
}

/// Liveness: the loop's tick, every 100 ms; with it the adaptive limit's window moves on
/// (a shard without submissions still recovers its readiness) and its gauges are written.
fn spawn_heartbeat(shard: &Rc<Shard>) {
    let shard = Rc::clone(shard);
    glommio::spawn_local(async move {
        while !shard.shared.is_stopping() {
            let now = crate::logic::clock::now_ms();
            shard.shared.heartbeats[shard.id].store(now, Ordering::Relaxed);
            let (limit, ready) = {
                let mut owner = shard.owner.borrow_mut();
                owner.overload_tick(now, shard.shared.health.backlog());
                (owner.overload().limit(), owner.overload().ready())
            };
            let metrics = shard.metrics();
            metrics.admission_limit.store(u64::from(limit), Ordering::Relaxed);
            metrics.admission_unready.store(u64::from(!ready), Ordering::Relaxed);
            glommio::timer::sleep(Duration::from_millis(100)).await;
        }
    })
    .detach();
}
