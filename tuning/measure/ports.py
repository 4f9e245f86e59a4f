# Connect/close loop (client closes first: its port sits in TIME_WAIT) against a private
# listener in this namespace, until EADDRNOTAVAIL or 5 s. Prints connects done and the rate.
import socket, time, errno
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(4096); port = srv.getsockname()[1]
srv.setblocking(False)
n = 0; t0 = time.monotonic(); err = "none"
while time.monotonic() - t0 < 5:
    c = socket.socket()
    try: c.connect(("127.0.0.1", port))
    except OSError as e:
        err = errno.errorcode.get(e.errno, str(e.errno)); c.close(); break
    try: a = srv.accept()[0]
    except BlockingIOError: a = None
    c.close()  # the client closes first: TIME_WAIT stays on the client's port
    if a: a.close()
    n += 1
print(f"connects={n} in {time.monotonic()-t0:.2f}s stop={err}")
