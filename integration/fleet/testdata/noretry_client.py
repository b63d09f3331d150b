#!/usr/bin/env python3
"""Keep-alive HTTP/1.1 clients that never retry, with Python's http.client.

Run by integration/fleet (NoRetry): each of CLIENTS threads holds one
http.client.HTTPConnection to ADDR and sends METHOD / every EVERY_MS
milliseconds, each request with its own id in the X-Lbx-Request-Id header.
http.client never resends a request: on a reused connection that the server
closed it raises RemoteDisconnected. A response with "Connection: close"
makes http.client close the connection, and the next request opens a new
one: that is graceful, not a failure.

Usage: noretry_client.py ADDR CLIENTS EVERY_MS TIMEOUT_S PREFIX METHOD

It stops when its standard input closes (the harness closes it, and so does
the harness's death), lets every thread finish its request in flight, and
prints JSON lines on standard output: every 200 ms {"opened": n,
"requests": n, "failures": [...]} with the failures since the last line,
and last {"done": true, "sent": n, "opened": n, "requests": n,
"failures": [...]}. A failure is {"at": unix seconds, "kind": one of
RemoteDisconnected, EOF, reset, timeout, short, connect, status, other,
"fresh": whether the request went out on a new connection, "stale":
whether its reused connection had already closed (it was readable) before
the request was written, "sent": whether
any of it was written, "id": the request's id, "err": the error}.
"""

import http.client
import json
import random
import select
import socket
import sys
import threading
import time

ID_HEADER = "X-Lbx-Request-Id"


def kind_of(exc):
    """Names a request's exception as the Go clients name theirs."""
    if isinstance(exc, http.client.RemoteDisconnected):
        return "RemoteDisconnected"
    if isinstance(exc, http.client.IncompleteRead):
        return "short"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        return "reset"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "connect"
    return "other"


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.opened = 0
        self.requests = 0
        self.sent = 0
        self.failures = []  # since the last report

    def take(self, done=False):
        with self.lock:
            line = {"opened": self.opened, "requests": self.requests, "failures": self.failures}
            if done:
                line["done"] = True
                line["sent"] = self.sent
            self.failures = []
        return line


def client(idx, host, port, every, timeout, prefix, method, stop, tally):
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    body = b"x" * 64 if method == "POST" else None
    stop.wait(random.random() * every)  # spread the clients over the first period
    seq = 0
    while not stop.is_set():
        rid = "%s-%d-%d" % (prefix, idx, seq)
        seq += 1
        fresh = conn.sock is None
        # Readable while idle: the server's close (or stray bytes) came
        # before this request. http.client writes it anyway.
        stale = not fresh and bool(select.select([conn.sock], [], [], 0)[0])
        sent = False
        try:
            if fresh:
                conn.connect()
                with tally.lock:
                    tally.opened += 1
            sent = True
            conn.request(method, "/", body=body, headers={ID_HEADER: rid})
            res = conn.getresponse()
            data = res.read()
            if res.status != 200 or data != b"ok":
                raise ValueError("status %d, body %r" % (res.status, data[:40]))
            err = None
        except ValueError as e:
            err, kind = e, "status"
        except Exception as e:  # every other failure is one of the kinds
            err, kind = e, kind_of(e)
        with tally.lock:
            tally.requests += 1
            if sent:
                tally.sent += 1
            if err is not None:
                tally.failures.append({"at": time.time(), "kind": kind, "fresh": fresh,
                                       "stale": stale, "sent": sent, "id": rid, "err": "%s: %s" % (type(err).__name__, err)})
        if err is not None:
            conn.close()  # the next request opens a new connection; this one is not resent
        stop.wait(every)
    conn.close()


def main():
    addr, n, every_ms, timeout_s, prefix, method = sys.argv[1:7]
    host, port = addr.rsplit(":", 1)
    stop = threading.Event()
    tally = Tally()
    threads = [threading.Thread(target=client, daemon=True,
                                args=(i, host, int(port), int(every_ms) / 1000.0, float(timeout_s), prefix, method, stop, tally))
               for i in range(int(n))]
    for t in threads:
        t.start()

    def watch_stdin():
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    while not stop.wait(0.2):
        print(json.dumps(tally.take()), flush=True)
    for t in threads:
        t.join(float(timeout_s) + 5)
    print(json.dumps(tally.take(done=True)), flush=True)


if __name__ == "__main__":
    main()
