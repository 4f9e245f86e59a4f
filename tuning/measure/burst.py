# Connection burst against a private listener inside this network namespace (loopback only).
# Server: listen(1024) (glommio's backlog), stalls STALL_MS (a busy event loop), then accepts
# everything. Clients: N non-blocking connects at t=0, each sends a 16-byte request as soon as
# the connect completes (as an HTTP client would). Reports when connections were accepted.
import socket, sys, threading, time, selectors
N = int(sys.argv[1]); STALL_MS = int(sys.argv[2])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1024); port = srv.getsockname()[1]
accepted = []; t0 = time.monotonic()
def serve():
    time.sleep(STALL_MS / 1000)
    srv.settimeout(15)
    while len(accepted) < N:
        try: c, _ = srv.accept()
        except socket.timeout: break
        accepted.append((time.monotonic() - t0, c))
th = threading.Thread(target=serve); th.start()
sel = selectors.DefaultSelector(); clients = []
for i in range(N):
    s = socket.socket(); s.setblocking(False)
    try: s.connect(("127.0.0.1", port))
    except BlockingIOError: pass
    sel.register(s, selectors.EVENT_WRITE); clients.append(s)
pending = N
while pending and time.monotonic() - t0 < 15:
    for key, _ in sel.select(timeout=1):
        try: key.fileobj.send(b"GET / HTTP/1.1\r\n")
        except OSError: pass
        sel.unregister(key.fileobj); pending -= 1
th.join()
times = sorted(t for t, _ in accepted)
slow = sum(1 for t in times if t > 0.9)
print(f"accepted={len(times)}/{N} p50_ms={times[len(times)//2]*1000:.0f} p99_ms={times[int(len(times)*0.99)-1]*1000:.0f} last_ms={times[-1]*1000:.0f} over_900ms={slow}")
